"""The fault suite: a swarm on loopback trains through crashes, stalls and a cut connection,
and every trajectory group is accounted for from creation to training.

    coordinator ─┬─ trainer-a ──┐ hivemind (gradients, state)
                 │  trainer-b ──┘   ▲ its ZMQ endpoint reached through a proxy we can cut
                 └─ rollout ────────┘
    faults, in an order and at points (policy versions) drawn from a seeded RNG:
      SIGKILL + restart of the rollout node, the coordinator, trainer-a, trainer-b
      SIGSTOP of a trainer (a stall shorter than its record's lifetime), then SIGCONT
      the rollout node's connection to trainer-b cut, then restored

At the end every group the rollout node made (in any of its lives) must be trained once,
dropped as stale or rejected by a check (counted), or still held by the rollout node;
policy versions never go back on any node. `just test-faults` runs this and the fuzz test
and writes bench/results/faults.json.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fault_results import merge_results
from tests.integration.test_swarm import (
    Swarm,
    free_listen,
    leftovers,
    settled_by_marks,
    trained_by_peers,
    trained_groups,
)

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("AGENTJET_FAULT_SEED", "0"))
# A stall shorter than swarm.record_ttl_s (3 s here): the trainer is slow, not gone.
STALL_S = 2.0
# Longer than net.request_timeout_s (2 s): requests time out and are retried.
CUT_S = 4.0


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
            """Wait until the swarm has made 1-3 more versions (the fault's random point)."""
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

    figures = account(swarm)
    figures["faults_injected"] = len(injected)
    figures["faults"] = injected
    merge_results(figures)
    assert figures["lost"] == 0, figures
    assert figures["duplicated"] == 0, figures
    assert figures["groups_trained"] > 0
    assert leftovers(swarm) == {}


def account(swarm: Swarm) -> dict[str, Any]:
    """Every group from creation (any life of the rollout node) to its end."""
    rollout = swarm.metrics("rollout", "rollout")
    created = {
        g
        for r in rollout
        if r.get("event") in ("batch", "restored")
        for g in r.get("group_ids", [])
    }
    trainers = ("trainer-a", "trainer-b")
    trained = trained_groups(swarm, list(trainers))
    stale = {
        g
        for t in trainers
        for r in swarm.metrics(t, "trainer")
        for g in r.get("stale_group_ids", [])
    }
    # left out by the trainer's logprob check (counted; none expected from honest nodes)
    rejected = {g for t in trainers for r in swarm.steps(t) for g in r["rejected_group_ids"]}
    ends = [r for r in rollout if r.get("event") == "stopped"]
    held = set(ends[-1]["unacked_group_ids"])
    settled = settled_by_marks(swarm, list(trainers), set(trained))
    lost = created - set(trained) - settled - stale - held - rejected
    for name in trainers:  # versions never go back, across the lives of each trainer
        versions = [r["policy_version"] for r in swarm.steps(name)]
        assert versions == sorted(versions), (name, versions)
    loaded = [r["policy_version"] for r in rollout if r.get("event") == "weights_loaded"]
    assert loaded == sorted(loaded), loaded
    return {
        "groups_created": len(created),
        "groups_trained": len(set(trained) | settled),
        "groups_trained_without_step_row": len(settled),
        "groups_trained_by_peer": sum(len(trained_by_peers(swarm, t)) for t in trainers),
        "groups_stale": len(stale),
        "groups_rejected": len(rejected),
        "groups_held_at_end": len(held - set(trained) - stale),  # untrained, on disk
        "lost": len(lost),
        "duplicated": len(trained) - len(set(trained)),
        "restored_from_spool": sum(
            len(r["group_ids"]) for r in rollout if r.get("event") == "restored"
        ),
        "final_policy_version": max(swarm.version(t) for t in trainers),
        "seed": SEED,
    }
