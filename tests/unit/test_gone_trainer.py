"""A rollout node does not fetch policy versions from a trainer it found gone (issue 47:
it went on asking one 37 s after logging it gone), nor, after one fetch it did not
answer, before the directory says it is back. Fake trainers behind the node's view of its
peers (node/rollout_peers.py) and PolicySync: no sockets, no sleeps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

import pytest

from agentjet import protocol
from agentjet.config import Config, ModelConfig, NetConfig
from agentjet.metrics import MetricsWriter
from agentjet.transport import PeerUnavailable
from node import rollout_peers
from node.delivery import TrainerPeer
from node.engine import Engine
from node.policy_sync import PolicySync
from node.rollout_peers import Peers

pytestmark = pytest.mark.unit

DEAD, LIVE = "trainer-dead", "trainer-live"
ENDPOINTS = {DEAD: "tcp://127.0.0.1:41001", LIVE: "tcp://127.0.0.1:41002"}


class FakeEngine:
    """What PolicySync reads of an engine before a version arrives: version 0."""

    takes_adapters = True
    policy_version = 0
    policy_versions: dict[str, int] = {}


class FakeTrainer:
    """A trainer at one endpoint: answers polls at version 0 (nothing newer: no fetch), or,
    dead, answers nothing (`hang`: the request waits, as on a socket before its timeout)."""

    def __init__(self, alive: bool, hang: bool = False) -> None:
        self.alive = alive
        self.hang = hang
        self.asked = 0
        self.asking = asyncio.Event()  # a request is waiting on it now
        self.cancelled = 0  # requests given up while they waited

    async def answer(self, msg: Any) -> Any:
        self.asked += 1
        if self.alive:
            return protocol.PolicyInfo(version=0, nbytes=0, sha256="", num_chunks=0)
        if not self.hang:
            raise PeerUnavailable("no reply within 30.0 s")
        self.asking.set()
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")


class FakeClient:
    """A client of one FakeTrainer (a new one each time the node connects)."""

    def __init__(self, trainer: FakeTrainer) -> None:
        self.trainer = trainer
        self.hello = protocol.Hello(node_id="rollout-test", role="rollout")

    async def request(self, msg: Any, timeout_s: float | None = None) -> Any:
        return await self.trainer.answer(msg)

    def close(self) -> None:
        pass


def trainer_record(node_id: str, heartbeat: float) -> protocol.NodeRecord:
    return protocol.NodeRecord(
        node_id=node_id,
        role="trainer",
        endpoint=ENDPOINTS[node_id],
        policy_version=5 if node_id == DEAD else 3,  # the dead one is asked first
        capacity=8,
        time=heartbeat,
    )


def rollout_node(
    monkeypatch: pytest.MonkeyPatch, trainers: dict[str, FakeTrainer]
) -> tuple[Peers, PolicySync]:
    """A rollout node's view of its peers and its policy sync, its trainers' clients fakes."""
    engine = cast(Engine, FakeEngine())
    no_metrics = cast(Callable[[], MetricsWriter], lambda: None)  # (written on a fetch only)
    sync = PolicySync("", engine, ModelConfig(), NetConfig(map_local=False), no_metrics)
    hello = protocol.Hello(node_id="rollout-test", role="rollout")
    peers = Peers(Config(), hello, None, {"": sync})
    by_endpoint = {ENDPOINTS[name]: trainer for name, trainer in trainers.items()}
    monkeypatch.setattr(
        rollout_peers, "trainer_client", lambda endpoint, *_: FakeClient(by_endpoint[endpoint])
    )
    return peers, sync


async def poll(peers: Peers, sync: PolicySync) -> None:
    await sync.poll(peers.trainers, peers.clients, lambda: (None, []), peers.heartbeats)


def fetch_lines(caplog: pytest.LogCaptureFixture, trainer_id: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if f"policy fetch from {trainer_id}" in r.getMessage()
    ]


def test_a_rollout_node_does_not_fetch_from_a_trainer_it_found_gone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    trainers = {DEAD: FakeTrainer(alive=False), LIVE: FakeTrainer(alive=True)}
    peers, sync = rollout_node(monkeypatch, trainers)

    async def scenario() -> None:
        # Both listed; the dead one, newest, is asked first and does not answer.
        peers.apply_trainers([trainer_record(DEAD, 100.0), trainer_record(LIVE, 100.0)], now=0.0)
        await poll(peers, sync)
        assert (trainers[DEAD].asked, trainers[LIVE].asked) == (1, 1)
        # Its record outlives it (record_ttl_s): still listed, no newer heartbeat: not asked.
        for heartbeat in (101.0, 102.0):
            peers.apply_trainers(
                [trainer_record(DEAD, 100.0), trainer_record(LIVE, heartbeat)], now=heartbeat
            )
            await poll(peers, sync)
        assert (trainers[DEAD].asked, trainers[LIVE].asked) == (1, 3)

        # Found gone; a read that lags lists its last record again: it is not back.
        peers.drop_trainer(DEAD)
        peers.apply_trainers([trainer_record(DEAD, 100.0), trainer_record(LIVE, 103.0)], now=3.0)
        assert DEAD not in peers.trainers
        await poll(peers, sync)
        assert (trainers[DEAD].asked, trainers[LIVE].asked) == (1, 4)

        # Restarted, it heartbeats again: back, and asked again.
        peers.apply_trainers([trainer_record(DEAD, 110.0), trainer_record(LIVE, 110.0)], now=10.0)
        assert DEAD in peers.trainers
        await poll(peers, sync)
        assert trainers[DEAD].asked == 2

    asyncio.run(scenario())
    assert sync.interrupted_log.noted == 2  # asked twice: before it was found gone, once back
    joined = [r.getMessage() for r in caplog.records if f"trainer {DEAD} at" in r.getMessage()]
    assert len(joined) == 2  # at the start and once back: not on its stale record


def test_a_fetch_in_flight_from_a_trainer_found_gone_ends_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, it waited out net.request_timeout_s (and again on the trainer's socket after
    its sealed endpoint): a minute after the trainer died, half of it after the log said so."""
    trainers = {DEAD: FakeTrainer(alive=False, hang=True), LIVE: FakeTrainer(alive=True)}
    peers, sync = rollout_node(monkeypatch, trainers)

    async def scenario() -> None:
        peers.apply_trainers([trainer_record(DEAD, 100.0), trainer_record(LIVE, 100.0)], now=0.0)
        polling = asyncio.create_task(poll(peers, sync))
        await trainers[DEAD].asking.wait()
        peers.drop_trainer(DEAD)
        async with asyncio.timeout(10):  # (a guard: it ends at once)
            await polling
        assert trainers[DEAD].cancelled == 1
        assert trainers[LIVE].asked == 1  # the pass went on to the live trainer

    asyncio.run(scenario())


def test_a_trainer_without_a_directory_is_asked_at_every_poll_in_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A config without --join names its trainer, and no record says when it is back: it is
    asked at every poll, and its failures are counted, not logged one line each."""
    caplog.set_level(logging.INFO)
    trainers = {DEAD: FakeTrainer(alive=False)}
    peers, sync = rollout_node(monkeypatch, trainers)
    peers.add_trainer(TrainerPeer(DEAD, ENDPOINTS[DEAD]))

    async def scenario() -> None:
        for _ in range(3):
            await poll(peers, sync)

    asyncio.run(scenario())
    assert trainers[DEAD].asked == 3
    assert len(fetch_lines(caplog, DEAD)) == 1
    assert sync.interrupted_log.noted == 3
