"""A swarm on loopback: a coordinator, two trainers and a rollout node, each started the
way a user starts them on separate machines (`--listen`, `--join` the printed address).

Checks what a user could: at every version both trainers reached their weights agree (to
float rounding), a trainer that joins mid-run starts from the swarm's weights, a trainer
killed with SIGKILL does not stop training, and every group the rollout node made is
trained exactly once, dropped as stale, or still held at the end (also with a teacher node
killed and restarted mid-run). Processes are reaped by PID (each runs in its own process
group with its hivemind daemons).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentjet.config import load_config, to_toml
from agentjet.keys import DEFAULT_KEYS_FILE, write_keys
from agentjet.lifeline import descendants, process_table, running
from agentjet.metrics import read_metrics
from agentjet.ports import free_port
from tests import procs
from tests.netns import Node, Swarmnet, require_netns
from tests.procs import command_line

REPO_ROOT = Path(__file__).resolve().parents[2]

# Bound on any wait for the swarm to get somewhere (2 cores, several torch processes).
WAIT_S = 300.0
STOP_TIMEOUT_S = 60.0
STATUS_TIMEOUT_S = 120.0
POLL_S = 0.5
DAEMON_EXIT_S = 15.0
SAMPLES_PER_TRAINER_BATCH = 8


def free_listen() -> str:
    """127.0.0.1:P for --listen, with P (ZMQ) and P+1 (the hivemind peer) both free now."""
    return f"127.0.0.1:{free_port(span=2)}"


class Swarm:
    """Starts agentjet processes from one config and key file; stops and reaps them by PID."""

    def __init__(self, tmp_path: Path, tiny_model_dir: Path, settings: tuple[str, ...]) -> None:
        self.dir = tmp_path
        self.keys_file = tmp_path / DEFAULT_KEYS_FILE
        write_keys(self.keys_file)
        config = load_config(
            None,
            [
                f"model.name={json.dumps(str(tiny_model_dir))}",
                "rollout.group_size=4",
                "rollout.groups_per_batch=2",
                "rollout.sampling.max_new_tokens=6",
                "rollout.max_unacked_groups=4",
                "trainer.groups_per_step=2",
                "trainer.max_queued_groups=4",
                "trainer.max_policy_lag=3",
                "trainer.lr=1e-3",
                # At 100x the default lr the tiny model's honest samples are 0.1-0.6 nats
                # per token from the learner one or two versions on (measured); forged ones
                # are 3-10.
                "trainer.max_logprob_gap=2",
                # An agent whose reward the random tiny model earns half the time: real
                # gradients for the trainers to average (it never solves arithmetic).
                'envs.0.name="agent"',
                "trainer.checkpoint_every=1",
                "trainer.keep_checkpoints=0",  # every version is compared
                'envs.0.agent="tests.agents:even_length"',
                "envs.0.difficulties=[1]",
                "swarm.run_id=swarm-test",
                "swarm.heartbeat_s=0.5",
                "swarm.record_ttl_s=3",
                "swarm.averaging_timeout_s=10",
                "net.request_timeout_s=2",
                *settings,
            ],
        )
        self.config_path = tmp_path / "config.toml"
        self.config_path.write_text(to_toml(config))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned: set[int] = set()

    def start(
        self, name: str, *args: str, host: Node | None = None, module: str = "agentjet_app.cli"
    ) -> subprocess.Popen[bytes]:
        """Start `agentjet ARGS` on loopback, or inside `host`'s network namespace (`module`:
        another entry point that runs agentjet, with a fault)."""
        run_dir = self.dir / name
        argv = [sys.executable, "-m", module, *args]
        argv += ["--config", str(self.config_path), "--run-dir", str(run_dir)]
        argv += ["--keys", str(self.keys_file)]
        return self.popen(name, argv, host)

    def popen(
        self, name: str, argv: list[str], host: Node | None = None
    ) -> subprocess.Popen[bytes]:
        """Start `argv` as it is (its output in <name>.out, its log in <name>.log)."""
        with (
            open(self.dir / f"{name}.out", "wb") as out,
            open(self.dir / f"{name}.log", "wb") as log,
        ):
            if host is None:
                proc = procs.popen(
                    argv, stdout=out, stderr=log, start_new_session=True, cwd=REPO_ROOT
                )
            else:
                proc = host.popen(argv, stdout=out, stderr=log, cwd=REPO_ROOT)
        self.procs[name] = proc
        return proc

    def output(self, name: str) -> str:
        return (self.dir / f"{name}.out").read_text()

    def logs(self) -> str:
        return "\n".join(
            f"── {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.dir.glob("*.log"))
        )

    def metrics(self, name: str, role: str) -> list[dict[str, Any]]:
        path = self.dir / name / "metrics" / f"{role}.jsonl"
        return read_metrics(path) if path.exists() else []

    def steps(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.metrics(name, "trainer") if r.get("event") == "step"]

    def version(self, name: str) -> int:
        return max((r["policy_version"] for r in self.steps(name)), default=0)

    def wait_for(self, what: str, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            for name, proc in self.procs.items():
                self.spawned |= descendants(proc.pid)
                if proc.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(POLL_S)  # polling files a user would read, not standing in for sync

    def join_address(self) -> str:
        found: list[str] = []

        def printed() -> bool:
            found[:] = re.findall(r"--join (\S+)", self.output("coordinator"))
            return bool(found)

        self.wait_for("the coordinator's join command", printed)
        return found[0]

    def kill(self, name: str) -> None:
        """SIGKILL a node and its hivemind daemons (its process group), like a power cut."""
        proc = self.procs[name]
        self.spawned |= descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> dict[str, int]:
        """SIGTERM every live node (rollout first), wait; returns exit codes."""
        codes = {}
        order = sorted(self.procs, key=lambda n: (not n.startswith("rollout"), n))
        for name in order:
            proc = self.procs[name]
            self.spawned |= descendants(proc.pid)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    codes[name] = proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{name} did not stop\n{self.stuck(name)}") from None
        return codes

    def stuck(self, name: str) -> str:
        """The log of a node that does not stop, ending with every thread's stack (SIGUSR1
        makes it write them: agentjet/roles.py)."""
        log = self.dir / f"{name}.log"
        size = log.stat().st_size
        self.procs[name].send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline and "most recent call first" not in log.read_text()[size:]
        ):
            time.sleep(POLL_S)  # polling the file the dump is written to
        return log.read_text()[-30000:]

    def reap(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in self.spawned:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def swarm_factory(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Callable[..., Swarm]]:
    made: list[Swarm] = []

    def make(*settings: str) -> Swarm:
        made.append(Swarm(tmp_path, tiny_model_dir, settings))
        return made[-1]

    yield make
    for swarm in made:
        swarm.reap()


def forks(pid: int) -> set[int]:
    """The live children of `pid` forked from it (hivemind's DHT and averager processes:
    their command line is its own)."""
    table = process_table()
    return {
        child
        for child, info in table.items()
        if info.ppid == pid and running(child) and command_line(child) == command_line(pid)
    }


def start_trainer(swarm: Swarm, name: str, join: str, module: str = "agentjet_app.cli") -> None:
    listen = free_listen()
    args = ("node", "--role", "trainer", "--join", join, "--listen", listen)
    swarm.start(name, *args, module=module)


def start_swarm(swarm: Swarm, trainers: list[str], modules: dict[str, str] | None = None) -> str:
    swarm.start("coordinator", "coordinator", "--listen", free_listen())
    join = swarm.join_address()
    for name in trainers:
        start_trainer(swarm, name, join, (modules or {}).get(name, "agentjet_app.cli"))
    swarm.start("rollout", "node", "--role", "rollout", "--join", join)
    return join


def swarm_status(join: str, run_id: str, keys_file: Path) -> str:
    """What `agentjet status --join` prints for the swarm (it must exit 0)."""
    done = procs.run(
        [
            sys.executable,
            "-m",
            "agentjet_app.cli",
            "status",
            "--join",
            join,
            "--run-id",
            run_id,
            "--keys",
            str(keys_file),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=STATUS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def status_showing(swarm: Swarm, join: str, text: str) -> str:
    """What `agentjet status --join` prints once it shows `text`: it lists the swarm from
    the directory, and a read under load can miss a live node's record (as the rollout
    node's own reads can), so it is asked again until then."""
    shown = ""

    def showing() -> bool:
        nonlocal shown
        shown = swarm_status(join, "swarm-test", swarm.keys_file)
        return text in shown

    swarm.wait_for(f"agentjet status showing {text!r}", showing)
    return shown


def api(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=STATUS_TIMEOUT_S) as reply:
        return json.load(reply)


def check_the_live_dashboard(swarm: Swarm, join: str) -> None:
    """`agentjet dashboard --join` on the running swarm: every node from the directory, the
    trainers' and the coordinator's rows over their sockets as their files hold them, the
    coordinator's scheduler, and a rollout node as its directory record says."""
    argv = [sys.executable, "-m", "agentjet_app.cli", "dashboard", "--join", join]
    argv += ["--run-id", "swarm-test", "--keys", str(swarm.keys_file)]
    swarm.popen("dashboard", argv)
    found: list[str] = []

    def printed() -> bool:
        found[:] = re.findall(r"dashboard: (http://\S+)", swarm.output("dashboard"))
        return bool(found)

    swarm.wait_for("the live dashboard's URL", printed)
    url = found[0]

    def every_node_with_rows() -> bool:
        roles = api(url + "api/roles")["roles"]
        kinds = sorted(r["kind"] for r in roles)
        wanted = ["coordinator", "rollout", "trainer", "trainer"]
        return kinds == wanted and all(r["rows"] for r in roles if r["kind"] == "trainer")

    # a read under load can miss a live node's record, as `agentjet status` can: asked again
    swarm.wait_for("the dashboard to list every node, and the trainers' rows", every_node_with_rows)
    roles = {r["label"]: r for r in api(url + "api/roles")["roles"]}
    nodes = {n["label"]: n for n in api(url + "api/nodes")["nodes"]}
    for name in ("trainer-a", "trainer-b"):
        [started] = [r for r in swarm.metrics(name, "trainer") if r.get("event") == "started"]
        node_id = started["node_id"]
        rows = api(url + f"api/metrics?role={roles[node_id]['role']}")["rows"]
        written = {(r["time"], r.get("event")) for r in swarm.metrics(name, "trainer")}
        assert rows and all((r["time"], r.get("event")) in written for r in rows)
        assert any(r.get("event") == "step" for r in rows)
        node = nodes[node_id]
        assert node["kind"] == "trainer" and node["source"] == "metrics" and not node["error"]
        assert node["policy_version"] >= 3 and node["endpoint"].startswith("tcp://127.0.0.1:")
        assert isinstance(node["rounds_failed"], int) and node["quarantined"] == []
    [rollout] = [n for n in nodes.values() if n["kind"] == "rollout"]
    assert rollout["source"] == "directory" and rollout["capacity"] == 4  # max_unacked_groups
    heartbeats = api(url + f"api/metrics?role={rollout['role']}")["rows"]
    assert heartbeats and {r["event"] for r in heartbeats} == {"heartbeat"}
    scheduler = api(url + "api/scheduler")
    assert scheduler["running"], scheduler
    assert scheduler["status"]["grants_issued"] > 0
    assert [r["name"] for r in scheduler["status"]["table"] if r["level"] == "env"] == ["agent"]
    assert api(url + "api/trajectories")["note"]


def leftovers(swarm: Swarm) -> dict[int, str]:
    """Processes a stopped swarm left running, with their command lines. torch's
    shared-memory manager exits on its own once its last client is gone: allow it that."""
    deadline = time.monotonic() + DAEMON_EXIT_S
    while any(running(pid) for pid in swarm.spawned) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    out = {}
    for pid in swarm.spawned:
        if running(pid):
            with contextlib.suppress(OSError):
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return out


def settled_by_marks(swarm: Swarm, trainers: list[str], trained: set[str]) -> set[str]:
    """Groups trained without a step row that lists them, which the rollout node dropped on
    the DHT's marks (rows `trainer_gone`, `restored`): trained by a trainer SIGKILLed
    between its step and its step row (its trained_groups.log confirms them), or held by a
    trainer gone before it learned that a peer stepped with their batch (that peer's step
    row vouches for the batch)."""
    logged = {
        line.split("\t")[1]
        for t in trainers
        if (swarm.dir / t / "trained_groups.log").exists()
        for line in (swarm.dir / t / "trained_groups.log").read_text().splitlines()
    }
    rows = [
        r
        for r in swarm.metrics("rollout", "rollout")
        if r.get("event") in ("trainer_gone", "restored")
    ]
    marked = {g for r in rows for g in r.get("trained_group_ids", [])}
    vouched = {b for t in trainers for r in swarm.steps(t) for b in r.get("peer_batch_ids", [])}
    through_vouched = {
        g for r in rows for g, b in r.get("trained_through_batches", {}).items() if b in vouched
    }
    return ((marked & logged) | through_vouched) - trained


def trained_by_peers(swarm: Swarm, name: str) -> list[str]:
    """The groups of trainer `name`'s batches that a peer stepped with, though the round
    failed on `name`'s side (node/trainer_doubtful.py, `DoubtfulBatch`): no step row of theirs."""
    return [
        g
        for r in swarm.metrics(name, "trainer")
        if r.get("event") == "trained_by_peer"
        for g in r["trained_group_ids"]
    ]


def trained_groups(swarm: Swarm, trainers: list[str]) -> list[str]:
    """Every group the trainers trained, once per time: their step rows' and those their
    peers stepped with."""
    return [
        *(g for t in trainers for r in swarm.steps(t) for g in r["trained_group_ids"]),
        *(g for t in trainers for g in trained_by_peers(swarm, t)),
    ]


def check_every_group_accounted_for(
    swarm: Swarm,
    trainers: list[str],
    duplicates_allowed: bool = False,
    rollouts: tuple[str, ...] = ("rollout",),
) -> dict[str, int]:
    rows = {name: swarm.metrics(name, "rollout") for name in rollouts}
    created = [
        g
        for rollout in rows.values()
        for r in rollout
        if r.get("event") == "batch"
        for g in r["group_ids"]
    ]
    trained = trained_groups(swarm, trainers)
    stale = [
        g
        for t in trainers
        for r in swarm.metrics(t, "trainer")
        for g in r.get("stale_group_ids", [])
    ]
    held = []
    for rollout in rows.values():
        [end] = [r for r in rollout if r.get("event") == "stopped"]
        held += end["unacked_group_ids"]
    if not duplicates_allowed:
        assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(created) == len(set(created))
    settled = settled_by_marks(swarm, trainers, set(trained))
    assert set(created) == set(trained) | settled | set(stale) | set(held), "a group was lost"
    return {
        "created": len(created),
        "trained": len(trained),
        "stale": len(set(stale)),
        "held": len(held),
        "duplicated": len(trained) - len(set(trained)),
    }


def trained_in_the_weights_that_go_on(swarm: Swarm, going_on: str, cut: str) -> list[str]:
    """The groups of every step in the line of weights trainer `going_on` continued: all of
    its own steps, and those of trainer `cut` save any that made a version `going_on` made
    differently (a dead end: the cut trainer later took the swarm's state)."""
    made = {r["policy_version"]: r["policy_sha256"] for r in swarm.steps(going_on)}
    kept = [g for r in swarm.steps(going_on) for g in r["trained_group_ids"]]
    # a doubtful batch is settled trained only once its trainer holds the peer's step
    kept += trained_by_peers(swarm, going_on) + trained_by_peers(swarm, cut)
    for r in swarm.steps(cut):
        if made.get(r["policy_version"], r["policy_sha256"]) == r["policy_sha256"]:
            kept += r["trained_group_ids"]
    return kept


def checkpoints(swarm: Swarm, name: str) -> dict[int, Path]:
    """A trainer's saved policy versions (trainer.checkpoint_every=1 here)."""
    root = swarm.dir / name / "checkpoints"
    found = root.glob("v[0-9]*") if root.exists() else []
    return {int(p.name[1:]): p for p in found if p.name[1:].isdigit()}


def max_difference(a: Path, b: Path) -> float:
    """Largest absolute difference between two checkpoints' tensors."""
    from safetensors.torch import load_file

    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta)


@pytest.mark.integration
def test_two_trainers_hold_identical_weights_and_lose_nothing(swarm_factory: Callable[..., Swarm]):
    # The global batch needs both trainers' local batches: they step together.
    swarm = swarm_factory(f"swarm.target_batch_size={2 * SAMPLES_PER_TRAINER_BATCH}")
    join = start_swarm(swarm, ["trainer-a", "trainer-b"])

    def both_trained_three_common_versions() -> bool:
        common = set(checkpoints(swarm, "trainer-a")) & set(checkpoints(swarm, "trainer-b"))
        trained = [
            any(r["trained_group_ids"] for r in swarm.steps(t)) for t in ("trainer-a", "trainer-b")
        ]
        return len(common) >= 3 and all(trained)

    swarm.wait_for("three versions reached by both trainers", both_trained_three_common_versions)
    shown = status_showing(swarm, join, "swarm: 1 coordinator, 2 trainer, 1 rollout")
    for name in ("trainer-a", "trainer-b"):
        endpoint = re.search(r"tcp://127\.0\.0\.1:\d+", (swarm.dir / f"{name}.log").read_text())
        assert endpoint and endpoint.group(0) in shown
    check_the_live_dashboard(swarm, join)
    codes = swarm.stop()
    assert set(codes.values()) == {0}, swarm.logs()
    check_every_group_accounted_for(swarm, ["trainer-a", "trainer-b"])
    # same version, same weights, bit for bit (docs/swarm.md, "Swarm steps")
    a, b = checkpoints(swarm, "trainer-a"), checkpoints(swarm, "trainer-b")
    common = sorted(set(a) & set(b))
    assert len(common) >= 3
    for version in common:
        assert max_difference(a[version], b[version]) == 0.0, version
    # ... and the same checksum, as each trainer published it
    published = [
        {r["policy_version"]: r["policy_sha256"] for r in swarm.steps(t)}
        for t in ("trainer-a", "trainer-b")
    ]
    both = set(published[0]) & set(published[1])
    assert len(both) >= 3
    assert all(published[0][v] == published[1][v] for v in both), published
    # ... while training moved them: real gradients were averaged
    assert max_difference(a[common[0]], a[common[-1]]) > 1e-4
    # the rollout node found the coordinator in the swarm's directory
    assert "coordinator at tcp://127.0.0.1" in (swarm.dir / "rollout.log").read_text()
    # every process they started (hivemind DHTs, p2pd, the coordinator's beacon) is gone
    assert leftovers(swarm) == {}


@pytest.mark.integration
def test_local_steps_with_8bit_rounds_keep_one_weight_set_per_version_and_lose_nothing(
    swarm_factory: Callable[..., Swarm],
):
    # DiLoCo's mode (node/local_steps.py): a round every 2 batches, its pseudo-gradients
    # 8-bit on the wire; the README's commands otherwise (each trainer takes its share).
    swarm = swarm_factory("swarm.local_steps=2", "swarm.grad_compression=uint8")
    start_swarm(swarm, ["trainer-a", "trainer-b"])

    def both_stepped_together_three_times() -> bool:
        common = set(checkpoints(swarm, "trainer-a")) & set(checkpoints(swarm, "trainer-b"))
        return len(common - {0}) >= 3

    swarm.wait_for("three versions made by both trainers", both_stepped_together_three_times)
    codes = swarm.stop()
    assert set(codes.values()) == {0}, swarm.logs()
    check_every_group_accounted_for(swarm, ["trainer-a", "trainer-b"])
    a, b = checkpoints(swarm, "trainer-a"), checkpoints(swarm, "trainer-b")
    common = sorted(set(a) & set(b))
    for version in common:
        assert max_difference(a[version], b[version]) == 0.0, version
    assert max_difference(a[common[0]], a[common[-1]]) > 1e-4
    for name in ("trainer-a", "trainer-b"):
        steps = [r for r in swarm.steps(name) if r["charts/samples"] > 0]
        applied = [r for r in steps if r["optimizer_stepped"]]
        inner = [r for r in steps if not r["optimizer_stepped"] and not r["optimizer_discarded"]]
        # a version every second batch: each applied step's batch is the second of two
        assert len(applied) >= 2 and len(inner) >= len(applied), (name, len(applied), len(inner))
        # and its groups were trained with the step that made the version, not before
        assert all(not r["trained_group_ids"] for r in inner)
    assert leftovers(swarm) == {}


@pytest.mark.integration
def test_three_trainers_step_together_with_the_same_weights(swarm_factory: Callable[..., Swarm]):
    """Three trainers with a global batch of three local batches: rounds of three peers,
    where a trainer's parts go to two other reducers. Every version is one set of weights,
    and every group is trained once."""
    trainers = ["trainer-a", "trainer-b", "trainer-c"]
    swarm = swarm_factory(f"swarm.target_batch_size={3 * SAMPLES_PER_TRAINER_BATCH}")
    start_swarm(swarm, trainers)

    def common_versions() -> set[int]:
        return set.intersection(*(set(checkpoints(swarm, t)) for t in trainers))

    def all_three_averaged() -> bool:
        """Some step averaged the whole gradients of both other trainers."""
        return any(len(r["peer_batch_ids"]) == 2 for t in trainers for r in swarm.steps(t))

    # On a loaded 2-core box the first rounds can time out while the three find each other
    # (each then steps alone or in a pair): wait for a round of three, bounded by WAIT_S,
    # rather than stopping at the second version.
    swarm.wait_for(
        "two versions reached by all three trainers, and a round of all three",
        lambda: len(common_versions()) >= 2 and all_three_averaged(),
    )
    codes = swarm.stop()
    assert set(codes.values()) == {0}, swarm.logs()
    check_every_group_accounted_for(swarm, trainers)
    assert leftovers(swarm) == {}
    saved = {t: checkpoints(swarm, t) for t in trainers}
    apart = {
        (version, t): max_difference(saved["trainer-a"][version], saved[t][version])
        for version in sorted(common_versions())
        for t in trainers[1:]
    }
    # One version, one set of weights, on all three (bench/LOG.md, 2026-12-01: hivemind's
    # offloaded optimizer let a broken parameter round write into a version's weights).
    assert not any(apart.values()), apart


@pytest.mark.integration
def test_a_trainer_that_gives_up_on_rounds_its_peer_completes_trains_nothing_twice(
    swarm_factory: Callable[..., Swarm],
):
    """trainer-b gives up on every gradient round just as it completes (tests/gives_up.py):
    trainer-a steps with b's gradients each time, and b does not train those groups again.
    It finds a's marks of its batches and counts their groups trained. (b can step while
    it is alone, before a's record is up: that is no round.)"""
    swarm = swarm_factory(f"swarm.target_batch_size={2 * SAMPLES_PER_TRAINER_BATCH}")
    start_swarm(swarm, ["trainer-a", "trainer-b"], modules={"trainer-b": "tests.gives_up"})
    swarm.wait_for(
        "trainer-b to settle two batches trained by trainer-a",
        lambda: len(trained_by_peers(swarm, "trainer-b")) >= 2 * 2,  # groups_per_step=2
    )
    codes = swarm.stop()
    assert set(codes.values()) == {0}, swarm.logs()
    check_every_group_accounted_for(swarm, ["trainer-a", "trainer-b"])  # none twice
    # each settled at a version that holds trainer-a's step (it caught up first)
    a_versions = {r["policy_version"] for r in swarm.steps("trainer-a")}
    rows = swarm.metrics("trainer-b", "trainer")
    settled = [r for r in rows if r.get("event") == "trained_by_peer"]
    assert all(r["policy_version"] in a_versions for r in settled), settled
    assert leftovers(swarm) == {}


def kill_trainer_b_and_go_on(swarm: Swarm, versions: int) -> None:
    """SIGKILL trainer-b; wait for trainer-a to make `versions` more, and for the rollout
    node to find trainer-b gone (two directory reads without its record, then no answer)
    and settle what it held: trained per the marks, or sent to trainer-a."""
    swarm.kill("trainer-b")
    killed_at = swarm.version("trainer-a")
    swarm.wait_for("trainer-a to go on", lambda: swarm.version("trainer-a") >= killed_at + versions)
    swarm.wait_for(
        "the rollout node to settle trainer-b's groups",
        lambda: "is gone" in (swarm.dir / "rollout.log").read_text(),
    )


@pytest.mark.integration
def test_a_joining_trainer_catches_up_and_a_killed_one_loses_nothing(
    swarm_factory: Callable[..., Swarm],
):
    swarm = swarm_factory()
    join = start_swarm(swarm, ["trainer-a"])
    swarm.wait_for("trainer-a at version 3", lambda: swarm.version("trainer-a") >= 3)
    # alone, trainer-a runs hivemind's DHT process and no averager processes
    alone = forks(swarm.procs["trainer-a"].pid)

    # a trainer joining mid-run starts from the swarm's weights, not from the base model
    start_trainer(swarm, "trainer-b", join)
    swarm.wait_for(  # its step's metrics row comes before that version's checkpoint
        "trainer-b to train and save a version",
        lambda: (
            any(r["trained_group_ids"] for r in swarm.steps("trainer-b"))
            and bool(checkpoints(swarm, "trainer-b"))
        ),
    )
    [started] = [r for r in swarm.metrics("trainer-b", "trainer") if r.get("event") == "started"]
    assert started["joined"] and started["policy_version"] >= 3
    b = checkpoints(swarm, "trainer-b")
    assert min(b) >= 3  # the joiner's versions continue the swarm's, not the base model's
    # trainer-a started its two averagers when the joiner appeared, and served it its state
    joined = forks(swarm.procs["trainer-a"].pid)
    assert alone < joined and len(joined - alone) == 2, (alone, joined)

    # SIGKILL it mid-run: trainer-a goes on, and what trainer-b held is trained there
    kill_trainer_b_and_go_on(swarm, versions=3)
    codes = swarm.stop()
    assert set(codes.values()) == {0}, swarm.logs()
    counts = check_every_group_accounted_for(swarm, ["trainer-a", "trainer-b"])
    assert counts["trained"] > 0
    assert leftovers(swarm) == {}


@pytest.mark.integration
@pytest.mark.parametrize(
    "settings",
    [(), ("rollout.dtype=bfloat16",), ("model.lora_rank=4",)],
    ids=["full", "bf16-sampler", "lora"],
)
def test_two_rollout_nodes_pass_policy_versions_on_to_each_other(
    swarm_factory: Callable[..., Swarm], settings: tuple[str, ...]
):
    """A trainer and two rollout nodes: each takes its share of a version's chunks from the
    trainer and the rest from the other's relay (node/relay.py), and both load exactly the
    versions the trainer published (with LoRA: the adapters, merged by each node). Once a
    node holds a version, the next ones come as deltas (node/delta.py), relayed too. (On
    one host they would map the trainer's memory instead: told to fetch as across hosts.)"""
    swarm = swarm_factory("net.map_local=false", *settings)
    join = start_swarm(swarm, ["trainer-a"])
    swarm.start("rollout-b", "node", "--role", "rollout", "--join", join)
    names = ("rollout", "rollout-b")

    def fetched(name: str) -> list[dict[str, Any]]:
        return [r for r in swarm.metrics(name, "rollout") if r.get("event") == "weights_fetched"]

    def loaded(name: str) -> list[dict[str, Any]]:
        return [r for r in swarm.metrics(name, "rollout") if r.get("event") == "weights_loaded"]

    def both_loaded_versions_with_chunks_from_the_other() -> bool:
        return all(
            len(loaded(name)) >= 2
            and sum(r["chunks_from_relays"] for r in fetched(name)) > 0
            and any("delta_from" in r for r in fetched(name))
            for name in names
        )

    swarm.wait_for(
        "each rollout node to load versions whole and as deltas, with chunks from the other",
        both_loaded_versions_with_chunks_from_the_other,
    )
    codes = swarm.stop()
    assert set(codes.values()) == {0}, swarm.logs()
    published = {r["policy_version"]: r["policy_sha256"] for r in swarm.steps("trainer-a")}
    for name in names:
        assert all(published[r["policy_version"]] == r["policy_sha256"] for r in loaded(name))
        # ... and took its own share from the trainer
        assert sum(r["chunks_from_trainer"] for r in fetched(name)) > 0
        # every delta rebuilt its version (the bytes the node held were the base's)
        assert all(r["deltas_refused"] == 0 for r in fetched(name))
    check_every_group_accounted_for(swarm, ["trainer-a"], rollouts=names)
    assert leftovers(swarm) == {}


def start_swarm_on_hosts(
    swarm: Swarm, net: Swarmnet, limit_mbit: float | None = None
) -> dict[str, Node]:
    """Coordinator, trainer-a, trainer-b and a rollout node, each on a host of its own in
    `net` ("coord", "ta", "tb", "roll"; each link limited to `limit_mbit` each way), joined
    through the coordinator by the README's commands."""
    hosts = {name: net.add_node(name) for name in ("coord", "ta", "tb", "roll")}
    if limit_mbit is not None:
        for host in hosts.values():
            host.limit(limit_mbit)
    swarm.start(
        "coordinator", "coordinator", "--listen", f"{hosts['coord'].ip}:7000",
        host=hosts["coord"],
    )  # fmt: skip
    join = swarm.join_address()
    assert f"/ip4/{hosts['coord'].ip}/tcp/7001/" in join
    for name, host in (("trainer-a", hosts["ta"]), ("trainer-b", hosts["tb"])):
        swarm.start(
            name, "node", "--role", "trainer", "--join", join,
            "--listen", f"{host.ip}:7100", host=host,
        )  # fmt: skip
    swarm.start(
        "rollout", "node", "--role", "rollout", "--join", join,
        "--listen", f"{hosts['roll'].ip}:7200", host=hosts["roll"],
    )  # fmt: skip
    return hosts


@pytest.mark.netns
def test_a_swarm_across_hosts_survives_a_cut_link(swarm_factory: Callable[..., Swarm]):
    """Coordinator, two trainers and a rollout node, each in its own network namespace
    with its own address, form a swarm through --join. One trainer's link is cut: the
    others go on; restored, it rejoins and trains again; every group is trained once."""
    require_netns()
    swarm = swarm_factory("net.map_local=false")  # hosts of their own: no shared memory
    with Swarmnet() as net:
        hosts = start_swarm_on_hosts(swarm, net)

        def trained_since(name: str, version: int) -> bool:
            return any(
                r["trained_group_ids"] and r["policy_version"] > version for r in swarm.steps(name)
            )

        swarm.wait_for("both trainers to train", lambda: all(
            trained_since(t, 0) for t in ("trainer-a", "trainer-b")
        ))  # fmt: skip
        hosts["tb"].link_down()
        cut_at = swarm.version("trainer-a")
        swarm.wait_for("trainer-a to go on alone", lambda: trained_since("trainer-a", cut_at + 3))
        hosts["tb"].link_up()
        back_at = swarm.version("trainer-a")
        swarm.wait_for("trainer-b to rejoin and train", lambda: trained_since("trainer-b", back_at))
        codes = swarm.stop()
        assert set(codes.values()) == {0}, swarm.logs()
        # Nothing is lost, and the weights that go on hold every group once. A step the cut
        # trainer made in the last moment before the cut is covered by trainer-a's mark of
        # its batch (docs/swarm.md, "Round marks"); but a step only the cut trainer
        # finished (its round incomplete for trainer-a) is a dead end, and its groups are
        # re-sent and trained again by trainer-a: both step rows list them.
        counts = check_every_group_accounted_for(
            swarm, ["trainer-a", "trainer-b"], duplicates_allowed=True
        )
        assert counts["duplicated"] <= 4, counts  # two steps of trainer.groups_per_step=2
        kept = trained_in_the_weights_that_go_on(swarm, "trainer-a", "trainer-b")
        assert len(kept) == len(set(kept)), "a group is in the weights twice"
        log_b = (swarm.dir / "trainer-b.log").read_text()
        assert "cut off from the swarm" in log_b and "reachable again" in log_b


@pytest.mark.integration
def test_a_teacher_node_killed_and_restarted_mid_run_loses_nothing(
    swarm_factory: Callable[..., Swarm], tiny_model_dir: Path
):
    """Distillation through `agentjet node --role teacher` (rollout.teachers="nodes"): the
    rollout node finds the teacher node in the directory and has every sample scored there.
    The teacher node SIGKILLed mid-run: the rollout node holds its group (not dropped, not
    sent unscored) until the node, started again, answers. Every group is accounted for,
    and every sample trained carried the teacher's scores."""
    swarm = swarm_factory(
        f"envs.0.teacher={json.dumps(str(tiny_model_dir))}",
        'rollout.teachers="nodes"',
        "rollout.teacher_timeout_s=5",
    )
    join = start_swarm(swarm, ["trainer-a"])
    teacher_args = ("node", "--role", "teacher", "--join", join)
    swarm.start("teacher", *teacher_args)

    def scored_batches() -> int:
        rows = swarm.metrics("rollout", "rollout")
        return sum(1 for r in rows if r.get("event") == "batch" and "distill/kl_to_teacher" in r)

    def held_in_log() -> int:
        return (swarm.dir / "rollout.log").read_text().count("no teacher node answers")

    swarm.wait_for(
        "two scored batches and a version",
        lambda: scored_batches() >= 2 and swarm.version("trainer-a") >= 1,
    )
    shown = status_showing(swarm, join, "1 teacher")
    assert f": {tiny_model_dir}" in shown  # "teachers on <node>: <its teachers>"

    held_before = held_in_log()
    swarm.kill("teacher")
    swarm.wait_for("the rollout node to hold a group", lambda: held_in_log() > held_before)
    scored_at_kill = scored_batches()
    swarm.start("teacher", *teacher_args)
    swarm.wait_for("two more scored batches", lambda: scored_batches() >= scored_at_kill + 2)
    codes = swarm.stop()
    assert set(codes.values()) == {0}, swarm.logs()
    counts = check_every_group_accounted_for(swarm, ["trainer-a"])
    assert counts["trained"] > 0
    log = (swarm.dir / "rollout.log").read_text()
    assert re.search(r"scored group \S+, held \d+ s", log), log[-3000:]
    rows = swarm.metrics("rollout", "rollout")
    batches = [r for r in rows if r.get("event") == "batch" and r["group_ids"]]
    assert all("distill/kl_to_teacher" in r for r in batches)
    [stopped] = [r for r in rows if r.get("event") == "stopped"]
    assert stopped["groups_held_for_teacher"] >= 1
    trained = [r for r in swarm.steps("trainer-a") if r.get("charts/trained_samples")]
    assert trained and all(
        r["charts/teacher_samples"] == r["charts/trained_samples"] for r in trained
    )
    assert leftovers(swarm) == {}
