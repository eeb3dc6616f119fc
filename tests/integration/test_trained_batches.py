"""A trainer's groups count as trained through a peer's marks (node/directory.py).

Two trainer processes (`SwarmOptimizer`s, their own peer keys, loopback) average
gradients; only trainer A marks anything trained, as when trainer B's link is cut right
after each step and its marks reach no one. The test process is a third DHT peer, like a
rollout node: once B is gone it asks `Directory.trained` about B's groups, and must find
exactly those of B's batches that A vouched for. In the second test B also gives up on
every round just as it completes, and must be told which of its batches are in doubt.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentjet.config import SwarmConfig
from agentjet.protocol import Lineage

pytestmark = pytest.mark.integration

EPOCHS = 4  # versions both trainers make together
RUN_TIMEOUT_S = 150.0
POLL_S = 0.1
# Stands in for a forward and backward pass. Without it the two trainers step back to
# back and often never meet in a gradient round (measured: 2 of 3 runs formed none in a
# minute, before round marks existed and with them; 0 of 5 with the pause).
STEP_PAUSE_S = 0.05


def test_a_directory_resolves_trained_groups_through_marked_batches() -> None:
    from node.dht import start_dht
    from node.directory import Directory, Mark

    config = SwarmConfig(run_id=f"test-marks-{time.monotonic_ns()}")
    dht = start_dht(config, keys=None)
    try:
        directory = Directory(dht, config)
        stores = directory.name_batch("b/1", ["g1", "g2"])
        stores += directory.name_batch("c/4", ["g2", "g3"])  # g2 re-sent to trainer c
        stores += directory.name_batch("b/2", ["g4"])
        assert all(store.result() for store in stores)
        directory.mark_trained(["own"], Mark("L1", 3), batch_ids=["c/4"])
        # a stranger's junk where a group's intent or mark belongs is ignored
        dht.store(directory.intent_prefix + "g5", True, time.time() + 60, subkey=12345)
        dht.store(directory.trained_prefix + "junk", "trainer-a", time.time() + 60)
        ids = ["own", "g1", "g2", "g3", "g4", "g5", "junk", "never-seen"]
        live = [(Lineage(id="L1"), 3)]
        assert directory.trained(ids, live) == {"own": None, "g2": "c/4", "g3": "c/4"}
        directory.mark_trained([], Mark("L1", 4), batch_ids=["b/1"])
        assert set(directory.trained(ids, live)) == {"own", "g2", "g3"}  # v4 died with its trainer
        assert set(directory.trained(ids, [(Lineage(id="L1"), 4)])) == {"own", "g1", "g2", "g3"}
        # a trainer resumed from its checkpoint at v3 in a new lineage holds v3, not v4
        resumed = [(Lineage(id="L2", ancestors={"L1": 3}), 9)]
        assert set(directory.trained(ids, resumed)) == {"own", "g2", "g3"}
        assert directory.trained(ids, []) == {}  # no live trainer: nothing is durable
    finally:
        dht.shutdown()


@contextlib.contextmanager
def two_trainers(tmp_path: Path, b_gives_up: bool = False) -> Iterator[tuple[Any, SwarmConfig]]:
    """Trainers A and B (`trainer` below) in a swarm whose DHT this process also serves;
    yields that DHT and the config once B is gone and A is done (A stays until the end)."""
    from node.dht import start_dht, visible_maddrs
    from tests import procs  # (here: this file also runs as a trainer's script)

    config = SwarmConfig(run_id=f"test-batches-{time.monotonic_ns()}", averaging_timeout_s=10.0)
    dht = start_dht(config, keys=None)
    children: dict[str, subprocess.Popen[bytes]] = {}
    try:
        (tmp_path / "config.json").write_text(
            json.dumps({"run_id": config.run_id, "initial_peers": visible_maddrs(dht)})
        )
        for role in ("a", "b"):
            fault = ["gives-up"] if role == "b" and b_gives_up else []
            children[role] = procs.popen(
                [sys.executable, __file__, role, str(tmp_path), *fault],
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / f"{role}.log").open("wb"),
                start_new_session=True,  # its hivemind daemons in its process group
            )
        # B is gone once it has made its versions; A stays, like the rest of the swarm.
        assert children["b"].wait(timeout=RUN_TIMEOUT_S) == 0, (tmp_path / "b.log").read_text()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (tmp_path / "a.done").exists():
            assert children["a"].poll() is None, (tmp_path / "a.log").read_text()
            assert time.monotonic() < deadline, "trainer A did not finish"
            time.sleep(POLL_S)
        yield dht, config
    finally:
        (tmp_path / "quit").touch()
        for child in children.values():
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        dht.shutdown()


def steps_of(tmp_path: Path, role: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / f"{role}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_peers_marks_cover_the_groups_of_a_trainer_whose_marks_were_lost(
    tmp_path: Path,
) -> None:
    from node.directory import Directory

    with two_trainers(tmp_path) as (dht, config):
        a_steps, b_steps = steps_of(tmp_path, "a"), steps_of(tmp_path, "b")
        vouched_by_a = {b for step in a_steps for b in step["peer_batches"]}
        # B's batches are B's own: A never vouches for one of its own
        assert not vouched_by_a & {s["batch_id"] for s in a_steps}
        covered = [s for s in b_steps if s["batch_id"] in vouched_by_a]
        assert len(covered) >= EPOCHS - 1, (a_steps, b_steps)
        b_groups = [g for s in b_steps for g in s["group_ids"]]
        expected = {g for s in covered for g in s["group_ids"]}

        live = [(Lineage(id="L"), EPOCHS)]
        trained = Directory(dht, config).trained(b_groups, live)

        assert set(trained) == expected
        assert set(trained.values()) <= vouched_by_a  # each through a batch A marked
        a_groups = [g for s in a_steps for g in s["group_ids"]]
        assert Directory(dht, config).trained(a_groups, live) == dict.fromkeys(a_groups)


@pytest.mark.timeout(300)
def test_a_trainer_that_gives_up_on_a_round_its_peer_completed_finds_its_batch_marked(
    tmp_path: Path,
) -> None:
    """B gives up on every gradient round just as it completes (as when its averaging
    timeout strikes then): B steps with none, A with each. B is told each such batch is
    in doubt, and finds exactly those A stepped with marked (node/trainer_doubtful.py settles them
    trained, instead of training their groups again)."""
    from node.directory import Directory

    with two_trainers(tmp_path, b_gives_up=True) as (dht, config):
        a_steps, b_steps = steps_of(tmp_path, "a"), steps_of(tmp_path, "b")
        assert not any(s["applied"] for s in b_steps)
        vouched_by_a = {b for step in a_steps for b in step["peer_batches"]}
        # (a batch of one sample waits for the next: two rows share its id)
        taken = {s["batch_id"] for s in b_steps} & vouched_by_a
        assert len(taken) >= EPOCHS - 1, (a_steps, b_steps)
        in_doubt = {s["in_doubt"] for s in b_steps if s["in_doubt"]}
        assert taken <= in_doubt

        assert Directory(dht, config).marked_batches(in_doubt) == taken


def trainer(role: str, workdir: Path, fault: str = "") -> None:
    """One trainer: a step of one sample each time (the swarm's target batch: two), each
    step's gradients named as a made-up group. A marks its steps trained; B marks nothing.
    Each applied step is a line: its groups, its batch id, the peers' batches it vouches
    for. With `fault` "gives-up" every step is a line (B's: it applies none)."""
    import msgspec
    import torch

    from node.directory import Mark
    from node.swarm import SwarmOptimizer
    from tests.gives_up import give_up_on_every_round

    config = msgspec.convert(json.loads((workdir / "config.json").read_text()), SwarmConfig)
    # A first round tried before the other trainer is there fails after this long.
    config = msgspec.structs.replace(config, averaging_timeout_s=10.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    swarm = SwarmOptimizer(
        config, model.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=2,
        other_trainers=lambda: 1,
    )  # fmt: skip
    if fault == "gives-up":
        give_up_on_every_round(type(swarm.optimizer))
    generator = torch.Generator().manual_seed(ord(role))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    pending: list[str] = []
    try:
        with (workdir / f"{role}.jsonl").open("w") as steps:
            while swarm.epoch < EPOCHS and time.monotonic() < deadline:
                group_id = f"{role}-{len(pending)}-{time.monotonic_ns()}"
                batch_id = swarm.name_groups([group_id])
                pending.append(group_id)
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=generator)
                time.sleep(STEP_PAUSE_S)
                outcome = swarm.step_outcome(batch_size=1)
                if outcome.applied and role == "a":
                    mark = Mark("L", outcome.epoch)
                    swarm.directory.mark_trained(pending, mark, outcome.peer_batches)
                if outcome.applied or fault:
                    step = {"group_ids": pending, "batch_id": batch_id}
                    step |= {"peer_batches": outcome.peer_batches, "in_doubt": outcome.in_doubt}
                    steps.write(json.dumps({**step, "applied": outcome.applied}) + "\n")
                    steps.flush()
                if outcome.applied or outcome.discarded:
                    pending = []  # a trainer would queue discarded ones again; here: gone
        (workdir / f"{role}.done").touch()
        while role == "a" and not (workdir / "quit").exists() and time.monotonic() < deadline:
            time.sleep(POLL_S)  # A stays in the swarm while the test reads it
    finally:
        swarm.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.gives_up
    trainer(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
