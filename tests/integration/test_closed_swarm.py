"""Only members average: a stranger with its own hivemind peer, pointed at a trainer's peer
id and averager names, gets nothing from its averaging handlers, while a member does.

Real hivemind throughout (in-process `SwarmOptimizer`s on their own DHTs, loopback), with
the swarm's keys: the trainers' DHTs admit only certificates of the swarm's root, and
their averagers answer only peers whose binding to such a certificate is in the DHT
(node/members.py `MemberGate`). The stranger needs no DHT for the handlers: it dials the
trainer's libp2p peer directly, as anyone who reads a `--join` address could. The second
test runs bench/identity.py's two trainer processes, with and without a stranger process
at their handlers all along, and compares their weights bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import msgspec
import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from agentjet.config import SwarmConfig
from agentjet.identity import NodeKeys
from agentjet.keys import new_keys
from bench.identity import accepted, member_optimizer, namespaces, stranger_calls
from node.dht import visible_maddrs
from node.swarm import SwarmOptimizer
from tests import procs
from tests.fault_results import merge_results
from tests.integration.test_swarm import REPO_ROOT
from tests.integration.test_swarm_state import _fake_gradients, _weights

pytestmark = pytest.mark.integration

# How many times the stranger tries each call.
ATTEMPTS = 5


def trainer(
    run: SwarmConfig, keys: NodeKeys, model: torch.nn.Module, others: int
) -> SwarmOptimizer:
    """A trainer's optimizer as node/trainer.py makes it: its DHT, its binding, its gate."""
    return member_optimizer(
        run, keys, model.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
        other_trainers=lambda: others,
    )  # fmt: skip


async def stranger_at(maddrs: list[str], peer: Any, namespaces: dict[str, str]) -> dict:
    """A stranger's own libp2p peer at `peer`'s averaging handlers, ATTEMPTS times."""
    p2p = await P2P.create(initial_peers=maddrs)
    try:
        return await stranger_calls(p2p, peer, namespaces, attempts=ATTEMPTS)
    finally:
        await p2p.shutdown()


class LoneTrainer:
    """Trainer A alone in a closed swarm, two versions ahead (`ahead`: its weights), and a
    member B that may join it (`member_takes_state`). A context manager: shuts both down."""

    def __init__(self, tag: str) -> None:
        self.run = SwarmConfig(
            run_id=f"test-{tag}-{time.monotonic_ns()}", averaging_timeout_s=5.0,
            request_timeout_s=0.5,
        )  # fmt: skip
        self.root = new_keys()
        torch.manual_seed(0)
        model, self.model_b = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
        self.a = trainer(self.run, NodeKeys.from_root(self.root, "trainer-a"), model, others=0)
        self.b: SwarmOptimizer | None = None
        for seed in (1, 2):  # alone in the swarm: two versions
            _fake_gradients(model, seed)
            assert self.a.step_outcome(batch_size=1).applied
        self.ahead = _weights(model)

    def member_takes_state(self) -> None:
        """A member joins and is served: it takes A's state, bit for bit."""
        joined = msgspec.structs.replace(self.run, initial_peers=visible_maddrs(self.a.dht))
        keys = NodeKeys.from_root(self.root, "trainer-b")
        self.b = trainer(joined, keys, self.model_b, others=1)
        assert self.b.load_state_from_peers()
        assert self.b.epoch == 2
        for got_weight, want in zip(_weights(self.model_b), self.ahead, strict=True):
            assert torch.equal(got_weight, want)

    def __enter__(self) -> LoneTrainer:
        return self

    def __exit__(self, *_: object) -> None:
        for each in (self.a, self.b):
            if each is not None:
                each.shutdown()
                each.dht.shutdown()  # given to it, not its own


@pytest.mark.timeout(240)
def test_a_stranger_gets_nothing_from_a_trainers_averaging_handlers() -> None:
    with LoneTrainer("closed") as lone:
        a = lone.a
        got = asyncio.run(stranger_at(visible_maddrs(a.dht), a.dht.peer_id, namespaces(a)))
        assert got["download"] == []  # not one byte of state
        assert accepted(got) == 0
        assert got["join"] == [averaging_pb2.NOT_LOOKING_FOR_GROUP] * ATTEMPTS
        # Refused before any part is read: a protocol violation, or the stream cut when the
        # close beats the reply; never a part of an average.
        assert set(got["aggregate"]) <= {averaging_pb2.PROTOCOL_VIOLATION, "reset"}
        counts = a.counts()
        assert counts["refused_state_downloads"] == ATTEMPTS
        assert counts["refused_round_joins"] == ATTEMPTS
        assert counts["refused_aggregate_parts"] == ATTEMPTS
        lone.member_takes_state()
        assert a.counts()["refused_state_downloads"] == ATTEMPTS


@pytest.mark.timeout(300)
def test_a_stranger_at_a_live_two_trainer_swarm_changes_no_bit() -> None:
    """bench/identity.py --stranger: two trainers of a closed swarm in lock step, alone and
    then with a stranger calling their averaging handlers the whole run; the weights of
    every version are the same bits in both runs, and the stranger got nothing."""
    epochs = 6
    done = procs.run(
        [sys.executable, "bench/identity.py", "--stranger", "--epochs", str(epochs), "--runs", "1"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    alone, joined = json.loads(done.stdout)["runs"]
    for run in (alone, joined):  # the two trainers agree at every version (the bench's check)
        assert run["versions_compared"] == epochs
        assert run["versions_identical"] == epochs
    assert joined["with_stranger"] == {
        "versions_compared": 2 * epochs,  # each trainer's every version
        "versions_identical": 2 * epochs,
        "max_abs_difference": 0.0,
    }
    stranger = joined["stranger"]
    assert stranger["accepted"] == 0
    assert stranger["state_bytes_received"] == 0
    assert stranger["state_downloads"] >= epochs  # it called all along the run
    for kind, tried in (
        ("state_downloads", stranger["state_downloads"]),
        ("round_joins", stranger["state_downloads"]),
        ("aggregate_parts", stranger["state_downloads"]),
    ):
        refused = [joined[f"trainer_{t}"][f"refused_{kind}"] for t in "ab"]
        # both trainers refused it; calls answered after a trainer's last count are not in it
        assert all(r > 0 for r in refused) and sum(refused) <= tried, (kind, refused, tried)
    merge_results(
        {
            "stranger_round_joins": stranger["round_joins"],
            "stranger_state_downloads": stranger["state_downloads"],
            "stranger_accepted": stranger["accepted"],
        }
    )
