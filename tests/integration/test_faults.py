"""The fault suite: a swarm on loopback trains through crashes, stalls and a cut connection,
and every trajectory group is accounted for from creation to training.

    coordinator ─┬─ trainer-a ──┐ hivemind (gradients, state)
                 │  trainer-b ──┘   ▲ its ZMQ endpoint reached through a proxy we can cut
                 └─ rollout ────────┘
    faults, in an order and at points (policy versions) drawn from a seeded RNG:
      SIGKILL + restart of the rollout node, the coordinator, trainer-a, trainer-b
      SIGKILL + restart of both trainers at once, and of the coordinator and a trainer
      SIGKILL of a trainer's main process alone, then a scan for its descendants
      SIGKILL of a trainer's largest child (what the OOM killer does): the trainer ends
      SIGSTOP of a trainer (a stall shorter than its record's lifetime), then SIGCONT
      the rollout node's connection to trainer-b cut, then restored
    and a lone trainer SIGKILLed before its first checkpoint, then after one.

At the end every group the rollout node made (in any of its lives) must be trained once in
the weights that go on (a step a dead lineage took past its checkpoint does not count),
dropped as stale or rejected by a check (counted), or still held by the rollout node; no
policy version goes back within a lineage on any node, no group is trained by a lineage
that does not descend from the one that sampled it, and no process of a dead role is alive
10 s after its death. `just test-faults` runs this and the fuzz test and writes
bench/results/faults.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentjet.lifeline import descendants, proc_info, running
from agentjet.protocol import Lineage
from tests.fault_results import merge_results
from tests.integration.test_swarm import (
    Swarm,
    free_listen,
    leftovers,
    settled_by_marks,
)

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("AGENTJET_FAULT_SEED", "0"))
# A stall shorter than swarm.record_ttl_s (3 s here): the trainer is slow, not gone.
STALL_S = 2.0
# Longer than net.request_timeout_s (2 s): requests time out and are retried.
CUT_S = 4.0
# What each role logs once it is up (coordinator: in the swarm's directory).
READY_LINES = ("ready:", "ready (envs", "coordinator is in the swarm's directory")
# A process of a dead role still alive this long after its death is an orphan.
ORPHAN_WAIT_S = 10.0
# How long a trainer whose hivemind child was killed may take to notice and end.
CHILD_DEATH_EXIT_S = 60.0


class CuttableProxy:
    """Forwards a loopback port to `target_port`. `cut()` drops every connection and turns
    new ones away (accepted, then closed) until `restore()`: a link that fails mid-stream."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.cut_now = False
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            if self.cut_now:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.connections |= {client, upstream}
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.cut_now = True
        with self.lock:
            for s in self.connections:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            self.connections.clear()

    def restore(self) -> None:
        self.cut_now = False

    def close(self) -> None:
        self.cut()
        self.server.close()
        for thread in self.threads:
            thread.join(timeout=5)


class FaultySwarm(Swarm):
    """A Swarm whose nodes can be killed and started again on the same run dir."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.argv: dict[str, tuple[str, ...]] = {}
        self.lives: dict[str, int] = {}
        self.orphans: dict[int, str] = {}  # processes alive ORPHAN_WAIT_S after their role

    def up(self, name: str) -> bool:
        """Whether the current life of `name` has said it is ready."""
        path = self.dir / f"{name}.log"
        text = path.read_text() if path.exists() else ""
        return any(m in text for m in READY_LINES)

    def kill_many(self, names: list[str]) -> None:
        """SIGKILL these nodes' process groups at once (a power cut), then restart each."""
        for name in names:
            self.kill(name)
        for name in names:
            self.restart(name)

    def kill_main(self, name: str) -> None:
        """SIGKILL the node's main process alone (not its group), count the processes it
        started that outlive it, restart it."""
        proc = self.procs[name]
        children = descendants(proc.pid)
        self.spawned |= children
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self._count_orphans(name, children)
        self.restart(name)

    def kill_largest_child(self, name: str) -> None:
        """SIGKILL the node's largest descendant by resident memory (the OOM killer's
        pick); the node must end by itself, leaving nothing behind; then restart it."""
        proc = self.procs[name]
        children = descendants(proc.pid)
        self.spawned |= children
        sizes = {pid: resident_bytes(pid) for pid in children}
        largest = max(sizes, key=lambda pid: sizes[pid])
        os.kill(largest, signal.SIGKILL)
        try:
            proc.wait(timeout=CHILD_DEATH_EXIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} did not end after its child {largest} was killed\n{self.logs()}"
            ) from None
        self._count_orphans(name, children - {largest})
        self.restart(name)

    def _count_orphans(self, name: str, pids: set[int]) -> None:
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling the process table, bounded
        for pid in pids:
            info = proc_info(pid)
            if info is not None and running(pid):
                self.orphans[pid] = name

    def launch(self, name: str, *args: str) -> None:
        self.argv[name] = args
        self.lives[name] = 1
        self.start(name, *args)

    def restart(self, name: str) -> None:
        """Start `name` again with its arguments and run dir (logs of earlier lives kept)."""
        for suffix in ("log", "out"):
            path = self.dir / f"{name}.{suffix}"
            path.rename(self.dir / f"{name}.{suffix}.{self.lives[name]}")
        self.lives[name] += 1
        self.start(name, *self.argv[name])

    def stall(self, name: str, seconds: float) -> None:
        """SIGSTOP the node and its hivemind daemons, then SIGCONT them."""
        pid = self.procs[name].pid
        os.killpg(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault itself is a span of time
        finally:
            os.killpg(pid, signal.SIGCONT)


@pytest.fixture
def faulty(tmp_path: Path, tiny_model_dir: Path) -> Iterator[FaultySwarm]:
    swarm = FaultySwarm(
        tmp_path,
        tiny_model_dir,
        (
            # Durable every other version: some "trained" marks wait for a checkpoint.
            "trainer.checkpoint_every=2",
            # The staleness window spans the pauses faults cause.
            "trainer.max_policy_lag=8",
            # A node restarted while its peers restart too joins once one of them is up.
            "swarm.startup_attempts=6",
            # Another mode under the same faults, e.g. "swarm.local_steps=2
            # swarm.grad_compression=uint8" (docs/links.md, "Gradient rounds").
            *os.environ.get("AGENTJET_FAULT_SETTINGS", "").split(),
        ),
    )
    yield swarm
    swarm.reap()


def _swarm_address(swarm: Swarm, name: str) -> str:
    """The swarm address a trainer logged when it was ready."""
    logs = (swarm.dir / f"{name}.log").read_text()
    found = re.findall(r" swarm (/ip4/\S+)", logs)
    assert found, f"{name} printed no swarm address"
    return found[-1]


def test_training_survives_crashes_stalls_and_cuts_and_loses_nothing(
    faulty: FaultySwarm,
) -> None:
    rng = random.Random(SEED)
    swarm = faulty
    # Fixed ports and peer keys: every node's swarm address survives its restarts, and a
    # restarted node joins through all the others (any one of them may be down).
    listen = {name: free_listen() for name in ("coordinator", "trainer-a", "trainer-b")}

    def identity(name: str) -> tuple[str, ...]:
        return ("--listen", listen[name], "--identity", str(swarm.dir / f"{name}.identity"))

    swarm.launch("coordinator", "coordinator", *identity("coordinator"))
    join = swarm.join_address()
    swarm.launch("trainer-a", "node", "--role", "trainer", "--join", join, *identity("trainer-a"))
    # trainer-b's rollout traffic goes through the proxy: its record names the proxy's port
    proxy = CuttableProxy(int(listen["trainer-b"].rpartition(":")[2]))
    try:
        swarm.launch(
            "trainer-b", "node", "--role", "trainer", "--join", join, *identity("trainer-b"),
            "--set", f'swarm.announce_endpoint="tcp://127.0.0.1:{proxy.port}"',
        )  # fmt: skip
        swarm.launch("rollout", "node", "--role", "rollout", "--join", join)
        swarm.wait_for(
            "both trainers to train",
            lambda: all(
                any(r["trained_group_ids"] for r in swarm.steps(t))
                for t in ("trainer-a", "trainer-b")
            ),
        )
        addresses = {
            "coordinator": join,
            **{t: _swarm_address(swarm, t) for t in ("trainer-a", "trainer-b")},
        }
        for name, args in swarm.argv.items():
            others = [a for n, a in addresses.items() if n != name and a not in args]
            swarm.argv[name] = (*args, *[x for a in others for x in ("--join", a)])

        def version() -> int:
            return max(swarm.version("trainer-a"), swarm.version("trainer-b"))

        def progress(what: str) -> None:
            """Wait until every node is up again and the swarm has made 1-3 more versions
            (the fault's random point)."""
            swarm.wait_for(f"every node up {what}", lambda: all(map(swarm.up, swarm.argv)))
            target = version() + rng.randint(1, 3)
            swarm.wait_for(f"version {target} {what}", lambda: version() >= target)

        def kill_and_restart(name: str) -> None:
            swarm.kill(name)
            swarm.restart(name)

        def stall_trainer() -> None:
            swarm.stall(rng.choice(["trainer-a", "trainer-b"]), STALL_S)

        def cut_connection() -> None:
            proxy.cut()
            time.sleep(CUT_S)  # the fault itself is a span of time
            proxy.restore()

        faults: list[tuple[str, Callable[[], None]]] = [
            ("kill rollout", lambda: kill_and_restart("rollout")),
            ("kill coordinator", lambda: kill_and_restart("coordinator")),
            ("kill trainer-a", lambda: kill_and_restart("trainer-a")),
            ("kill trainer-b", lambda: kill_and_restart("trainer-b")),
            ("stall a trainer", stall_trainer),
            ("cut rollout-trainer-b", cut_connection),
            ("kill both trainers", lambda: swarm.kill_many(["trainer-a", "trainer-b"])),
            (
                "kill coordinator and trainer-a",
                lambda: swarm.kill_many(["coordinator", "trainer-a"]),
            ),
            ("kill trainer-b's main process", lambda: swarm.kill_main("trainer-b")),
            ("kill trainer-a's largest child", lambda: swarm.kill_largest_child("trainer-a")),
        ]
        rng.shuffle(faults)
        injected = []
        for what, inject in faults:
            progress(f"before '{what}'")
            inject()
            injected.append(what)
        # every node back (a restarted trainer has trained again) before the end
        at = version()
        swarm.wait_for(
            "both trainers to train after the last fault",
            lambda: all(
                any(r["trained_group_ids"] and r["policy_version"] > at for r in swarm.steps(t))
                for t in ("trainer-a", "trainer-b")
            ),
        )
        codes = swarm.stop()
    finally:
        proxy.close()
    assert set(codes.values()) == {0}, (codes, swarm.logs())

    figures = account(swarm, ["trainer-a", "trainer-b"])
    figures["faults_injected"] = len(injected)
    figures["faults"] = injected
    merge_results(figures)
    check(figures)
    assert leftovers(swarm) == {}


def check(figures: dict[str, Any]) -> None:
    for zero in ("lost", "duplicated", "version_regressions", "cross_lineage_groups_trained"):
        # a string (pytest shortens a dict): the groups and rows behind a failure in full
        assert figures[zero] == 0, f"{zero}: {json.dumps(figures, sort_keys=True)}"
    assert figures["orphans"] == 0, figures
    assert figures["groups_trained"] > 0


def resident_bytes(pid: int) -> int:
    """A process's resident set (0 when it is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def test_a_lone_trainer_killed_before_its_first_checkpoint_and_after_one_loses_nothing(
    faulty: FaultySwarm,
) -> None:
    """The last trainer dies twice: before any checkpoint (it starts again from the base
    weights, a new lineage) and past one (it resumes from it, a lineage forked there).
    Each time, what its dead steps trained is trained again or dropped, never counted
    trained on the strength of its marks."""
    swarm = faulty
    every = 2  # trainer.checkpoint_every in the fixture
    listen = {name: free_listen() for name in ("coordinator", "trainer")}

    def identity(name: str) -> tuple[str, ...]:
        return ("--listen", listen[name], "--identity", str(swarm.dir / f"{name}.identity"))

    swarm.launch("coordinator", "coordinator", *identity("coordinator"))
    join = swarm.join_address()
    trainer = ("node", "--role", "trainer", "--join", join, *identity("trainer"))
    # Its first life never checkpoints, whenever the kill lands (polling its steps cannot
    # stop it short of v2); its later lives checkpoint every `every` versions.
    swarm.launch("trainer", *trainer, "--set", "trainer.checkpoint_every=1000000")
    swarm.argv["trainer"] = trainer
    swarm.launch("rollout", "node", "--role", "rollout", "--join", join)

    def trained_at(version: int) -> Callable[[], bool]:
        return lambda: any(
            r["trained_group_ids"] and r["policy_version"] == version
            for r in swarm.steps("trainer")
        )

    # Before its first checkpoint (v2): a step at v1 has trained groups.
    swarm.wait_for("a step before the first checkpoint", trained_at(every - 1))
    swarm.kill_main("trainer")
    first_life = len(swarm.steps("trainer"))
    swarm.wait_for(
        "the restarted trainer to train past a checkpoint",
        lambda: any(
            r["trained_group_ids"] and r["policy_version"] % every == 1 and r["policy_version"] > 1
            for r in swarm.steps("trainer")[first_life:]
        ),
    )
    swarm.kill_main("trainer")
    at = max(r["policy_version"] for r in swarm.steps("trainer"))
    swarm.wait_for(
        "training in the third life",
        lambda: (
            len([r for r in swarm.metrics("trainer", "trainer") if r.get("event") == "started"])
            == 3
            and swarm.version("trainer") > at
        ),
    )
    codes = swarm.stop()
    assert set(codes.values()) == {0}, (codes, swarm.logs())
    starts = [r for r in swarm.metrics("trainer", "trainer") if r.get("event") == "started"]
    assert [r["policy_version"] for r in starts][:2] == [0, 0]  # no checkpoint: the base
    assert starts[2]["policy_version"] > 0  # resumed from its checkpoint
    assert len({r["lineage"] for r in starts}) == 3
    figures = account(swarm, ["trainer"])
    merge_results({f"lone_trainer_{k}": v for k, v in figures.items()})
    check(figures)
    assert leftovers(swarm) == {}


def account(swarm: FaultySwarm, trainers: list[str]) -> dict[str, Any]:
    """Every group from creation (any life of the rollout node) to its end, counted in the
    weights that go on: steps of lineages the trainers' last lineages hold."""
    rollout = swarm.metrics("rollout", "rollout")
    created = {
        g
        for r in rollout
        if r.get("event") in ("batch", "restored")
        for g in r.get("group_ids", [])
    }
    sampled = {
        g: (r.get("lineage", ""), r["policy_version"])
        for r in rollout
        if r.get("event") == "batch"
        for g in r["group_ids"]
    }
    rows = {t: swarm.metrics(t, "trainer") for t in trainers}
    # Each lineage's ancestors, as the trainers that opened or took it said.
    lineages: dict[str, Lineage] = {}
    for r in (r for t in trainers for r in rows[t]):
        if r.get("event") in ("started", "caught_up") and "lineage" in r:
            lineages[r["lineage"]] = Lineage(id=r["lineage"], ancestors=r["lineage_ancestors"])
    newest_of: dict[str, int] = {}
    for r in (r for t in trainers for r in rows[t] if "lineage" in r):
        newest_of[r["lineage"]] = max(newest_of.get(r["lineage"], 0), r["policy_version"])
    final = [
        (lineages[r["lineage"]], newest_of[r["lineage"]])
        for t in trainers
        for r in [x for x in rows[t] if x.get("event") in ("started", "caught_up")][-1:]
    ]

    def goes_on(lineage: str, version: int) -> bool:
        return any(last.holds(lineage, version, newest) for last, newest in final)

    # The versions that go on, by their weights' hash: the groups their steps trained. A
    # trainer restarted at its peer's version opens a lineage of its own and steps in lock
    # step with that peer, making the same weights under another lineage's name: what its
    # steps trained is in the weights that go on all the same, should its lineage end with
    # it. (A step redone after a restart, on the same groups from the same weights, makes
    # the same hash too: its groups are the ones the step that goes on trained.)
    kept_steps: dict[tuple[int, str], set[str]] = {}
    for r in (r for t in trainers for r in rows[t]):
        if r.get("event") == "step" and goes_on(r["lineage"], r["policy_version"]):
            key = (r["policy_version"], r.get("policy_sha256") or "")
            kept_steps.setdefault(key, set()).update(r["trained_group_ids"])

    def in_kept_weights(r: dict[str, Any], group: str) -> bool:
        if goes_on(r["lineage"], r["policy_version"]):
            return True
        same = kept_steps.get((r["policy_version"], r.get("policy_sha256") or "-"))
        return same is not None and group not in same

    trained: list[str] = []
    lost_with_lineage: list[str] = []
    crossed = 0
    trained_where: dict[str, list[str]] = {}  # group -> the rows that trained it
    for name, r in ((n, r) for n in trainers for r in rows[n]):
        if r.get("event") not in ("step", "trained_by_peer"):
            continue
        ids = r["trained_group_ids"]
        for g in ids:
            (trained if in_kept_weights(r, g) else lost_with_lineage).append(g)
        trainer_lineage = lineages[r["lineage"]]
        for g in ids:
            lineage, version = sampled.get(g, ("", 0))
            if not trainer_lineage.trains(lineage, version):
                crossed += 1
            where = f"{name} {r['event']} {r['lineage'] or 'root'}@v{r['policy_version']}"
            trained_where.setdefault(g, []).append(where)
    stale = {g for t in trainers for r in rows[t] for g in r.get("stale_group_ids", [])}
    # left out by the trainer's logprob check (counted; none expected from honest nodes)
    rejected = {g for t in trainers for r in swarm.steps(t) for g in r["rejected_group_ids"]}
    ends = [r for r in rollout if r.get("event") == "stopped"]
    held = set(ends[-1]["unacked_group_ids"])
    settled = settled_by_marks(swarm, list(trainers), set(trained) | set(lost_with_lineage))
    lost = created - set(trained) - settled - stale - held - rejected
    twice = [g for g, n in Counter(trained).items() if n > 1]
    regressions = 0
    for steps in [swarm.steps(t) for t in trainers] + [
        [r for r in rollout if r.get("event") == "weights_loaded"]
    ]:
        newest: dict[str, int] = {}
        for r in steps:
            lineage = r.get("lineage", "")
            regressions += r["policy_version"] < newest.get(lineage, -1)
            newest[lineage] = max(newest.get(lineage, -1), r["policy_version"])
    return {
        "groups_created": len(created),
        "groups_trained": len(set(trained) | settled),
        "groups_trained_without_step_row": len(settled),
        "groups_trained_by_peer": sum(
            len(r["trained_group_ids"])
            for t in trainers
            for r in rows[t]
            if r.get("event") == "trained_by_peer"
        ),
        "groups_trained_in_dead_lineages": len(lost_with_lineage),
        "groups_stale": len(stale),
        "groups_rejected": len(rejected),
        "groups_held_at_end": len(held - set(trained) - stale),  # untrained, on disk
        "lost": len(lost),
        "duplicated": len(trained) - len(set(trained)),
        # which groups, and every row that trained them (only when there are any)
        **({"duplicated_where": {g: trained_where[g] for g in twice}} if twice else {}),
        **({"lost_ids": sorted(lost)} if lost else {}),
        "version_regressions": regressions,
        "cross_lineage_groups_trained": crossed,
        "orphans": len(swarm.orphans),
        "restored_from_spool": sum(
            len(r["group_ids"]) for r in rollout if r.get("event") == "restored"
        ),
        "final_policy_version": max(swarm.version(t) for t in trainers),
        "seed": SEED,
    }
