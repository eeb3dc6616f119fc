"""The rollout node's trajectory log (node/trajectory_log.py): the line format the viewer
reads, which groups are recorded, the byte cap, torn lines and a run dir that cannot be
written. Token texts come from the real tiny model's tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentjet.protocol import (
    Sample,
    TrajectoryGroup,
    pack_floats,
    pack_ids,
    pack_mask,
    unpack_floats,
    unpack_ids,
    unpack_mask,
)
from node.trajectory_log import FILE_NAME, TrajectoryLog, find_trajectory, read_trajectories

pytestmark = pytest.mark.unit

KEYS = ["time", "group_id", "env", "task_id", "node_id", "policy_version", "samples"]
SAMPLE_KEYS = [
    "reward",
    "advantage",
    "episode",
    "policy_version",
    "turns",
    "finish_reason",
    "error",
    "prompt",
    "completion",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return encode(tokenizer, text)


def sample_of(prompt: list[int], runs: list[tuple[list[int], int]], **changes: Any) -> Sample:
    """A sample whose completion is `runs` of (ids, loss mask) in order; the model's runs
    (mask 1) get distinct logprobs with more digits than the log keeps, context runs 0."""
    ids = [i for run, _ in runs for i in run]
    mask = [m for run, m in runs for _ in run]
    logprobs = [-0.123456 * (k + 1) if m else 0.0 for k, m in enumerate(mask)]
    fields: dict[str, Any] = dict(
        prompt_ids=pack_ids(prompt),
        completion_ids=pack_ids(ids),
        logprobs=pack_floats(logprobs),
        loss_mask=pack_mask(mask),
        reward=1.0,
        advantage=0.0,
        policy_version=0,
    )
    return Sample(**(fields | changes))


def group_of(group_id: str, samples: list[Sample], env: str = "arithmetic") -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id=group_id,
        grant_id=group_id,
        node_id="node-a",
        task_id=f"task-{group_id}",
        env=env,
        samples=samples,
        created_at=1700000000.5,
    )


def small_group(tokenizer: Any, group_id: str, env: str = "arithmetic") -> TrajectoryGroup:
    answer = encode(tokenizer, f"The answer is {group_id}.")
    return group_of(group_id, [sample_of(chat_prompt(tokenizer, "2 + 3?"), [(answer, 1)])], env)


def test_a_line_holds_each_token_with_its_mask_logprob_and_the_samples_outcome(
    tmp_path: Path, tokenizer: Any
) -> None:
    prompt = chat_prompt(tokenizer, "What is 2 + 3? Show your work.")
    answers = ["2 plus 3 is 5.", "It is 6, I think."]
    samples = [
        sample_of(
            prompt,
            [(encode(tokenizer, text) + [tokenizer.eos_token_id], 1)],
            reward=reward,
            advantage=advantage,
            policy_version=version,
            finish_reason="stop",
            error=error,
        )
        for text, reward, advantage, version, error in zip(
            answers, (1.0, 0.0), (0.5, -0.5), (3, 4), ("", "reward parse: no integer"), strict=True
        )
    ]
    log = TrajectoryLog(tmp_path, share=1.0, cap_bytes=1 << 20, seed=0)

    assert log.maybe_record(group_of("g-1", samples, env="prompt"), tokenizer)

    [record] = read_trajectories(tmp_path / FILE_NAME)
    assert list(record) == KEYS
    assert record["time"] == 1700000000.5
    assert (record["group_id"], record["env"], record["task_id"], record["node_id"]) == (
        "g-1",
        "prompt",
        "task-g-1",
        "node-a",
    )
    assert record["policy_version"] == 4  # the newest sample's
    for line, sample, text in zip(record["samples"], samples, answers, strict=True):
        assert list(line) == SAMPLE_KEYS
        assert (line["reward"], line["advantage"]) == (sample.reward, sample.advantage)
        assert (line["policy_version"], line["episode"], line["turns"]) == (
            sample.policy_version,
            -1,
            1,
        )
        assert (line["finish_reason"], line["error"]) == ("stop", sample.error)
        prompt_text = "".join(t for t, _ in line["prompt"])
        assert prompt_text == tokenizer.decode(prompt)
        assert "<|im_start|>user\nWhat is 2 + 3? Show your work.<|im_end|>" in prompt_text
        assert {m for _, m in line["prompt"]} == {0}
        completion = unpack_ids(sample.completion_ids)
        assert "".join(t for t, _, _ in line["completion"]) == text + "<|im_end|>"
        assert [m for _, m, _ in line["completion"]] == unpack_mask(sample.loss_mask).tolist()
        sampled = unpack_floats(sample.logprobs).tolist()
        assert [lp for _, _, lp in line["completion"]] == [round(lp, 4) for lp in sampled]
        assert len(line["completion"]) == len(completion)
    assert record["samples"][0]["completion"][1][2] == -0.2469  # -0.246912 kept to 4 places


def test_a_merged_timeline_shows_each_model_call_as_a_rise_of_the_mask(
    tmp_path: Path, tokenizer: Any
) -> None:
    call_1 = encode(tokenizer, '<tool_call>{"name": "python", "arguments": {}}</tool_call>')
    call_1.append(tokenizer.eos_token_id)
    tool_output = encode(tokenizer, "\n<|im_start|>user\n<tool_response>5</tool_response>")
    tool_output += encode(tokenizer, "<|im_end|>\n<|im_start|>assistant\n")
    call_2 = encode(tokenizer, "The answer is 5.") + [tokenizer.eos_token_id]
    prompt = chat_prompt(tokenizer, "Use python: 2 + 3?")
    sample = sample_of(prompt, [(call_1, 1), (tool_output, 0), (call_2, 1)], turns=2, episode=0)
    log = TrajectoryLog(tmp_path, share=1.0, cap_bytes=1 << 20, seed=0)

    assert log.maybe_record(group_of("merged", [sample]), tokenizer)

    [line] = find_trajectory(tmp_path / FILE_NAME, "merged")["samples"]  # type: ignore[index]
    tokens = [(t, 0) for t, _ in line["prompt"]] + [(t, m) for t, m, _ in line["completion"]]
    rises = [k for k in range(1, len(tokens)) if tokens[k - 1][1] == 0 and tokens[k][1] == 1]
    assert len(rises) == 2
    texts = [t for t, _ in tokens]
    start_2 = len(prompt) + len(call_1) + len(tool_output)
    assert rises == [len(prompt), start_2]
    assert "".join(texts[rises[0] : rises[0] + len(call_1)]) == tokenizer.decode(call_1)
    assert "".join(texts[start_2:]) == "The answer is 5.<|im_end|>"
    assert "".join(texts) == tokenizer.decode(prompt + call_1 + tool_output + call_2)
    assert (line["turns"], line["episode"]) == (2, 0)
    assert all(lp == 0.0 for _, m, lp in line["completion"] if m == 0)


def test_the_share_picks_groups_by_a_seeded_hash_of_their_id(
    tmp_path: Path, tokenizer: Any
) -> None:
    ids = [f"grant-{k}" for k in range(400)]
    none = TrajectoryLog(tmp_path / "none", share=0.0, cap_bytes=1 << 20, seed=0)
    every = TrajectoryLog(tmp_path / "every", share=1.0, cap_bytes=1 << 20, seed=0)
    for group_id in ids[:20]:
        assert not none.maybe_record(small_group(tokenizer, group_id), tokenizer)
        assert every.maybe_record(small_group(tokenizer, group_id), tokenizer)
    assert not (tmp_path / "none" / FILE_NAME).exists()
    assert len(read_trajectories(tmp_path / "every" / FILE_NAME, limit=100)) == 20

    half = TrajectoryLog(tmp_path / "half", share=0.5, cap_bytes=1 << 20, seed=7)
    picked = {g for g in ids if half.picks(g)}
    assert 160 <= len(picked) <= 240
    same_seed = TrajectoryLog(tmp_path / "again", share=0.5, cap_bytes=1 << 20, seed=7)
    assert {g for g in ids if same_seed.picks(g)} == picked
    other_seed = TrajectoryLog(tmp_path / "other", share=0.5, cap_bytes=1 << 20, seed=8)
    assert {g for g in ids if other_seed.picks(g)} != picked
    recorded = [g for g in ids[:40] if half.maybe_record(small_group(tokenizer, g), tokenizer)]
    assert recorded == [g for g in ids[:40] if g in picked]
    lines = read_trajectories(tmp_path / "half" / FILE_NAME, limit=100)
    assert [r["group_id"] for r in lines] == recorded[::-1]  # newest first


def test_the_file_stays_under_its_cap_keeping_the_newest_groups(
    tmp_path: Path, tokenizer: Any
) -> None:
    cap = 4000
    log = TrajectoryLog(tmp_path, share=1.0, cap_bytes=cap, seed=0)
    path = tmp_path / FILE_NAME
    longest = 0
    assert log.maybe_record(small_group(tokenizer, "g000"), tokenizer)
    mode = path.stat().st_mode
    for k in range(1, 120):
        assert log.maybe_record(small_group(tokenizer, f"g{k:03d}"), tokenizer)
        longest = max(longest, len(path.read_bytes().splitlines(keepends=True)[-1]))
        assert path.stat().st_size <= cap + longest

    kept = [r["group_id"] for r in read_trajectories(path, limit=1000)]
    assert kept[0] == "g119"
    assert kept == [f"g{k:03d}" for k in range(119, 119 - len(kept), -1)]  # no gaps
    assert len(kept) < 120 and "g000" not in kept
    assert path.stat().st_mode == mode  # a rewrite leaves the dashboard able to read it
    assert not list(tmp_path.glob("*.tmp"))
    assert find_trajectory(path, "g000") is None
    assert find_trajectory(path, "g119")["task_id"] == "task-g119"  # type: ignore[index]

    size = path.stat().st_size
    prompt = chat_prompt(tokenizer, "x " * 400)
    huge = group_of("huge", [sample_of(prompt, [(encode(tokenizer, "y"), 1)])])
    assert not log.maybe_record(huge, tokenizer)
    assert log.too_large == 1
    assert path.stat().st_size == size


def test_readers_skip_a_torn_line_and_a_new_log_cuts_it_off(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / FILE_NAME
    log = TrajectoryLog(tmp_path, share=1.0, cap_bytes=1 << 20, seed=0)
    for k in range(3):
        log.maybe_record(small_group(tokenizer, f"g{k}", env="a" if k % 2 else "b"), tokenizer)
    whole = path.read_bytes()
    with path.open("ab") as f:  # an append cut short: a crash, or a reader too early
        f.write(whole.splitlines(keepends=True)[0][:50])

    assert [r["group_id"] for r in read_trajectories(path)] == ["g2", "g1", "g0"]
    assert [r["group_id"] for r in read_trajectories(path, env="b")] == ["g2", "g0"]
    assert [r["group_id"] for r in read_trajectories(path, limit=2)] == ["g2", "g1"]
    assert find_trajectory(path, "g0")["env"] == "b"  # type: ignore[index]
    assert read_trajectories(tmp_path / "missing.jsonl") == []

    restarted = TrajectoryLog(tmp_path, share=1.0, cap_bytes=1 << 20, seed=0)
    assert restarted.maybe_record(small_group(tokenizer, "g3"), tokenizer)
    assert path.read_bytes().startswith(whole)
    assert len(path.read_bytes().splitlines()) == 4
    assert [r["group_id"] for r in read_trajectories(path)] == ["g3", "g2", "g1", "g0"]


def test_a_run_dir_that_cannot_be_written_costs_one_warning(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the run dir should be")
    log = TrajectoryLog(blocker / "run", share=1.0, cap_bytes=1 << 20, seed=0)

    with caplog.at_level(logging.WARNING, logger="node.trajectory_log"):
        for k in range(3):
            assert not log.maybe_record(small_group(tokenizer, f"g{k}"), tokenizer)

    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no more trajectories are recorded" in warnings[0].getMessage()
    assert log.failed and log.recorded == 0
