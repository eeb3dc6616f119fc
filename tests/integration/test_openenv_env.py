"""OpenEnv environments against real openenv-core servers (tests/openenv_guess.py) that
agentjet starts under uvicorn, or that a test starts and names by URL.

The policy is a rule-following stand-in where a test needs a particular reply (a guess),
and the tiny model where an `agentjet local` run trains it. Every server process is
reaped by PID: agentjet's own at `close()`, the tests' in their fixtures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentjet.config import EnvConfig, RolloutConfig
from agentjet.episode import Completion, SamplingParams
from agentjet.errors import ConfigError
from agentjet.lifeline import running
from agentjet.metrics import read_metrics
from agentjet.protocol import Task
from agentjet.tasks import TaskSource
from node.agents import AgentEnv, make_agent_env
from node.openenv_env import OpenEnvAgent, free_port, get_json
from sandboxes.process import ProcessSandbox
from tests import procs
from tests.factories import RuleGenerator
from tests.integration.test_local import group_fates, run_local

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(max_new_tokens=8)
REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


def task(seed: int, **fields: Any) -> Task:
    return Task(id=f"seed:{seed}", env="openenv", prompt="", fields={"seed": seed, **fields})


def openenv(**keys: Any) -> EnvConfig:
    return EnvConfig(**({"name": "openenv", "openenv_app": "tests.openenv_guess:app"} | keys))


def agent_env(config: EnvConfig) -> AgentEnv:
    return make_agent_env(config, RolloutConfig(), ProcessSandbox)


def agent_of(env: AgentEnv) -> OpenEnvAgent:
    assert isinstance(env.agent, OpenEnvAgent)
    return env.agent


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
def from_the_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """agentjet starts openenv_app from the current directory, as a user's node would."""
    monkeypatch.chdir(REPO)


async def play(env: AgentEnv, generator: Any, tasks: list[Task], n: int) -> list[list[Any]]:
    try:
        return await env.run_group(generator, tasks, n, PARAMS)
    finally:
        await env.close()


def test_episodes_are_played_on_the_server_and_scored_by_its_rewards(tokenizer: Any) -> None:
    """reset with the task's seed, the observation as the user turn, the reply as the guess;
    a right guess scores 1 in one turn; wrong ones go on to the third guess; the server
    process is gone after close."""
    env = agent_env(openenv(max_turns=3, openenv_sessions=4))
    agent = agent_of(env)
    seen: list[str] = []

    def guess_five(context: str) -> str:
        seen.append(context)
        return "5"

    generator = RuleGenerator(tokenizer, guess_five)
    # target 5 (guessed right at once) and target 2 (three wrong guesses)
    groups = asyncio.run(play(env, generator, [task(0, target=5), task(1, target=2)], 2))
    assert [[e.reward for e in g] for g in groups] == [[1.0, 1.0], [0.0, 0.0]]
    assert [[e.turns for e in g] for g in groups] == [[1, 1], [3, 3]]
    assert any("Guess my number from 0 to 9" in c for c in seen)
    assert any("No, lower." in c for c in seen)  # the step's observation is the next turn
    assert agent.counts == {"episodes_failed": 0, "invalid_actions": 0, "server_restarts": 0}
    assert agent.server is not None and agent.server.process is None


def test_a_reply_that_is_no_action_ends_the_episode_with_its_rewards(tokenizer: Any) -> None:
    """The server refuses a guess that is no number (its Action's validator), and a custom
    to_action finds none: either way the episode ends, scored, counted, not failed."""
    generator = RuleGenerator(tokenizer, lambda context: "no idea")
    for keys in ({}, {"openenv_action": "tests.openenv_guess:to_action"}):
        env = agent_env(openenv(openenv_observation="tests.openenv_guess:show", **keys))
        groups = asyncio.run(play(env, generator, [task(3)], 2))
        assert [e.reward for e in groups[0]] == [0.0, 0.0]
        assert [e.turns for e in groups[0]] == [1, 1]
        assert agent_of(env).counts["invalid_actions"] == 2
        assert agent_of(env).counts["episodes_failed"] == 0


class KillsTheServer(RuleGenerator):
    """Guesses 5; during its first `kills` model calls it SIGKILLs the server's process
    (by PID): those episodes are mid-way, reset done, step not yet sent."""

    def __init__(self, tokenizer: Any, agent: OpenEnvAgent, kills: int) -> None:
        super().__init__(tokenizer, lambda context: "5")
        self.agent = agent
        self.kills = kills
        self.killed: list[int] = []

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        server = self.agent.server
        if len(self.killed) < self.kills and server is not None and server.pid is not None:
            self.killed.append(server.pid)
            os.kill(server.pid, signal.SIGKILL)
            assert server.process is not None
            await server.process.wait()
        return await super().generate(prompts, n, params)


def test_a_server_killed_mid_episode_fails_it_counted_and_is_started_again(
    tokenizer: Any,
) -> None:
    """Killed during an episode: that episode fails (discarded, never trained), the server
    is started again on a new process, the episode is played again and scores; killed in
    both attempts, the task yields no group; the env goes on serving the next group."""
    env = agent_env(openenv(openenv_sessions=1))
    agent = agent_of(env)
    generator = KillsTheServer(tokenizer, agent, kills=1)

    async def scenario() -> tuple[list[list[Any]], list[list[Any]], list[list[Any]]]:
        try:
            once = await env.run_group(generator, [task(0, target=5)], 1, PARAMS)
            generator.kills += 2  # both attempts of the next task
            twice = await env.run_group(generator, [task(1, target=5)], 1, PARAMS)
            after = await env.run_group(generator, [task(2, target=5)], 1, PARAMS)
            return once, twice, after
        finally:
            await env.close()

    once, twice, after = asyncio.run(scenario())
    assert [[e.reward for e in g] for g in once] == [[1.0]]  # its retry, on a new server
    assert twice == [[]]  # failed in both attempts: no group, nothing to train
    assert [[e.reward for e in g] for g in after] == [[1.0]]
    assert agent.counts["episodes_failed"] == 3
    assert agent.counts["server_restarts"] == 3
    assert env.metrics()["openenv/episodes_failed"] == 3
    assert len(set(generator.killed)) == 3 and not any(running(p) for p in generator.killed)


@pytest.fixture(scope="module")
def junk_server() -> Iterator[str]:
    """tests/openenv_guess.py's junk_app under uvicorn, started by the test, reaped by PID."""
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "tests.openenv_guess:junk_app",
            "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = procs.popen(argv, cwd=REPO, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_for_health(url))
        yield url
    finally:
        proc.kill()
        proc.wait()


async def wait_for_health(url: str) -> None:
    async with asyncio.timeout(START_TIMEOUT_S):
        while True:
            with contextlib.suppress(Exception):
                await get_json(f"{url}/health", 5.0)
                return
            await asyncio.sleep(0.2)  # polling a starting process


@pytest.mark.parametrize("junk", ["not_json", "no_done", "bad_reward", "silence"])
def test_a_server_answering_junk_fails_the_episode_counted(
    tokenizer: Any, junk_server: str, junk: str
) -> None:
    env = agent_env(EnvConfig(name="openenv", openenv_url=junk_server, openenv_timeout_s=1.0))
    generator = RuleGenerator(tokenizer, lambda context: "5")
    groups = asyncio.run(play(env, generator, [task(0, junk=junk)], 1))
    assert groups == [[]]
    assert agent_of(env).counts["episodes_failed"] == 2  # both attempts


def test_a_server_that_cannot_be_reached_at_start_is_one_clear_error(tokenizer: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = agent_env(EnvConfig(name="openenv", openenv_url=url, openenv_timeout_s=2.0))
    generator = RuleGenerator(tokenizer, lambda context: "5")
    with pytest.raises(ConfigError, match=f"openenv_url {url}: GET {url}/health"):
        asyncio.run(play(env, generator, [task(0)], 1))
    env = agent_env(openenv(openenv_app="tests.openenv_guess:no_such_app"))
    with pytest.raises(ConfigError, match="exited with code"):
        asyncio.run(play(env, generator, [task(0)], 1))


def test_generated_tasks_carry_their_reset_seed() -> None:
    source = TaskSource.from_config(openenv())
    import random

    drawn = [source.sample(random.Random(0)) for _ in range(3)]
    assert all(t.id == f"seed:{t.fields['seed']}" for t in drawn)
    assert all(source.covers(t) for t in drawn)


def test_agentjet_local_trains_the_tiny_model_on_an_openenv_server(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`agentjet local` with openenv_app: the rollout node starts the server, plays its
    episodes with the tiny model, versions are trained; the server killed by PID after the
    first batch is started again and the run goes on; no process is left at the end."""
    run_dir = tmp_path / "run"
    settings = (
        'envs.0.name="openenv"',
        'envs.0.openenv_app="tests.openenv_guess:app"',
        'envs.0.openenv_action="tests.openenv_guess:to_action"',
        "envs.0.openenv_sessions=8",
        "envs.0.max_turns=2",
        "trainer.max_logprob_gap=0",
    )
    killed: list[int] = []
    killed_at: list[float] = []

    def kill_the_server_after_a_batch() -> bool:
        """run_local's hook, polled: SIGKILL the server by the PID its start logged."""
        if killed or not any(r.get("event") == "batch" for r in metrics(run_dir, "rollout")):
            return False
        logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
        found = re.search(r"OpenEnv server \S+ serving at \S+ \(pid (\d+)\)", logs)
        if found:
            killed.append(int(found.group(1)))
            os.kill(killed[0], signal.SIGKILL)
            killed_at.append(time.time())
        return False  # never interrupt the run

    code, output, spawned = run_local(
        tiny_model_dir, run_dir, max_steps=6, settings=settings,
        interrupt_when=kill_the_server_after_a_batch,
    )  # fmt: skip
    logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert code == 0, output + logs
    assert killed and "exited (code -9); starting it again" in logs
    trainer, rollout = metrics(run_dir, "trainer"), metrics(run_dir, "rollout")
    steps = [r for r in trainer if r.get("event") == "step"]
    assert {r["policy_version"] for r in steps} >= {1, 2, 3, 4, 5, 6}
    batches = [r for r in rollout if r.get("event") == "batch"]
    assert any(r["time"] > killed_at[0] for r in batches)  # the run went on past the kill
    assert batches[-1]["openenv/server_restarts"] >= 1
    # every group made was trained, dropped as stale or is still pending: none lost
    fates = group_fates(trainer, rollout)
    assert set(fates["created"]) == set(fates["trained"]) | set(fates["stale"]) | set(
        fates["pending"]
    ) | set(fates["left_out"])
    assert [pid for pid in spawned if running(pid)] == []


def metrics(run_dir: Path, role: str) -> list[dict[str, Any]]:
    path = run_dir / "metrics" / f"{role}.jsonl"
    return read_metrics(path) if path.exists() else []
