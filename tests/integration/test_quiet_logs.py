"""A coordinator flooded with junk from a client that holds the swarm's keys, and with
connections from clients that do not, logs a few lines whose counts add up to what it
counted (agentjet/logs.py), not one line per message."""

from __future__ import annotations

import asyncio
import re
import signal

import pytest
import zmq

from agentjet import protocol
from agentjet.metrics import read_metrics
from agentjet.protocol import CoordinatorStatus, StatusRequest
from tests.factories import member_hello
from tests.integration.test_coordinator import (  # noqa: F401
    REPLY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Coordinators,
    coordinators,
    poll_until,
    status_of,
    wait_until_serving,
)

pytestmark = pytest.mark.integration

JUNK_MESSAGES = 2000
STRANGERS = 20  # clients without keys, each refused at its handshake (and its retries)


def logged_total(log: str, first: str, repeated: str) -> tuple[int, int]:
    """(lines, events they count): a `first` line is one event, a `repeated` line N."""
    ones = log.count(first)
    more = [int(n) for n in re.findall(repeated, log)]
    return ones + len(more), ones + sum(more)


def test_a_flood_is_logged_in_a_few_lines_with_its_true_count(
    coordinators: Coordinators,  # noqa: F811
) -> None:
    proc = coordinators.start(coordinators.config())
    context = zmq.Context.instance()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    keys = coordinators.member("junk")
    keys.secure_client(raw)
    raw.connect(coordinators.endpoint)
    strangers = []
    try:
        raw.send(protocol.encode(member_hello(keys)))
        assert raw.poll(30_000), "no Welcome"
        raw.recv()
        for _ in range(JUNK_MESSAGES):
            raw.send(b"\xc1 not msgpack")
        for _ in range(JUNK_MESSAGES):  # every one is answered
            assert raw.poll(int(REPLY_TIMEOUT_S * 1000))
            reply = protocol.coordinator_reply_decoder.decode(raw.recv())
            assert isinstance(reply, protocol.Error) and reply.code == "decode"
        for _ in range(STRANGERS):
            stranger = context.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(coordinators.endpoint)
            stranger.send(protocol.encode(StatusRequest()))
            strangers.append(stranger)

        async def refused_all() -> CoordinatorStatus:
            node = coordinators.client("node-a")
            try:
                await wait_until_serving(node, proc)

                async def counted() -> CoordinatorStatus | None:
                    status = await status_of(node)
                    return status if status.denied_handshakes >= STRANGERS else None

                return await poll_until(counted, f"{STRANGERS} refused handshakes")
            finally:
                node.close()

        assert asyncio.run(refused_all()).rejected_messages == JUNK_MESSAGES
    finally:
        raw.close()
        for stranger in strangers:
            stranger.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0

    # The last metrics row is written when serving ends, before the server's close logs
    # what it counted since its last line: the same counts.
    last = read_metrics(coordinators.run_dir / "metrics" / "coordinator.jsonl")[-1]
    log = coordinators.log_path.read_text()
    lines, rejected = logged_total(
        log, ": rejected a message:", r": rejected (\d+) more messages in the last"
    )
    assert rejected == last["coordinator/rejected_messages"] == JUNK_MESSAGES
    assert lines <= 3  # the first at once, then at most one per REPEATED_LOG_EVERY_S
    lines, denied = logged_total(
        log,
        "refused a connection without this swarm's keys",
        r"refused (\d+) more connections without this swarm's keys",
    )
    assert denied == last["coordinator/denied_handshakes"] >= STRANGERS
    assert lines <= 3
