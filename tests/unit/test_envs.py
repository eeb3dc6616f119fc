"""Built-in environments: answer parsing, tool feedback, and whole episodes played against a
scripted generator that uses the real SmolLM2 tokenizer (the python tool's, whose programs
run in process sandboxes: tests/integration/test_envs.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentjet.config import EnvConfig, config_from_dict
from agentjet.episode import Completion, SamplingParams
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from sandboxes.base import ExecResult
from sandboxes.envs import ArithmeticEnv, PythonToolEnv, make_env
from sandboxes.envs.parsing import (
    digit_share,
    exact_answer_reward,
    final_integer,
    first_code_block,
    strip_code_blocks,
)
from sandboxes.envs.sandboxed import MAX_TOOL_OUTPUT_CHARS, tool_feedback

pytestmark = pytest.mark.unit

PARAMS = SamplingParams(max_new_tokens=64)
# The policy version the scripted generator starts at; it moves on after every call.
START_VERSION = 3


# ── pure rules ────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", 42),
        ("-12", -12),
        ("1,234", 1234),
        ("1,234,567", 1234567),
        ("3 + 4 = 56.", 56),
        ("The answer is 7.0", 7),
        ("5 − 3 = 2", 2),
        ("x = −4", -4),
        ("10-3", 3),  # subtraction, not a negative 3
        ("(10)-3", 3),
        ("First 3, then 12.", 12),
        ("It is 3.5", None),
        ("no number here", None),
        ("", None),
        ("12,34", 34),  # not a thousands group: two numbers
    ],
)
def test_final_integer(text: str, expected: int | None) -> None:
    assert final_integer(text) == expected


@pytest.mark.parametrize(
    ("given", "answer", "expected"),
    [
        (936, 936, 1.0),
        (926, 936, 2 / 3),  # ones and hundreds
        (36, 936, 2 / 3),  # a missing digit is wrong
        (1036, 936, 2 / 4),  # so is an extra one
        (639, 936, 1 / 3),  # digits in the wrong places: only the middle one
        (-12, 12, 0.0),  # the sign differs
        (-13, -12, 1 / 2),
        (0, 0, 1.0),
        (7, 0, 0.0),
    ],
)
def test_digit_share(given: int, answer: int, expected: float) -> None:
    assert digit_share(given, answer) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "credit", "expected"),
    [
        ("936", 0.0, 1.0),
        ("926", 0.0, 0.0),  # no partial credit: right or wrong
        ("936", 0.5, 1.0),
        ("The answer is 926.", 0.5, 0.5 * 2 / 3),
        ("no number", 0.5, 0.0),
        ("93.6", 0.5, 0.0),  # not an integer
    ],
)
def test_partial_credit_ranks_wrong_answers_below_a_right_one(
    text: str, credit: float, expected: float
) -> None:
    assert exact_answer_reward(text, 936, credit) == pytest.approx(expected)


def test_partial_credit_for_an_answer_that_is_not_a_number_is_none() -> None:
    # another caller's answer (an arithmetic task file's is refused unless an integer)
    assert exact_answer_reward("926", "936", 0.5) == 0.0  # type: ignore[arg-type]
    assert exact_answer_reward("926", None, 0.5) == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Let me see.\n```python\nprint(12 * 34)\n```\nDone.", "print(12 * 34)\n"),
        ("```py\nx = 1\n```", "x = 1\n"),
        ("```Python3 \nprint(1)\n```", "print(1)\n"),
        ("```python\na\n```\n```python\nb\n```", "a\n"),  # the first block runs
        ("```\nprint(1)\n```", None),  # unlabelled: not code to run
        ("```python\nprint(1)", None),  # cut off by the token limit
        ("The answer is 408.", None),
    ],
)
def test_first_code_block(text: str, expected: str | None) -> None:
    assert first_code_block(text) == expected


def test_strip_code_blocks_hides_numbers_inside_code() -> None:
    text = "```python\nprint(12 * 34)\n```"
    assert final_integer(strip_code_blocks(text)) is None
    assert final_integer(strip_code_blocks(text + " so 408")) == 408


def _result(stdout: str = "", stderr: str = "", exit_code: int = 0, **kw: Any) -> ExecResult:
    return ExecResult(stdout=stdout, stderr=stderr, exit_code=exit_code, duration_s=0.1, **kw)


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (_result("408\n"), "Output:\n408"),
        (_result(), "Output:\n(nothing printed)"),
        (
            _result(stderr="Traceback (most recent call last):\n  …\nNameError: x\n", exit_code=1),
            "Output:\nError: NameError: x",
        ),
        (
            _result("1\n2\n", exit_code=-9, timed_out=True),
            "Output:\n1\n2\nError: timed out after 5 s",
        ),
        (_result(exit_code=-1, error="cannot start"), "Output:\nError: the code could not be run"),
        (_result(exit_code=-9), "Output:\nError: exit code -9"),
        (
            _result("x" * 1000, truncated=True),
            "Output:\n" + "x" * MAX_TOOL_OUTPUT_CHARS + " …(truncated)",
        ),
    ],
)
def test_tool_feedback(result: ExecResult, expected: str) -> None:
    assert tool_feedback(result, timeout_s=5.0) == expected


# ── episodes against a scripted generator ─────────────────────────────────────────


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


Reply = str | Completion


class ScriptedGenerator:
    """A Generator whose replies are scripted per call: `script[k][i][j]` answers sample j
    of prompt i in call k. A text reply becomes its tokens plus <|im_end|>, with distinct
    logprobs, so tests know exactly which ids and logprobs the "model" produced."""

    def __init__(self, tokenizer: Any, script: list[list[list[Reply]]]) -> None:
        self.tokenizer = tokenizer
        self.policy_version = START_VERSION
        self.script = script
        self.calls: list[tuple[list[list[int]], int]] = []

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        replies = self.script[len(self.calls)]
        self.calls.append(([list(p) for p in prompts], n))
        assert len(replies) == len(prompts) and all(len(r) == n for r in replies)
        self.policy_version += 1  # a new policy arrives while the episodes run
        return [[self.completion(r) if isinstance(r, str) else r for r in rs] for rs in replies]

    def completion(self, text: str) -> Completion:
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(ids, _logprobs(len(ids)), "stop")


def _logprobs(count: int) -> list[float]:
    return [-(k + 1) / 64 for k in range(count)]


def _task(answer: int, prompt: str = "What is the answer?") -> Task:
    return Task(id=f"t{answer}", env="test", prompt=prompt, answer=answer)


def _rendered_prompt(tokenizer: Any, system: str | None, user: str) -> str:
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_arithmetic_with_partial_credit_scores_wrong_answers_by_their_digits(
    tokenizer: Any,
) -> None:
    tasks = [_task(936, "What is 347 + 589?")]
    replies: list[Reply] = ["936", "926", "1036", "nine hundred"]
    generator = ScriptedGenerator(tokenizer, [[replies]])
    env = make_env(EnvConfig(name="arithmetic", partial_credit=0.5))
    [group] = asyncio.run(env.run_group(generator, tasks, 4, PARAMS))
    assert [e.reward for e in group] == pytest.approx([1.0, 1 / 3, 0.25, 0.0])


def test_partial_credit_is_only_for_arithmetic(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Say hi.", "answer": "hi"}\n')
    entry = {"name": "prompt", "task_file": str(rows), "reward": "tests.rewards:even_length"}
    config_from_dict({"envs": [entry]})  # loads without it
    with pytest.raises(ConfigError, match='envs.0.partial_credit: only "arithmetic"'):
        config_from_dict({"envs": [entry | {"partial_credit": 0.5}]})


def test_arithmetic_rewards_the_final_integer(tokenizer: Any) -> None:
    tasks = [_task(7, "What is 3 + 4?"), _task(-12, "What is 3 - 15?")]
    script: list[list[list[Reply]]] = [
        [["3 + 4 = 7", "The answer is 7.", "8"], ["-12", "12", "3 - 15 = -12"]]
    ]
    generator = ScriptedGenerator(tokenizer, script)
    env = ArithmeticEnv()
    groups = asyncio.run(env.run_group(generator, tasks, 3, PARAMS))

    assert [[e.reward for e in g] for g in groups] == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    [(prompts, n)] = generator.calls
    assert n == 3
    for task, prompt, group in zip(tasks, prompts, groups, strict=True):
        rendered = _rendered_prompt(tokenizer, env.system_prompt, task.prompt)
        assert tokenizer.decode(prompt) == rendered
        for episode in group:
            assert episode.prompt_ids == prompt
    episode = groups[0][1]
    assert episode.completion_ids == generator.completion("The answer is 7.").token_ids
    assert episode.logprobs == _logprobs(len(episode.completion_ids))
    assert set(episode.loss_mask) == {1}
    assert (episode.turns, episode.finish_reason, episode.error) == (1, "stop", "")
    assert episode.policy_version == START_VERSION


def test_make_env_builds_what_the_config_names() -> None:
    assert isinstance(make_env(EnvConfig(name="arithmetic")), ArithmeticEnv)
    env = make_env(EnvConfig(name="python_tool", max_turns=5, tool_timeout_s=2.0))
    assert isinstance(env, PythonToolEnv)
    assert (env.name, env.max_turns, env.tool_timeout_s) == ("python_tool", 5, 2.0)
    with pytest.raises(ConfigError, match="chess"):
        make_env(EnvConfig(name="chess"))
