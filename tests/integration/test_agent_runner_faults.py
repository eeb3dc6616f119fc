"""`agentjet agent` against a real rollout node, as a user runs them, with faults.

Every process is real: the rollout node (`agentjet node --role rollout`, the tiny model, no
trainer or coordinator: it draws tasks locally and holds its groups), `agentjet local` where
training matters, and `agentjet agent` started with the installed console script from the
folder that holds the user's agent module, written by the test. The agent reads control
files in its folder (`raise`, `nan`: fail the next episode; `hold`: after one model call,
write `held-N` and wait for `release`), so the test can put an episode mid-play before it
kills, stops or restarts the node. Checks read what a user sees: exit codes, log lines,
metrics rows, the spool. Each process is reaped by PID, its descendants with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentjet.agent_runner import run_agents
from agentjet.config import load_config, to_toml
from agentjet.episode import Episode, SamplingParams
from agentjet.lifeline import descendants, running
from agentjet.metrics import read_metrics
from agentjet.ports import free_port
from agentjet.protocol import Task
from node.agents import AgentEnv
from node.openai_api import ApiError, EpisodeHub
from tests.factories import RuleGenerator
from tests.procs import popen, run

pytestmark = pytest.mark.integration

AGENTJET = Path(sys.executable).with_name("agentjet")  # the console script a user runs
TOKEN = "sesame"
# Bound on any wait for a process to get somewhere (2 busy cores; a node loads torch).
WAIT_S = 180.0
POLL_S = 0.2
# A rollout node with an episode out to an agent stops within this (the launcher waits 60 s
# before it kills a role; a node with nothing out stops in a few seconds).
NODE_STOP_S = 20.0
# `agentjet local` stops every role (a trainer's checkpoint, hivemind) within this.
LOCAL_STOP_S = 120.0
# The runner exits within this of Ctrl-C: its held episodes are aborted in at most 5 s.
RUNNER_STOP_S = 15.0
RUN_TIMEOUT_S = 600.0
# An in-process endpoint answers, and closes, within this.
CLOSE_TIMEOUT_S = 10.0
PARAMS = SamplingParams(max_new_tokens=8)

AGENT = '''\
"""A user's agent: one model call, reward 1 for an even-length reply; control files in
this folder make the next episode fail or hold it mid-play."""
import asyncio
from pathlib import Path

HERE = Path(__file__).parent
played = 0


async def run_episode(task, client):
    global played
    played += 1
    number = played
    messages = [{"role": "user", "content": "Say something."}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    if (HERE / "raise").exists():
        (HERE / "raise").unlink()
        raise RuntimeError("a bug in the agent")
    if (HERE / "nan").exists():
        (HERE / "nan").unlink()
        return "not a number"
    if (HERE / "hold").exists():
        (HERE / f"held-{number}").write_text(task.id)
        while not (HERE / "release").exists():
            await asyncio.sleep(0.05)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Go on."}]
        await client.chat.completions.create(model="policy", messages=messages)
    return float(len(reply.choices[0].message.content or "") % 2 == 0)
'''


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s")
        time.sleep(POLL_S)  # polling what a user would see, with a deadline


class Processes:
    """Starts processes in their own sessions; reaps each, and its descendants, by PID."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.seen: set[int] = set()

    def start(self, name: str, argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
        with (
            open(self.dir / f"{name}.out", "wb") as out,
            open(self.dir / f"{name}.err", "wb") as err,
        ):
            proc = popen(argv, stdout=out, stderr=err, cwd=cwd, start_new_session=True)
        self.procs[name] = proc
        return proc

    def err(self, name: str) -> str:
        return (self.dir / f"{name}.err").read_text(errors="replace")

    def out(self, name: str) -> str:
        return (self.dir / f"{name}.out").read_text(errors="replace")

    def watch(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                self.seen |= descendants(proc.pid)

    def stop(self, name: str, sig: signal.Signals, timeout_s: float) -> tuple[int, float]:
        """Send `sig`; (exit code, seconds it took). SIGKILLs and fails past `timeout_s`."""
        proc = self.procs[name]
        self.seen |= descendants(proc.pid)
        start = time.monotonic()
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"{name} did not exit within {timeout_s:g} s of {sig.name}"
            ) from None
        return code, time.monotonic() - start

    def close(self) -> None:
        self.watch()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in self.seen) and time.monotonic() < deadline:
            time.sleep(0.1)  # SIGKILLed processes take a moment to leave the process table
        assert not [pid for pid in self.seen if running(pid)]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.close()


@pytest.fixture
def agent_dir(tmp_path: Path) -> Path:
    """The user's folder: my_agent.py, nothing installed."""
    folder = tmp_path / "my_project"
    folder.mkdir()
    (folder / "my_agent.py").write_text(AGENT)
    return folder


class Node:
    """A lone rollout node with an external agent environment, on a fixed agent port."""

    def __init__(
        self, procs: Processes, tmp_path: Path, tiny_model_dir: Path, keys_file: Path
    ) -> None:
        self.procs = procs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = tmp_path / "rollout"
        self.lives = 0
        config = load_config(
            None,
            [
                f"model.name={json.dumps(str(tiny_model_dir))}",
                "rollout.group_size=2",
                "rollout.groups_per_batch=1",
                "rollout.sampling.max_new_tokens=4",
                "rollout.max_unacked_groups=64",  # no trainer takes them: no backpressure
                f'rollout.agent_listen="127.0.0.1:{self.port}"',
                f'rollout.agent_token="{TOKEN}"',
                'envs.0.name="agent"',
                "envs.0.external=true",
                "envs.0.difficulties=[1]",
                # No coordinator or trainer listens: tasks are drawn locally after 2 s.
                f'coordinator.endpoint="tcp://127.0.0.1:{free_port()}"',
                f'net.trainer_endpoint="tcp://127.0.0.1:{free_port()}"',
                "net.request_timeout_s=2",
                f"net.keys={json.dumps(str(keys_file))}",
                f"run.dir={json.dumps(str(self.run_dir))}",
            ],
        )
        self.config_path = tmp_path / "rollout.toml"
        self.config_path.write_text(to_toml(config))

    @property
    def name(self) -> str:
        return f"rollout-{self.lives}"

    def start(self) -> None:
        self.lives += 1
        argv = [str(AGENTJET), "node", "--role", "rollout", "--config", str(self.config_path)]
        self.procs.start(self.name, argv, cwd=self.run_dir.parent)

    def wait_serving(self) -> None:
        """Until the node serves its agent endpoint (at its first grant)."""
        proc = self.procs.procs[self.name]

        def serving() -> bool:
            assert proc.poll() is None, self.log()
            return f"OpenAI endpoint at {self.url}/v1" in self.log()

        wait_until(serving, "agent endpoint")

    def groups(self) -> list[str]:
        """Every group the node has recorded, in any life."""
        path = self.run_dir / "metrics" / "rollout.jsonl"
        rows = read_metrics(path) if path.exists() else []
        return [g for r in rows if r.get("event") == "batch" for g in r["group_ids"]]

    def log(self) -> str:
        return self.procs.err(self.name)


@pytest.fixture
def node(procs: Processes, tmp_path: Path, tiny_model_dir: Path, keys_file: Path) -> Node:
    return Node(procs, tmp_path, tiny_model_dir, keys_file)


def agent_argv(url: str, *args: str) -> list[str]:
    argv = [str(AGENTJET), "agent", "--rollout", url, "--agent", "my_agent:run_episode"]
    return argv + ["--token", TOKEN, "--concurrency", "1", *args]


def run_agent(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return run(argv, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def test_the_agent_module_is_imported_from_the_current_folder_or_app_dir(
    node: Node, agent_dir: Path, tmp_path: Path
) -> None:
    node.start()
    node.wait_serving()
    here = run_agent(agent_argv(node.url, "--episodes", "2"), cwd=agent_dir)
    assert here.returncode == 0, here.stderr
    assert here.stdout == "2 episodes finished\n"
    assert here.stderr.count(f"connected to the rollout node at {node.url}") == 1
    assert "stopped: 2 episodes finished, 0 failed in the agent" in here.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    app_dir = run_agent(agent_argv(node.url, "--episodes", "2", "--app-dir", str(agent_dir)),
                        cwd=elsewhere)  # fmt: skip
    assert app_dir.returncode == 0, app_dir.stderr
    assert app_dir.stdout == "2 episodes finished\n"
    wait_until(lambda: len(node.groups()) >= 2, "two groups recorded by the node")

    # Errors a user can fix are one line, naming what to do.
    missing = run_agent(agent_argv(node.url), cwd=elsewhere)
    assert missing.returncode == 2
    assert "No module named 'my_agent'" in missing.stderr
    assert f"looked in {elsewhere}" in missing.stderr
    assert missing.stderr.count("\n") == 1, missing.stderr
    wrong_token = agent_argv(node.url)
    wrong_token[wrong_token.index(TOKEN)] = "guess"
    refused = run_agent(wrong_token, cwd=agent_dir)
    assert refused.returncode == 2
    assert "refused the agent token (401): pass its rollout.agent_token with --token" in (
        refused.stderr
    )
    assert refused.stderr.count("\n") == 1, refused.stderr


def test_the_runner_outlives_its_agents_failures_and_a_node_killed_mid_episode(
    procs: Processes, node: Node, agent_dir: Path
) -> None:
    node.start()
    node.wait_serving()
    for control in ("raise", "nan", "hold"):  # episodes 1 and 2 fail, 3 is held mid-play
        (agent_dir / control).touch()
    runner = procs.start("runner", agent_argv(node.url), cwd=agent_dir)
    wait_until(lambda: (agent_dir / "held-3").exists() or runner.poll() is not None,
               "episode held by the agent")  # fmt: skip
    assert runner.poll() is None, procs.err("runner")
    assert "the agent raised RuntimeError: a bug in the agent (my_agent.py:" in procs.err("runner")
    assert "the agent's reward 'not a number' is not a number" in procs.err("runner")

    # The node dies mid-episode; the agent's next call fails, and so does its abort.
    code, _ = procs.stop(node.name, signal.SIGKILL, NODE_STOP_S)
    assert code == -signal.SIGKILL
    (agent_dir / "hold").unlink()
    (agent_dir / "release").touch()
    wait_until(lambda: "waiting for the rollout node" in procs.err("runner"), "waiting line")
    recorded_before = node.groups()

    node.start()  # a new life on the same port: the runner finds it and plays on
    wait_until(lambda: len(node.groups()) > len(recorded_before) or runner.poll() is not None,
               "a group recorded by the restarted node")  # fmt: skip
    assert runner.poll() is None, procs.err("runner")
    log = procs.err("runner")
    assert "Traceback" not in log, log
    assert log.count(f"waiting for the rollout node at {node.url} (") == 1, log
    assert log.count(f"connected to the rollout node at {node.url}") == 2, log

    # Ctrl-C mid-episode: the held episode is aborted, the runner exits 0.
    (agent_dir / "release").unlink()
    (agent_dir / "hold").touch()
    wait_until(lambda: len(list(agent_dir.glob("held-*"))) == 2, "a second held episode")
    code, took_s = procs.stop("runner", signal.SIGINT, RUNNER_STOP_S)
    log = procs.err("runner")
    assert code == 0, log
    assert "failed in the agent, 1 lost by the node, 1 aborted at stop" in log
    assert " 2 failed in the agent" in log
    wait_until(lambda: "the agent runner stopped" in node.log(), "the node's abort line")


def test_a_node_stopped_mid_episode_stops_promptly_and_records_nothing_of_it(
    procs: Processes, node: Node, agent_dir: Path
) -> None:
    node.start()
    node.wait_serving()
    (agent_dir / "hold").touch()
    # Both episodes of the group held mid-play, a third worker long-polling for a claim.
    argv = agent_argv(node.url)
    argv[argv.index("--concurrency") + 1] = "3"
    runner = procs.start("runner", argv, cwd=agent_dir)
    wait_until(lambda: len(list(agent_dir.glob("held-*"))) == 2 or runner.poll() is not None,
               "two episodes held by the agent")  # fmt: skip
    assert runner.poll() is None, procs.err("runner")

    code, took_s = procs.stop(node.name, signal.SIGTERM, NODE_STOP_S)
    assert code == 0, node.log()
    assert "stopping has taken over" not in node.log()
    print(f"the node stopped {took_s:.1f} s after SIGTERM, an episode out to an agent")
    # The held episode's group never finished: nothing recorded, spooled or held.
    assert node.groups() == []
    rows = read_metrics(node.run_dir / "metrics" / "rollout.jsonl")
    [stopped] = [r for r in rows if r.get("event") == "stopped"]
    assert stopped["unacked_group_ids"] == []
    assert list((node.run_dir / "spool").glob("*.group")) == []

    # The runner waits for the node, saying so once, and exits 0 on Ctrl-C.
    wait_until(lambda: "waiting for the rollout node" in procs.err("runner"), "waiting line")
    assert runner.poll() is None, procs.err("runner")
    code, _ = procs.stop("runner", signal.SIGINT, RUNNER_STOP_S)
    log = procs.err("runner")
    assert code == 0, log
    assert log.count("waiting for the rollout node") == 1, log
    assert "0 episodes finished, 0 failed in the agent, 0 lost by the node, 2 aborted at stop" in (
        log
    )
    assert "Traceback" not in log


def test_local_episodes_wait_unclaimed_past_their_timeout_then_train_and_ctrl_c_is_prompt(
    procs: Processes, agent_dir: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`agentjet local` with only external episodes and no agent yet: they wait (said once),
    longer than episode_timeout_s, and train once a runner appears. Ctrl-C with an episode
    out to the runner stops every role in time; the held episode's group is never made."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    argv = [
        str(AGENTJET), "local", "--run-dir", str(run_dir), "--max-steps", "50",
        "--set", f"model.name={json.dumps(str(tiny_model_dir))}",
        "--set", "rollout.group_size=2",
        "--set", "rollout.groups_per_batch=1",
        "--set", "rollout.sampling.max_new_tokens=4",
        "--set", "trainer.groups_per_step=1",
        "--set", f'rollout.agent_listen="127.0.0.1:{port}"',
        "--set", f'rollout.agent_token="{TOKEN}"',
        "--set", 'envs.0.name="agent"',
        "--set", "envs.0.external=true",
        "--set", "envs.0.difficulties=[1]",
        "--set", "envs.0.episode_timeout_s=3",
    ]  # fmt: skip
    local = procs.start("local", argv, cwd=agent_dir)
    rollout_log = run_dir / "logs" / "rollout.log"

    def said(text: str) -> Callable[[], bool]:
        def check() -> bool:
            procs.watch()
            assert local.poll() is None, procs.out("local") + procs.err("local")
            return rollout_log.exists() and text in rollout_log.read_text(errors="replace")

        return check

    # Unclaimed for AGENTS_AWAY_S (10 s), more than episode_timeout_s: said once, not failed.
    wait_until(said("wait for an external agent to claim them"), "waiting-for-agents line")
    procs.start("runner", agent_argv(url), cwd=agent_dir)

    def steps() -> list[dict[str, Any]]:
        path = run_dir / "metrics" / "trainer.jsonl"
        return [r for r in read_metrics(path) if r.get("event") == "step"] if path.exists() else []

    wait_until(lambda: said("an external agent is claiming episodes")() and bool(steps()),
               "a trained step")  # fmt: skip
    log = rollout_log.read_text(errors="replace")
    assert "not finished within" not in log, log
    assert log.count("wait for an external agent to claim them") == 1, log

    (agent_dir / "hold").touch()
    wait_until(lambda: bool(list(agent_dir.glob("held-*"))), "an episode held by the agent")
    made = set(created(run_dir))
    code, took_s = procs.stop("local", signal.SIGINT, LOCAL_STOP_S)
    output = procs.out("local") + procs.err("local")
    assert code == 0, output
    assert "did not stop" not in output, output
    print(f"agentjet local stopped {took_s:.1f} s after Ctrl-C, an episode out to an agent")
    assert set(created(run_dir)) == made  # the held episode's group was discarded
    trained = [g for r in steps() for g in r["trained_group_ids"]]
    assert trained and set(trained) <= made
    code, _ = procs.stop("runner", signal.SIGINT, RUNNER_STOP_S)
    assert code == 0, procs.err("runner")


def created(run_dir: Path) -> list[str]:
    rows = read_metrics(run_dir / "metrics" / "rollout.jsonl")
    return [g for r in rows if r.get("event") == "batch" for g in r["group_ids"]]


# ── the same rules in process: the hub's decisions, the episode clock ─────────────────

TASK = Task(id="t1", env="agent", prompt="What is 2 + 3?", answer=5)


def test_claims_take_the_oldest_episode_and_a_closing_hub_answers_them_at_once() -> None:
    async def main() -> None:
        hub = EpisodeHub(idle_timeout_s=60)
        first = hub.open(TASK, training=True, external=True)
        second = hub.open(TASK, training=True, external=True)
        assert not first.started.is_set()  # its clock has not started
        assert await hub.claim(0) is first and first.started.is_set()
        hub.forget(second)  # discarded unclaimed: never handed out
        assert await hub.claim(0) is None
        waiting = asyncio.ensure_future(hub.claim(60))
        while not hub.claims_waiting:  # the long poll is in
            await asyncio.sleep(0)
        hub.close()
        with pytest.raises(ApiError) as refused:
            await asyncio.wait_for(waiting, CLOSE_TIMEOUT_S)
        assert refused.value.status == 503
        with pytest.raises(ApiError):
            await hub.claim(60)  # later claims too, without waiting

    asyncio.run(main())


def test_the_node_says_it_waits_for_agents_only_when_none_is_connected() -> None:
    hub = EpisodeHub(idle_timeout_s=60)
    assert hub.waiting_for_agents(now=1e9, after_s=10) is None  # nothing to claim
    episode = hub.open(TASK, training=True, external=True)
    episode.opened_at, hub.asked_at = 100.0, 100.0
    assert hub.waiting_for_agents(now=105.0, after_s=10) is None  # not waiting long yet
    assert hub.waiting_for_agents(now=111.0, after_s=10) == (1, 11.0)
    hub.asked_at = 105.0  # an agent asked 6 s ago: connected
    assert hub.waiting_for_agents(now=111.0, after_s=10) is None
    hub.asked_at = 100.0
    hub.claims_waiting = 1  # an agent's claim is waiting: connected
    assert hub.waiting_for_agents(now=111.0, after_s=10) is None
    hub.claims_waiting = 0
    hub.open(TASK, training=True).claim()  # an episode being played: connected
    assert hub.waiting_for_agents(now=111.0, after_s=10) is None


def test_an_episode_unclaimed_past_its_timeout_is_played_when_an_agent_comes(
    tiny_model_dir: Path,
) -> None:
    """episode_timeout_s counts from the claim: episodes that waited three times as long
    for an agent still finish, and each is timed from its own claim."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generator = RuleGenerator(tokenizer, lambda context: "Answer: 5")
    timeout_s = 0.5

    async def agent(task: Task, client: Any) -> float:
        messages = [{"role": "user", "content": task.prompt}]
        await client.chat.completions.create(model="m", messages=messages)
        return 1.0

    async def main() -> tuple[list[list[Episode]], int]:
        env = AgentEnv("agent", None, external=True, episode_timeout_s=timeout_s)
        try:
            url = await env.start(generator, PARAMS)
            playing = asyncio.ensure_future(env.run_group(generator, [TASK], 2, PARAMS))
            await asyncio.sleep(3 * timeout_s)  # the time under test: no agent yet
            assert not playing.done()
            assert env.metrics()["agents/unclaimed"] == 2
            finished = await run_agents(url, agent, episodes=2)
            return await asyncio.wait_for(playing, CLOSE_TIMEOUT_S), finished
        finally:
            await env.close()

    [group], finished = asyncio.run(main())
    assert finished == 2
    assert [e.reward for e in group] == [1.0, 1.0]
