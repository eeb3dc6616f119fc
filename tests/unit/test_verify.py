"""Verified trajectories: the gap statistic, the decisions, task rebuilding, reward re-checks,
quarantine bookkeeping, and the learner leaving forged groups out of its gradients exactly."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from transformers import AutoTokenizer

import tests.rewards
from agentjet import protocol, rl
from agentjet.bridge import DETACHED_PREFIX, abandoned, blocking
from agentjet.config import EnvConfig, TrainerConfig
from agentjet.episode import Episode, SamplingParams
from agentjet.tasks import TaskSource, arithmetic_task_from_id, generate_tasks, write_task_file
from agentjet_app.cli_status import format_swarm
from node.learner import Learner
from node.model import load_causal_lm
from node.rollout_produce import build_group
from node.torch_engine import TorchEngine
from node.verify import (
    MAX_LISTED_NODES,
    MAX_TRACKED_NODES,
    Admission,
    Quarantine,
    RewardCheck,
    find_task,
    over_gap,
    picked_for_reward_check,
    reward_checkers,
    reward_problem,
)
from sandboxes.envs.chat import chat_prompt_ids
from tests.factories import forge, make_group
from tests.unit.test_trainer_logic import lone_optimizer

pytestmark = pytest.mark.unit

ARITHMETIC = reward_checkers([])["arithmetic"]


def arithmetic_problem(
    group: protocol.TrajectoryGroup, task: protocol.Task, tokenizer: Any
) -> str | None:
    return asyncio.run(reward_problem(group, task, tokenizer, ARITHMETIC))


def test_logprob_differences_sum_each_samples_trained_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.5, -2.0, -0.5], [-4.0, -4.0, -4.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    # sample 0: 0.5 + 0, the untrained third token ignored; sample 1: nothing trained
    assert rl.logprob_differences(logprobs, sampler, mask).tolist() == [0.5, 0.0]
    assert rl.logprob_gap([0.5, 0.0], [2, 0]) == 0.5 / 16  # nothing trained: not counted
    assert rl.logprob_gap([], []) == 0.0


def group_gap(learner: list[list[float]], sampler: list[list[float]]) -> float:
    """rl.logprob_gap of a group whose samples (rows, every token trained) the learner and
    the sampler gave these logprobs."""
    differences = rl.logprob_differences(
        torch.tensor(learner), torch.tensor(sampler), torch.ones(len(learner), len(learner[0]))
    ).tolist()
    return rl.logprob_gap(differences, [len(row) for row in learner])


def test_a_groups_gap_is_its_mean_difference_each_sample_counting_16_tokens_at_least():
    # +1 and -1 cancel; a 2-token sample counts as 16 tokens, a 20-token one as 20
    assert rl.logprob_gap([1.0, -1.0], [20, 20]) == 0.0
    assert rl.logprob_gap([-4.0, -2.0], [2, 20]) == 6.0 / 36
    assert rl.GAP_MIN_SAMPLE_TOKENS == 16


def test_honest_short_answers_pass_after_the_policy_moved():
    """Eight answers of two tokens (the answer, then end of turn), four True and four False.
    Some versions on, the policy moved True from 0.5 to 0.9 (False to 0.1): honestly, each
    True sample is ln 1.8 = 0.588 likelier now and each False ln 0.2 = -1.609 less likely.
    A False sample's mean |difference| is (1.609 + 0) / 2 = 0.80, over the bound 0.5 (the
    check before, which quarantined such a run's only rollout node); the group's mean
    difference, each sample counting 16 tokens, is |4 (0.588) - 4 (1.609)| / 128 = 0.0319."""
    true, false = [math.log(0.9), 0.0], [math.log(0.1), 0.0]
    before = [math.log(0.5), 0.0]
    moved = group_gap([true] * 4 + [false] * 4, [before] * 8)
    assert moved == pytest.approx((4 * math.log(0.2) + 4 * math.log(1.8)) / -128)
    assert moved == pytest.approx(0.0319, abs=1e-4)
    assert over_gap({"honest": moved}, TrainerConfig().max_logprob_gap) == set()


def test_forged_groups_fail_and_what_a_short_answer_cannot_show():
    """The bench's forgeries, on four 16-token samples whose every token the learner gives
    -2: logprobs zeroed |64 (-2)| / 64 = 2, halved 1, one token swapped for one the learner
    gives -12 (its logprob kept): |4 (-10)| / 64 = 0.625, every token swapped 10. On eight
    2-token answers (the learner: -2 and -0.5), a swapped answer token still gives
    |8 (-10)| / 128 = 0.625; zeroed logprobs claim 2.5 nats a sample, 20 / 128 = 0.156,
    within an honest move, and pass."""
    bound = TrainerConfig().max_logprob_gap
    learner = [[-2.0] * 16] * 4
    swapped_one = [[-12.0] + [-2.0] * 15] * 4
    forged = {
        "zeroed": group_gap(learner, [[0.0] * 16] * 4),
        "halved": group_gap(learner, [[-1.0] * 16] * 4),
        "one_token_altered": group_gap(swapped_one, learner),
        "all_tokens_altered": group_gap([[-12.0] * 16] * 4, learner),
    }
    assert forged == pytest.approx(
        {"zeroed": 2.0, "halved": 1.0, "one_token_altered": 0.625, "all_tokens_altered": 10.0}
    )
    assert over_gap(forged, bound) == set(forged)
    answer = [[-2.0, -0.5]] * 8
    assert group_gap(answer, answer) == 0.0
    assert group_gap([[-12.0, -0.5]] * 8, answer) == pytest.approx(0.625)
    assert group_gap(answer, [[0.0, 0.0]] * 8) == pytest.approx(0.156, abs=1e-3)


def test_groups_over_the_gap_bound_are_rejected_and_zero_turns_the_check_off():
    gaps = {"honest": 0.02, "edge": 0.5, "forged": 3.1}
    assert over_gap(gaps, 0.5) == {"forged"}
    assert over_gap(gaps, 0.0) == set()


def test_the_reward_check_picks_a_share_of_group_ids_a_sender_cannot_predict():
    ids = [f"grant-{i}" for i in range(2000)]
    picked = [g for g in ids if picked_for_reward_check(g, 0.25, b"trainer-1")]
    assert 400 <= len(picked) <= 600
    assert picked == [g for g in ids if picked_for_reward_check(g, 0.25, b"trainer-1")]
    # another trainer's secret picks other groups
    assert picked != [g for g in ids if picked_for_reward_check(g, 0.25, b"trainer-2")]
    assert all(picked_for_reward_check(g, 1.0, b"") for g in ids)
    assert not any(picked_for_reward_check(g, 0.0, b"") for g in ids)


def test_generated_arithmetic_tasks_are_rebuilt_from_their_ids(tmp_path: Path):
    tasks = generate_tasks(30, seed=3, env="arithmetic")
    assert [arithmetic_task_from_id(t.id, "arithmetic") for t in tasks] == tasks
    for bad in ("t1", "d4:1+1", "d1:1/1", "d1:1+1 ", "d3:1234+1", "d1:" + "9" * 5000 + "+1"):
        assert arithmetic_task_from_id(bad, "arithmetic") is None
    only_sums = TaskSource("arithmetic", difficulties=[1], ops=["+"])
    assert only_sums.find("d1:3+4") == arithmetic_task_from_id("d1:3+4", "arithmetic")
    assert only_sums.find("d2:30+40") is None and only_sums.find("d1:3*4") is None
    path = tmp_path / "tasks.jsonl"
    write_task_file(tasks[:3], path)
    from_file = TaskSource("arithmetic", task_file=str(path))
    assert from_file.find(tasks[0].id) == tasks[0] and from_file.find(tasks[5].id) is None
    group = make_group()
    assert find_task(group, [only_sums]) is None  # "t1" is no task of this trainer's
    assert find_task(msgspec.structs.replace(group, task_id="d1:3+4"), [only_sums]) is not None
    assert find_task(msgspec.structs.replace(group, env="shell"), [only_sums]) is None


def test_rewards_are_rechecked_against_the_task_the_prompt_asks(tiny_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = arithmetic_task_from_id("d1:3+4", "arithmetic")
    other = arithmetic_task_from_id("d1:2+2", "arithmetic")
    assert task is not None and other is not None

    def group(asked: protocol.Task, answers: list[str], rewards: list[float]):
        prompt = chat_prompt_ids(tokenizer, None, asked)
        samples = [
            protocol.Sample(
                prompt_ids=protocol.pack_ids(prompt),
                completion_ids=protocol.pack_ids(tokenizer.encode(a, add_special_tokens=False)),
                logprobs=protocol.pack_floats([-0.1] * len(tokenizer.encode(a))),
                loss_mask=protocol.pack_mask([1] * len(tokenizer.encode(a))),
                reward=r,
                advantage=0.0,
                policy_version=0,
            )
            for a, r in zip(answers, rewards, strict=True)
        ]
        return msgspec.structs.replace(make_group(), task_id=task.id, samples=samples)

    assert arithmetic_problem(group(task, ["It is 7.", "5"], [1.0, 0.0]), task, tokenizer) is None
    wrong = arithmetic_problem(group(task, ["It is 7.", "5"], [1.0, 1.0]), task, tokenizer)
    assert wrong == "sample 1: reward 1 reported, 0 on re-check"
    # a right answer to another question, claimed for this task
    asked_other = arithmetic_problem(group(other, ["7"], [1.0]), task, tokenizer)
    assert asked_other == "sample 0: the prompt does not ask task 'd1:3+4'"
    # with partial credit (envs' partial_credit) the checker scores a wrong 17 by its digits
    credit = reward_checkers([EnvConfig(name="arithmetic", partial_credit=0.5)])["arithmetic"]
    shaped = group(task, ["It is 7.", "17"], [1.0, 0.25])
    assert asyncio.run(reward_problem(shaped, task, tokenizer, credit)) is None
    unshaped = arithmetic_problem(shaped, task, tokenizer)
    assert unshaped == "sample 1: reward 0.25 reported, 0 on re-check"


class CharTokenizer:
    """Token ids are code points: groups made by hand, without a model."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


CAPITAL = protocol.Task(id="q1", env="prompt", prompt="Capital of France?", answer="Paris")
SUM = arithmetic_task_from_id("d1:3+4", "arithmetic")


def reward_check(tmp_path: Path, reward: str, timeout_s: float) -> RewardCheck:
    """A trainer's reward check, every group picked, of arithmetic and of a "prompt"
    environment whose task file holds CAPITAL, scored by tests/rewards.py `reward`."""
    task_file = tmp_path / "tasks.jsonl"
    row = {"id": CAPITAL.id, "prompt": CAPITAL.prompt, "answer": CAPITAL.answer}
    task_file.write_text(json.dumps(row) + "\n")
    prompt = EnvConfig(name="prompt", task_file=str(task_file), reward=f"tests.rewards:{reward}")
    config = TrainerConfig(reward_check_fraction=1.0, reward_check_timeout_s=timeout_s)
    return RewardCheck([EnvConfig(name="arithmetic"), prompt], config, secret=b"test")


def played(
    task: protocol.Task, group_id: str, answers: list[str], rewards: list[float]
) -> protocol.TrajectoryGroup:
    """A group of `task` as a rollout node sends it: `answers` with the `rewards` it claims."""
    prompt = CharTokenizer.encode(" ".join(m["content"] for m in task.messages()))
    samples = [
        protocol.Sample(
            prompt_ids=protocol.pack_ids(prompt),
            completion_ids=protocol.pack_ids(CharTokenizer.encode(a)),
            logprobs=protocol.pack_floats([-0.1] * len(a)),
            loss_mask=protocol.pack_mask([1] * len(a)),
            reward=r,
            advantage=0.0,
            policy_version=0,
        )
        for a, r in zip(answers, rewards, strict=True)
    ]
    return msgspec.structs.replace(
        make_group(group_id), env=task.env, task_id=task.id, samples=samples
    )


@pytest.fixture
def blocked_rewards() -> Iterator[None]:
    """tests/rewards.py `blocks` hangs during the test; its threads end after it."""
    tests.rewards.ENTERED.clear()
    tests.rewards.RELEASE.clear()
    yield
    tests.rewards.RELEASE.set()
    for thread in threading.enumerate():
        if thread.name.startswith(DETACHED_PREFIX):
            thread.join()
    assert abandoned() == 0


def test_a_quick_reward_function_is_rechecked(tmp_path: Path) -> None:
    check = reward_check(tmp_path, "says_answer", timeout_s=30.0)
    right = played(CAPITAL, "right", ["It is Paris.", "Lyon"], [1.0, 0.0])
    wrong = played(CAPITAL, "wrong", ["It is Paris.", "Lyon"], [1.0, 1.0])
    assert asyncio.run(check.problem(right, CharTokenizer)) is None
    problem = asyncio.run(check.problem(wrong, CharTokenizer))
    assert problem == "sample 1: reward 1 reported, 0 on re-check"
    unknown = msgspec.structs.replace(right, task_id="q2")  # no row of this trainer's
    assert asyncio.run(check.problem(unknown, CharTokenizer)) is None
    assert check.metrics() == {"groups_reward_unchecked": 1, "reward_threads_left": 0}


@pytest.mark.parametrize("reward", ["blocks", "never_returns"], ids=["sync", "async"])
def test_a_reward_check_that_never_ends_is_given_up_and_the_rewards_kept(
    tmp_path: Path, reward: str, blocked_rewards: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Past trainer.reward_check_timeout_s a check proves nothing: the rewards stand as sent
    (wrong ones too), counted and logged. A sync function's thread cannot be stopped: it is
    counted while it runs."""
    check = reward_check(tmp_path, reward, timeout_s=0.05)
    wrong = played(CAPITAL, "hangs", ["It is Paris.", "Lyon"], [0.0, 1.0])
    with caplog.at_level(logging.WARNING, logger="node.verify"):
        assert asyncio.run(check.problem(wrong, CharTokenizer)) is None
    left = 1 if reward == "blocks" else 0
    assert check.metrics() == {"reward_check_timeouts": 1, "reward_threads_left": left}
    assert check.in_check == set()
    [line] = [r.message for r in caplog.records if r.name == "node.verify"]
    assert line.startswith("gave up a reward re-check (trainer.reward_check_timeout_s = 0.05 s)")
    assert "group hangs from test-node" in line


def test_a_blocked_reward_check_leaves_the_loop_checking_other_groups(
    tmp_path: Path, blocked_rewards: None
) -> None:
    """While a sync reward function blocks (in a thread of its own) the loop checks other
    groups; the blocked check ends when its function returns, checked as any."""
    check = reward_check(tmp_path, "blocks", timeout_s=60.0)
    assert SUM is not None
    blocked = played(CAPITAL, "blocked", ["It is Paris.", "Lyon"], [0.0, 1.0])
    sums = [played(SUM, "right sum", ["It is 7.", "5"], [1.0, 0.0]),
            played(SUM, "wrong sum", ["It is 7.", "5"], [1.0, 1.0])]  # fmt: skip

    async def scenario() -> tuple[list[str | None], str | None]:
        pending = asyncio.create_task(check.problem(blocked, CharTokenizer))
        await blocking(tests.rewards.ENTERED.wait)  # the function runs, and blocks
        assert check.in_check == {"blocked"}
        served = [await check.problem(group, CharTokenizer) for group in sums]
        assert not pending.done()
        tests.rewards.RELEASE.set()
        return served, await pending

    served, blocked_problem = asyncio.run(scenario())
    assert served == [None, "sample 1: reward 1 reported, 0 on re-check"]
    assert blocked_problem == "sample 1: reward 1 reported, 0 on re-check"
    assert check.metrics() == {"reward_threads_left": 0}


def test_a_node_is_quarantined_after_its_nth_failed_check():
    quarantine = Quarantine(after=3)
    assert not quarantine.failed("bad", "gap 3")
    assert not quarantine.failed("bad", "gap 4")
    assert not quarantine.failed("good", "gap 1")
    assert quarantine.reason("bad") is None and quarantine.listed() == []
    assert quarantine.failed("bad", "wrong reward")
    assert not quarantine.failed("bad", "again")  # quarantined once
    assert quarantine.reason("bad") == (
        "quarantined: 3 failed checks (trainer.quarantine_after=3), the last: wrong reward"
    )
    assert quarantine.reason("good") is None
    assert quarantine.listed() == ["bad"]


def test_a_quarantine_beside_other_nodes_lasts_and_stays_quiet():
    quarantine = Quarantine(after=1, alone_lift_s=300.0, reminder_s=60.0)
    assert quarantine.failed("bad", "gap 3", now=0.0)
    assert quarantine.admit("good", 10.0) == Admission()
    for now in (20.0, 400.0, 4000.0):
        quarantine.admit("good", now - 5)
        admission = quarantine.admit("bad", now)
        assert admission.refused == quarantine.reason("bad")
        assert admission.lifted is None and admission.reminder is None


def test_a_quarantine_of_the_only_node_is_said_every_minute_then_lifted():
    """No other node sends: the trainer trains nothing. It says so at the first refused group
    and every reminder_s after, naming the settings, and lifts the quarantine after
    alone_lift_s, forgiving the node's failures."""
    quarantine = Quarantine(after=2, alone_lift_s=300.0, reminder_s=60.0)
    quarantine.admit("only", 0.0)
    assert not quarantine.failed("only", "gap 0.9", now=1.0)
    assert quarantine.failed("only", "gap 0.8", now=2.0)
    reminders = []
    for now in (12.0, 30.0, 62.0, 72.0, 122.0, 299.0):
        admission = quarantine.admit("only", now)
        assert admission.refused is not None and admission.lifted is None
        if admission.reminder is not None:
            reminders.append((now, admission.reminder))
    assert [now for now, _ in reminders] == [12.0, 72.0, 299.0]
    first = reminders[0][1]
    assert "quarantined node only" in first and "for 10 s" in first
    assert "the quarantine lifts in 290 s" in first
    assert "trainer.max_logprob_gap (0 = off) or trainer.quarantine_after" in first
    lifted = quarantine.admit("only", 302.0)
    assert lifted.refused is None and lifted.reminder is None
    assert lifted.lifted is not None and "only lifted after 300 s" in lifted.lifted
    assert quarantine.listed() == [] and quarantine.reason("only") is None
    assert not quarantine.failed("only", "gap 0.7", now=303.0)  # forgiven: counted afresh
    assert quarantine.failed("only", "gap 0.7", now=304.0)


def test_a_quarantine_that_never_lifts_still_says_so():
    quarantine = Quarantine(after=1, alone_lift_s=0.0, reminder_s=60.0)
    quarantine.failed("only", "gap 2", now=0.0)
    admission = quarantine.admit("only", 1e6)
    assert admission.refused is not None and admission.lifted is None
    assert (
        admission.reminder is not None and "lasts until the trainer restarts" in admission.reminder
    )
    assert "lasts until the trainer restarts" in quarantine.consequence()


def test_quarantine_bookkeeping_is_bounded_against_made_up_node_ids():
    quarantine = Quarantine(after=1)
    for i in range(MAX_TRACKED_NODES + 5):
        quarantine.failed(f"n{i}", "x")
    assert len(quarantine.failures) == MAX_TRACKED_NODES
    assert quarantine.reason("n0") is None and quarantine.reason(f"n{MAX_TRACKED_NODES}")
    assert len(quarantine.listed()) == MAX_LISTED_NODES


def test_status_shows_each_trainers_quarantined_nodes():
    records = [
        protocol.NodeRecord(node_id="t1", role="trainer", quarantined=["rollout-x", "rollout-y"]),
        protocol.NodeRecord(node_id="r1", role="rollout"),
    ]
    assert "quarantined by t1: rollout-x, rollout-y" in format_swarm(records, now=0.0)
    # a record from before the field existed still decodes
    old = msgspec.msgpack.encode({"node_id": "t0", "role": "trainer"})
    assert protocol.node_record_decoder.decode(old).quarantined == []


def test_status_shows_what_each_trainer_refused():
    records = [
        protocol.NodeRecord(
            node_id="t1", role="trainer", refused={"round_joins": 5, "impersonation": 2}
        ),
        protocol.NodeRecord(node_id="t2", role="trainer"),
    ]
    shown = format_swarm(records, now=0.0)
    assert "refused by t1: impersonation 2, round joins 5" in shown
    assert "refused by t2" not in shown


def test_the_learner_leaves_forged_groups_out_of_its_gradients_exactly(
    tiny_model_dir: Path, one_torch_thread: None
):
    """Honest groups sampled by the engine pass; the same groups with made-up logprobs or
    altered tokens are rejected, and the step is the one the honest groups alone make."""
    temperature = 0.7
    engine = TorchEngine(tiny_model_dir, seed=2)
    params = SamplingParams(temperature=temperature, max_new_tokens=6)
    honest = []
    for i, prompt in enumerate([[1, 5, 9, 200], [1, 7, 300, 400]]):
        episodes = []
        [samples] = asyncio.run(engine.generate([prompt], 3, params))
        for j, completion in enumerate(samples):
            episode = Episode(prompt_ids=prompt, reward=float(j == 0))
            episode.add_model_turn(completion)
            episodes.append(episode)
        task = protocol.Task(id=f"t{i}", env="arithmetic", prompt="")
        grant = protocol.WorkGrant(grant_id=f"h{i}", task=task, group_size=3, lease_s=1.0)
        honest.append(build_group(grant, episodes, "n", 0.0))
    vocab = engine.vocab_size
    forged = [
        forge(honest[0], "zero-logprobs", logprobs=lambda lp: lp * 0),
        forge(honest[1], "altered-tokens", tokens=lambda ids: (ids + 1000) % vocab),
    ]

    def step(groups: list[protocol.TrajectoryGroup]) -> tuple[dict, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model, _ = load_causal_lm(tiny_model_dir)
        optimizer = lone_optimizer(model, target_batch_size=6)
        config = TrainerConfig(micro_batch_samples=2, max_logprob_gap=0.5)
        row = Learner(model, optimizer, config, temperature, 0).train_step(groups).row()
        return row, model.state_dict()

    mixed, mixed_weights = step([forged[0], honest[0], forged[1], honest[1]])
    alone, alone_weights = step(honest)
    nothing, _ = step(forged)  # every group rejected: no step, no error
    assert nothing["policy_version"] == 0 and not nothing["optimizer_stepped"]
    assert nothing["rejected_group_ids"] == ["altered-tokens", "zero-logprobs"]
    assert mixed["rejected_group_ids"] == ["altered-tokens", "zero-logprobs"]
    assert max(mixed["logprob_gaps"][g.group_id] for g in honest) < 1e-4
    assert min(mixed["logprob_gaps"][g.group_id] for g in forged) > 1.0
    assert mixed["charts/samples"] == 6 and mixed["charts/trained_samples"] == 6
    assert mixed["policy_version"] == alone["policy_version"] == 1
    for key, value in alone_weights.items():
        assert torch.equal(mixed_weights[key], value), key


def test_random_prompts_do_not_break_the_reward_check(tiny_model_dir: Path):
    """Hostile token ids (any id of the vocabulary) decode and are judged, never raise."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = arithmetic_task_from_id("d1:3+4", "arithmetic")
    assert task is not None
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        sample = protocol.Sample(
            prompt_ids=protocol.pack_ids(ids),
            completion_ids=protocol.pack_ids(ids),
            logprobs=protocol.pack_floats([0.0] * len(ids)),
            loss_mask=protocol.pack_mask([1] * len(ids)),
            reward=1.0,
            advantage=0.0,
            policy_version=0,
        )
        group = msgspec.structs.replace(make_group(), samples=[sample])
        assert arithmetic_problem(group, task, tokenizer) is not None
