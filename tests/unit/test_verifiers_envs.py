"""verifiers environments' pure parts with the real verifiers package (0.4.x) and the
small packages in tests/vf_envs: config checks, rows as tasks, tools, scoring."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentjet.config import EnvConfig, load_config
from agentjet.errors import ConfigError
from agentjet.tasks import TaskSource, held_out_tasks
from agentjet.verifiers_envs import Tools, VerifiersError, VerifiersTaskset, opening, score

pytestmark = pytest.mark.unit

PACKAGES = Path(__file__).parents[1] / "vf_envs"


@pytest.fixture(autouse=True)
def packages_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test packages on the import path, as a user's installed package would be."""
    monkeypatch.syspath_prepend(str(PACKAGES))


def env(package: str, **args: object) -> EnvConfig:
    return EnvConfig(name="verifiers", verifiers_env=package, verifiers_args=dict(args))


def load(package: str, *extra: str) -> object:
    return load_config(None, ['envs=[{name="verifiers"}]', f'envs.0.verifiers_env="{package}"',
                              *extra])  # fmt: skip


def test_a_taskset_package_loads_with_its_args() -> None:
    config = load("vf_words", "envs.0.verifiers_args={count=3}")
    source = TaskSource.from_config(config.envs[0])  # type: ignore[attr-defined]
    assert source.rows is not None and [t.id for t in source.rows] == [
        "train-0",
        "train-1",
        "train-2",
    ]


@pytest.mark.parametrize(
    ("package", "extra", "message"),
    [
        ("vf_legacy", (), "has load_environment(), the verifiers v0 API"),
        ("vf_nothing", (), "exports no vf.Taskset subclass"),
        ("vf_missing_pkg", (), "'vf_missing_pkg' cannot be imported"),
        (
            "vf_words",
            ("envs.0.verifiers_args={count='many'}",),
            "config error at envs.0.verifiers_args: count:",
        ),
        (
            "vf_words",
            ("envs.0.verifiers_eval_args={colour=1}",),
            "config error at envs.0.verifiers_eval_args: colour:",
        ),
    ],
)
def test_what_is_no_runnable_taskset_is_one_config_error(
    package: str, extra: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load(package, *extra)
    assert message in str(e.value)
    assert str(e.value).startswith("config error at envs.0.verifiers")
    assert "\n" not in str(e.value)


def test_verifiers_env_belongs_to_verifiers_environments() -> None:
    with pytest.raises(ConfigError, match='only "verifiers" environments take one'):
        load_config(None, ['envs.0.verifiers_env="vf_words"'])


def test_rows_become_tasks_with_their_prompt_answer_and_fields() -> None:
    taskset = VerifiersTaskset(env("vf_words", count=2))
    first = taskset.tasks()[0]
    assert first.id == "train-0" and first.env == "verifiers" and first.answer == "apple"
    assert [(m.role, m.content) for m in first.prompt] == [  # type: ignore[union-attr]
        ("system", "Answer with one word."),
        ("user", "Repeat the word apple."),
    ]
    # the verifiers task is rebuilt from the row alone (any process can)
    vf_task = taskset.vf_task(first)
    assert vf_task.data.answer == "apple" and type(vf_task).__name__ == "WordsTask"
    assert opening(vf_task) == [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Repeat the word apple."},
    ]


def test_the_eval_set_is_the_taskset_with_the_eval_args() -> None:
    config = env("vf_words", count=4)
    config.verifiers_eval_args = {"split": "test", "count": 2}
    assert [t.id for t in held_out_tasks(config)] == ["test-0", "test-1"]
    assert held_out_tasks(env("vf_words")) == []


def reply(text: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": "Repeat the word apple."},
            {"role": "assistant", "content": text}]  # fmt: skip


def test_the_reward_is_the_weighted_sum_of_the_tasks_rewards() -> None:
    taskset = VerifiersTaskset(env("vf_words"))
    vf_task = taskset.vf_task(taskset.tasks()[0])
    # even length (weight 1) and says the word (weight 0.5); the metric is not summed
    assert asyncio.run(score(vf_task, reply("apple!"), 1, "no_tool_calls")) == 1.5
    assert asyncio.run(score(vf_task, reply("apple"), 1, "no_tool_calls")) == 0.5
    assert asyncio.run(score(vf_task, reply("pear"), 1, "no_tool_calls")) == 1.0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("raise", "a reward raised RuntimeError: the reward broke"),
        ("nan", "reward 'flaky' gave nan (weight 1.0), not a finite number"),
        ("junk", "a reward raised ValueError"),
    ],
)
def test_a_reward_that_raises_or_gives_junk_fails_the_episode(bad: str, message: str) -> None:
    taskset = VerifiersTaskset(env("vf_faulty", bad=[bad], count=2))
    good, broken = (taskset.vf_task(t) for t in taskset.tasks())
    assert asyncio.run(score(good, reply("ab"), 1, "no_tool_calls")) == 1.0
    with pytest.raises(VerifiersError) as e:
        asyncio.run(score(broken, reply("ab"), 1, "no_tool_calls"))
    assert message in str(e.value)


def test_a_toolsets_python_function_is_a_tool() -> None:
    taskset = VerifiersTaskset(env("vf_tools", count=1))
    vf_task = taskset.vf_task(taskset.tasks()[0])

    async def play() -> tuple[list[dict[str, object]], list[str]]:
        async with Tools.open(taskset, vf_task) as tools:
            results = [
                await tools.call("add", '{"a": 2, "b": 40}'),
                await tools.call("add", '{"a": "two"}'),
                await tools.call("add", "not json"),
                await tools.call("subtract", "{}"),
            ]
            return tools.schemas, results

    schemas, results = asyncio.run(play())
    [schema] = schemas
    assert schema["function"]["name"] == "add"  # type: ignore[index]
    assert schema["function"]["description"] == "Add two integers."  # type: ignore[index]
    assert schema["function"]["parameters"]["required"] == ["a", "b"]  # type: ignore[index]
    assert results[0] == "42"
    assert results[1].startswith("error: ")
    assert results[2].startswith("error: invalid JSON")
    assert results[3] == "error: unknown tool 'subtract'"

    # a conversation with a tool call is scored like any other: the sum is in the reply
    messages = [
        *opening(vf_task),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 3, "b": 40}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "43"},
        {"role": "assistant", "content": "It is 43"},
    ]  # fmt: skip
    assert asyncio.run(score(vf_task, messages, 1, "no_tool_calls")) == 2.0
