"""Generated junk at every listening socket and endpoint: each input gets an answer, the
server stays up, and its memory stays bounded.

Inputs (hypothesis, derandomized, so every run throws the same ones): raw bytes; msgpack
maps tagged as each real message type with fields of the right names and arbitrary values;
well-typed messages with arbitrary values; and real messages with a byte changed or cut
short. The ZMQ peers say Hello first, so the
junk reaches the handlers behind the handshake too.
"""

from __future__ import annotations

import asyncio
import json
import typing
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentjet import protocol
from agentjet.keys import SwarmKeys
from agentjet.lifeline import running
from node.openai_api import EpisodeHub, OpenAIServer
from tests.factories import RuleGenerator, make_group
from tests.fault_results import record_fuzz
from tests.integration.test_coordinator import Coordinators, coordinators  # noqa: F401
from tests.integration.test_openai_api import TASK, serve, tokenizer  # noqa: F401
from tests.integration.test_trainer_node import Launched, trainer  # noqa: F401

pytestmark = pytest.mark.integration

EXAMPLES = 300  # per socket
REPLY_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0  # a trainer loads its model and joins hivemind first
RSS_GROWTH_LIMIT_BYTES = 64 << 20
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=64),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def junk(union: Any, valid: list[msgspec.Struct]) -> st.SearchStrategy[bytes]:
    """Raw bytes, tagged maps with the union's field names, and damaged real messages."""
    kinds = typing.get_args(union)
    tagged = st.sampled_from(kinds).flatmap(
        lambda kind: st.dictionaries(
            st.sampled_from([*kind.__struct_fields__, "x"]), _values, max_size=6
        ).map(lambda fields: msgspec.msgpack.encode({**fields, "t": kind.__struct_config__.tag}))
    )
    payloads = [protocol.encode(m) for m in valid]
    damaged = st.tuples(
        st.sampled_from(payloads), st.integers(0, 1 << 16), st.integers(1, 255)
    ).map(lambda p: _damage(*p))
    # well-typed messages with arbitrary values (negative counts, odd ids, huge numbers)
    typed = st.sampled_from(kinds).flatmap(st.from_type).map(_encode_or_empty)
    return st.one_of(st.binary(max_size=2048), tagged, damaged, typed)


def _encode_or_empty(message: Any) -> bytes:
    try:
        return protocol.encode(message)
    except (TypeError, OverflowError):  # a value msgpack cannot carry: send nothing instead
        return b""


def _damage(payload: bytes, at: int, xor: int) -> bytes:
    at %= len(payload)
    if xor % 2:  # cut short
        return payload[:at]
    return payload[:at] + bytes([payload[at] ^ xor]) + payload[at + 1 :]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Peer:
    """One DEALER that has said Hello; asks and insists on an answer."""

    def __init__(
        self, endpoint: str, decoder: msgspec.msgpack.Decoder[Any], role: str, keys: SwarmKeys
    ) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys.secure_client(self.sock)
        self.sock.connect(endpoint)
        self.decoder = decoder
        self.sent = 0
        hello = protocol.Hello(
            node_id="fuzzer", role=role, protocol_version=protocol.PROTOCOL_VERSION
        )  # type: ignore[arg-type]
        # ZMQ holds the Hello until the server (still starting) binds its socket
        assert isinstance(self.ask(protocol.encode(hello), START_TIMEOUT_S), protocol.Welcome)
        self.sent = 0

    def ask(self, payload: bytes, timeout_s: float = REPLY_TIMEOUT_S) -> Any:
        self.sock.send(payload)
        assert self.sock.poll(int(timeout_s * 1000)), f"no answer to {payload[:80]!r}"
        self.sent += 1
        return self.decoder.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def fuzz_socket(target: str, peer: Peer, pid: int, inputs: st.SearchStrategy[bytes]) -> None:
    before = rss(pid)

    @FUZZ
    @given(inputs)
    def throw(payload: bytes) -> None:
        peer.ask(payload)  # any decodable answer: most are Error, a few inputs are valid

    try:
        throw()
    finally:
        record_fuzz(target, peer.sent, crashed=not running(pid))
    assert peer.sent > EXAMPLES // 2
    assert rss(pid) - before < RSS_GROWTH_LIMIT_BYTES


def test_trainer_socket_answers_junk_and_stays_up(trainer: Launched) -> None:  # noqa: F811
    peer = Peer(trainer.endpoint, protocol.trainer_reply_decoder, "rollout", trainer.keys)
    valid = [
        protocol.SubmitGroup(group=make_group("fz")),
        protocol.GroupStatusQuery(group_ids=["a", "b"]),
        protocol.PolicyQuery(),
        protocol.WeightChunkRequest(version=0, index=1),
    ]
    try:
        fuzz_socket("trainer", peer, trainer.pid, junk(protocol.TrainerRequest, valid))
        info = peer.ask(protocol.encode(protocol.PolicyQuery()))
        assert isinstance(info, protocol.PolicyInfo) and info.version == 0
    finally:
        peer.close()
    assert trainer.stop()["counts/rejected_messages"] >= 3


def test_coordinator_socket_answers_junk_and_stays_up(coordinators: Coordinators) -> None:  # noqa: F811
    proc = coordinators.start(coordinators.config())
    peer = Peer(
        coordinators.endpoint, protocol.coordinator_reply_decoder, "rollout", coordinators.keys
    )
    valid = [
        protocol.WorkRequest(node_id="fuzzer", max_groups=2, policy_version=0),
        protocol.GroupReport(node_id="fuzzer", grant_id="g", rewards=[1.0, 0.0, 0.0, 1.0]),
        protocol.StatusRequest(),
        protocol.Heartbeat(node_id="fuzzer", role="rollout"),
    ]
    try:
        fuzz_socket("coordinator", peer, proc.pid, junk(protocol.CoordinatorRequest, valid))
        status = peer.ask(protocol.encode(protocol.StatusRequest()))
        assert isinstance(status, protocol.CoordinatorStatus)
    finally:
        peer.close()


def test_openai_endpoint_answers_junk_and_stays_up(tokenizer: Any) -> None:  # noqa: F811
    fields = st.fixed_dictionaries(
        {"messages": _values},
        optional={k: _values for k in ("model", "tools", "temperature", "max_tokens", "stream")},
    )
    bodies = st.one_of(
        st.binary(max_size=2048),
        _values.map(lambda v: json.dumps(v, default=repr).encode()),
        fields.map(lambda v: json.dumps(v, default=repr).encode()),
    )

    async def test(server: OpenAIServer, hub: EpisodeHub) -> None:
        episode = hub.open(TASK, training=False)
        headers = {"Authorization": f"Bearer {episode.key}"}
        statuses: list[int] = []

        def throw_all() -> None:
            with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as http:

                @FUZZ
                @given(bodies)
                def throw(body: bytes) -> None:
                    reply = http.post("/v1/chat/completions", content=body)
                    statuses.append(reply.status_code)
                    assert reply.status_code < 500, reply.text

                try:
                    throw()
                    ok = http.post(
                        "/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    )
                    assert ok.status_code == 200, ok.text
                except BaseException:  # a 5xx or a server that stopped serving
                    record_fuzz("openai", len(statuses), crashed=True)
                    raise
                record_fuzz("openai", len(statuses), crashed=False)

        await asyncio.to_thread(throw_all)
        assert len(statuses) > EXAMPLES // 2
        assert server.rejected == sum(s >= 400 for s in statuses)

    serve(RuleGenerator(tokenizer, lambda context: "fine"), test)
