"""TRL-style environment classes (`name = "env_class"`) played on the rollout node's OpenAI
endpoint: scripted episodes show what the model sees and what it is scored (the class
here and in process and docker sandboxes), classes that fail cost their episode only, and
`agentjet local` trains on one, here and in the sandbox pool, with the tiny model."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentjet.config import RewardTerm
from agentjet.episode import Episode, SamplingParams
from agentjet.protocol import Task
from node.agents import AgentEnv
from sandboxes.base import Sandbox
from sandboxes.envs.env_class import EnvClassAgent, load_env_class
from sandboxes.envs.prompt import Rewards
from sandboxes.process import ProcessSandbox
from tests import env_classes
from tests.factories import RuleGenerator
from tests.integration.test_local import trained_locally

PARAMS = SamplingParams(max_new_tokens=40)
TASK = Task(id="g1", env="env_class", prompt="Guess my number.", answer="won",
            fields={"secret": 5})  # fmt: skip
# Bounds of the classes' calls in these tests: a hang is cut quickly.
TOOL_TIMEOUT_S = 1.0


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(params=["here", "process"])
def sandboxes(request: pytest.FixtureRequest) -> Callable[[], Sandbox] | None:
    """Where the instance lives: in the test's process, or in a process sandbox."""
    return None if request.param == "here" else ProcessSandbox


def play(
    tokenizer: Any,
    reply: Callable[[str], str],
    spec: str,
    sandboxes: Callable[[], Sandbox] | None,
    rewards: Rewards | None = None,
    n: int = 1,
) -> tuple[list[Episode], list[str]]:
    """One group of `n` episodes of TASK with the class `spec`, the model replying by
    `reply`; the episodes (none when they failed) and every context the model was shown."""
    contexts: list[str] = []

    def recorded(context: str) -> str:
        contexts.append(context)
        return reply(context)

    agent = EnvClassAgent(
        load_env_class(spec),
        rewards=rewards,
        max_turns=6,
        tool_timeout_s=TOOL_TIMEOUT_S,
        sandbox_factory=sandboxes,
    )

    async def main() -> list[list[Episode]]:
        env = AgentEnv("env_class", agent, episode_timeout_s=60)
        try:
            return await env.run_group(RuleGenerator(tokenizer, recorded), [TASK], n, PARAMS)
        finally:
            await env.close()

    [group] = asyncio.run(main())
    return group, contexts


@pytest.mark.integration
def test_a_game_is_played_through_its_tools_and_scored_by_get_reward_and_the_functions(
    tokenizer: Any, sandboxes: Callable[[], Sandbox] | None, caplog: pytest.LogCaptureFixture
) -> None:
    """The model calls the tool twice with bad arguments (each an error it is told, the
    episode goes on), guesses low, then right, then says so."""

    def reply(context: str) -> str:
        if "Tool result: right" in context:
            return "I won."
        if "Tool result: higher" in context:
            return call("guess", number=5)
        errors = context.count("Error: TypeError")
        return [call("guess", num=5), call("guess", value=5), call("guess", number=2)][errors]

    says = Rewards([RewardTerm(name="says", function="tests.rewards:says_answer", weight=0.5)])
    with caplog.at_level(logging.WARNING):
        [episode], contexts = play(
            tokenizer, reply, "tests.env_classes:GuessingGame", sandboxes, says
        )
    # reset's observation appended to the row's prompt; the tool offered by its schema
    assert "Guess my number. Call guess to guess it." in contexts[0]
    assert '"name": "guess", "description": "Guess the secret number."' in contexts[0]
    assert (
        "Error: TypeError: " in contexts[1] and "unexpected keyword argument 'num'" in contexts[1]
    )
    assert "Tool result: higher" in contexts[3]
    assert "Tool result: right" in contexts[4]  # the instance kept its state between calls
    # get_reward (1, the last guess was right) + 0.5 x says_answer ("won" in the reply)
    assert episode.reward == 1.5
    assert episode.turns == 5
    # five calls extending one conversation: one training sequence
    assert [s.calls for s in episode.sequences] == [5]
    logged = [r.getMessage() for r in caplog.records if "logged once per kind" in r.getMessage()]
    assert len(logged) == 1 and "tool guess: TypeError" in logged[0]


@pytest.mark.integration
def test_a_tool_that_raises_is_told_to_the_model_and_its_state_kept(
    tokenizer: Any, sandboxes: Callable[[], Sandbox] | None
) -> None:
    """Calculator: a division by zero is an error message; the instance goes on, with
    what it remembered; an async tool and optional arguments work the same here and there."""

    def reply(context: str) -> str:
        if "Tool result: 7" in context:
            return call("recall", label="memory", rounded=True)
        if "Error: ZeroDivisionError" in context:
            return call("add", a=3, b=4)
        if "Tool result: 2.5" in context:
            return call("divide", a=1, b=0)
        if "Tool result: memory: 2" in context:
            return "done"
        return call("divide", a=5, b=2)

    score = Rewards([RewardTerm(name="even", function="tests.rewards:even_length")])
    [episode], contexts = play(tokenizer, reply, "tests.env_classes:Calculator", sandboxes, score)
    assert "Error: ZeroDivisionError: division by zero" in contexts[2]
    assert "Tool result: memory: 2" in contexts[4]  # 5 / 2 kept across the failed call
    assert episode.reward == 1.0  # no get_reward: the function alone ("done" is even)


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("tests.env_classes:RaisesInReset", "reset raised KeyError: 'no secret in this row'"),
        ("tests.env_classes:JunkReward", "get_reward returned a str"),
    ],
)
@pytest.mark.integration
def test_a_class_that_fails_fails_its_episode_and_says_why(
    tokenizer: Any,
    sandboxes: Callable[[], Sandbox] | None,
    caplog: pytest.LogCaptureFixture,
    spec: str,
    why: str,
) -> None:
    with caplog.at_level(logging.WARNING):
        group, _ = play(tokenizer, lambda c: call("guess", number=5), spec, sandboxes)
    assert group == []  # the task yields no group: nothing of it is trained
    failures = [r.getMessage() for r in caplog.records if "failed (attempt" in r.getMessage()]
    assert len(failures) == 1  # played again once, then given up: one line per kind
    assert why in failures[0]


@pytest.mark.integration
def test_a_hanging_tool_is_bounded(
    tokenizer: Any, sandboxes: Callable[[], Sandbox] | None, caplog: pytest.LogCaptureFixture
) -> None:
    """In a sandbox the call is killed at tool_timeout_s and the model told; here its thread
    cannot be stopped, so the episode ends at tool_timeout_s, failed."""

    def reply(context: str) -> str:
        return "giving up" if "Error: the tool ran past" in context else call("guess", number=5)

    started = time.monotonic()
    env_classes.RELEASE.clear()
    env_classes.HUNG.clear()
    try:
        with caplog.at_level(logging.WARNING):
            group, contexts = play(tokenizer, reply, "tests.env_classes:HangsInGuess", sandboxes)
    finally:
        env_classes.RELEASE.set()  # the node's abandoned threads end before the next test
        for thread in env_classes.HUNG:
            thread.join(10)
    assert time.monotonic() - started < 20 * TOOL_TIMEOUT_S
    assert not any(thread.is_alive() for thread in env_classes.HUNG)
    if sandboxes is None:
        assert group == []
        assert "guess ran past tool_timeout_s (1 s)" in caplog.text
    else:
        [episode] = group
        assert (
            "Error: the tool ran past tool_timeout_s (1 s); nothing it did is kept"
            in (contexts[-1])
        )
        assert episode.reward == 0.0  # no guess was kept


@pytest.mark.integration
def test_state_that_cannot_be_pickled_is_refused_in_a_sandbox_only(
    tokenizer: Any, sandboxes: Callable[[], Sandbox] | None, caplog: pytest.LogCaptureFixture
) -> None:
    def reply(context: str) -> str:
        return "done" if "Tool result: right" in context else call("guess", number=5)

    with caplog.at_level(logging.WARNING):
        group, _ = play(tokenizer, reply, "tests.env_classes:Unpicklable", sandboxes)
    if sandboxes is None:
        assert [e.reward for e in group] == [1.0]
    else:
        assert group == []
        assert "the instance cannot be kept between sandboxed calls" in caplog.text


@pytest.mark.docker
def test_the_game_in_docker_sandboxes(tokenizer: Any, docker_client: Any) -> None:
    """The docker backend: the instance lives in a container for the episode, the same
    game as here and in process sandboxes."""
    import docker

    from sandboxes.docker_sandbox import DockerEngine, DockerSandbox
    from sandboxes.image import DEFAULT_IMAGE

    try:
        docker_client.images.get(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.skip(f"image {DEFAULT_IMAGE} missing: run `agentjet sandbox build-image`")
    engine = DockerEngine("test-env-class", client=docker_client)

    def reply(context: str) -> str:
        if "Tool result: right" in context:
            return "I won."
        return call("guess", number=5 if "Tool result: higher" in context else 2)

    try:
        group, contexts = play(
            tokenizer, reply, "tests.env_classes:GuessingGame", lambda: DockerSandbox(engine), n=2
        )
    finally:
        engine.remove_ours()
    assert [(e.reward, e.turns) for e in group] == [(1.0, 3)] * 2
    assert "Tool result: higher" in contexts[-1] and "Tool result: right" in contexts[-1]
    assert engine.ours() == []


# ── trained with the tiny model ───────────────────────────────────────────────────────


def write_rows(tmp_path: Path) -> Path:
    rows = tmp_path / "rows.jsonl"
    with rows.open("w") as f:
        for i, secret in enumerate([3, 7, 1, 9]):
            f.write(json.dumps({"id": f"g{i}", "prompt": "Guess my number.", "secret": secret}))
            f.write("\n")
    return rows


@pytest.mark.integration
@pytest.mark.parametrize("sandboxed", [False, True], ids=["here", "in-sandboxes"])
def test_agentjet_local_trains_on_a_class(
    tiny_model_dir: Path, tmp_path: Path, sandboxed: bool
) -> None:
    """The guessing game with get_reward and even_length (which the random tiny model earns
    half the time, so groups carry a gradient): versions are trained, nothing is lost."""
    run_dir = tmp_path / "run"
    settings = (
        'envs.0.name="env_class"',
        'envs.0.environment="tests.env_classes:GuessingGame"',
        f"envs.0.task_file={json.dumps(str(write_rows(tmp_path)))}",
        'envs.0.reward="tests.rewards:even_length"',
        f"envs.0.sandbox={str(sandboxed).lower()}",
        "envs.0.max_turns=2",
        "rollout.group_size=2",
        "trainer.max_logprob_gap=0",  # lr 1e-3 moves the tiny model far per version
    )
    trainer, rollout, _ = trained_locally(tiny_model_dir, run_dir, 2, settings)
    steps = [r for r in trainer if r.get("event") == "step"]
    batches = [r for r in rollout if r.get("event") == "batch"]
    assert batches and {r["env"] for r in batches} == {"env_class"}
    if sandboxed:  # every episode's instance lived in a leased sandbox
        assert batches[-1]["sandbox/acquired"] >= 4 * len(batches)
    created = [g for r in batches for g in r["group_ids"]]
    trained = [g for r in steps for g in r["trained_group_ids"]]
    stale = [g for r in trainer for g in r.get("stale_group_ids", [])]
    [trainer_end] = [r for r in trainer if r.get("event") == "stopped"]
    [rollout_end] = [r for r in rollout if r.get("event") == "stopped"]
    pending = trainer_end["queued_group_ids"] + rollout_end["unacked_group_ids"]
    assert len(trained) == len(set(trained))
    assert set(created) == set(trained) | set(stale) | set(pending)
