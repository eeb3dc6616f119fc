"""Generated junk at every listening socket and endpoint: each input gets an answer, the
server stays up, and its memory stays bounded.

Inputs (hypothesis, derandomized, so every run throws the same ones): raw bytes; msgpack
maps tagged as each real message type with fields of the right names and arbitrary values;
well-typed messages with arbitrary values; and real messages with a byte changed or cut
short. The ZMQ peers say Hello first, with a node certificate, so the junk reaches the
handlers behind the handshake too; junk Hellos carry junk certificates to the membership
check (agentjet/transport.py, agentjet/identity.py). A trainer's hivemind averaging
handlers get junk and oversized calls from a stranger's peer, and its gate junk membership
proofs (peer bindings) in the DHT.
"""

from __future__ import annotations

import asyncio
import json
import time
import typing
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.timed_storage import get_dht_time
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentjet import protocol
from agentjet.identity import NodeIdentity, NodeKeys, RootKey, read_node_keys
from agentjet.keys import new_keys
from agentjet.lifeline import running
from bench.identity import namespaces
from node.averagers import ExactGradientAverager, WholeStateAverager
from node.dht import visible_maddrs
from node.directory import Directory
from node.members import members_key
from node.openai_api import EpisodeHub, OpenAIServer
from tests.factories import RuleGenerator, make_group, member_hello
from tests.fault_results import record_fuzz
from tests.integration.test_closed_swarm import LoneTrainer
from tests.integration.test_coordinator import Coordinators, coordinators  # noqa: F401
from tests.integration.test_openai_api import TASK, serve, tokenizer  # noqa: F401
from tests.integration.test_trainer_node import Launched, trainer  # noqa: F401

pytestmark = pytest.mark.integration

EXAMPLES = 300  # per socket
REPLY_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0  # a trainer loads its model and joins hivemind first
RSS_GROWTH_LIMIT_BYTES = 64 << 20
FUZZER = "fuzzer"  # the node the fuzzing peer is; its valid requests name it
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
        self, endpoint: str, decoder: msgspec.msgpack.Decoder[Any], role: str, keys: NodeKeys
    ) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys.secure_client(self.sock)
        self.sock.connect(endpoint)
        self.decoder = decoder
        self.sent = 0
        hello = member_hello(keys, role)
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
    peer = Peer(trainer.endpoint, protocol.trainer_reply_decoder, "rollout", trainer.member(FUZZER))
    valid: list[msgspec.Struct] = [
        protocol.SubmitGroup(group=msgspec.structs.replace(make_group("fz"), node_id=FUZZER)),
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
    keys = read_node_keys(coordinators.keys_file, FUZZER)
    peer = Peer(coordinators.endpoint, protocol.coordinator_reply_decoder, "rollout", keys)
    valid: list[msgspec.Struct] = [
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


# How many averaging calls the stranger makes at once (each waits for the gate's next read
# of the members' bindings, at most a second away: one read serves them all).
CALLS_AT_ONCE = 50


def _binding_junk(member: NodeIdentity, stranger: str, others: list[bytes]) -> list[bytes]:
    """Malformed membership proofs, some claiming the stranger's peer id: raw bytes,
    damaged bindings a member signed for it, and `others` (signed by the wrong key, by
    another swarm's node, by a revoked one)."""
    genuine = member.bind_peer(stranger, time.time() + 600)
    found: list[bytes] = []
    damaged = st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)).map(
        lambda p: _damage(genuine, *p)
    )

    @FUZZ
    @given(st.one_of(st.binary(max_size=2048), damaged))
    def collect(data: bytes) -> None:
        found.append(data)

    collect()
    return [data for data in found if data != genuine] + others


def _averaging_junk() -> list[tuple[str, Any]]:
    """(call, request) pairs: junk join requests and all-reduce streams, state downloads,
    and oversized ones (a 1 MiB schema hash, a 4 MiB tensor part)."""
    blobs = st.binary(max_size=512)
    join = st.builds(
        averaging_pb2.JoinRequest,
        schema_hash=blobs, expiration=st.floats(), gather=blobs, client_mode=st.booleans(),
        group_key=st.text(max_size=64),
    )  # fmt: skip
    tensor = st.builds(
        runtime_pb2.Tensor,
        buffer=st.binary(max_size=4096), size=st.lists(st.integers(0, 2**32 - 1), max_size=4),
        dtype=st.text(st.characters(codec="ascii"), max_size=10), chunks=st.integers(0, 2**31 - 1),
    )  # fmt: skip
    part = st.builds(
        averaging_pb2.AveragingData,
        code=st.integers(0, 12), group_id=blobs, peer_id=blobs, tensor_part=tensor,
        weight=st.floats(),
    )  # fmt: skip
    calls = st.one_of(
        join.map(lambda r: ("join", r)),
        st.lists(part, max_size=3).map(lambda r: ("aggregate", r)),
        st.just(("download", averaging_pb2.DownloadRequest())),
    )
    found: list[tuple[str, Any]] = []

    @FUZZ
    @given(calls)
    def collect(call: tuple[str, Any]) -> None:
        found.append(call)

    collect()
    huge_part = averaging_pb2.AveragingData(
        group_id=b"g", tensor_part=runtime_pb2.Tensor(buffer=bytes(4 << 20), size=[1 << 20])
    )
    return [
        *found,
        ("join", averaging_pb2.JoinRequest(schema_hash=bytes(1 << 20), expiration=time.time())),
        ("aggregate", [huge_part]),
    ]


async def _stranger_throws(
    p2p: P2P, target: Any, namespaces: dict[str, str], calls: list[tuple[str, Any]]
) -> tuple[int, int]:
    """Each call from the stranger's own peer; returns (answered with anything but a
    refusal, cut short with an error before any answer)."""
    state = WholeStateAverager.get_stub(p2p, target, namespace=namespaces["state"])
    grads = ExactGradientAverager.get_stub(p2p, target, namespace=namespaces["grad"])

    async def one(call: str, request: Any) -> tuple[bool, bool]:
        try:
            if call == "download":
                stream = await state.rpc_download_state(request)
                return bool([m async for m in stream]), False
            if call == "join":
                stream = await grads.rpc_join_group(request)
                codes = [m.code async for m in stream]
                return codes != [averaging_pb2.NOT_LOOKING_FOR_GROUP], False

            async def parts() -> Any:
                for message in request:
                    yield message

            stream = await grads.rpc_aggregate_part(parts())
            codes = [m.code async for m in stream]
            return codes != [averaging_pb2.PROTOCOL_VIOLATION], False
        except Exception:  # noqa: BLE001  a stream cut on refusal, a message too big to send
            return False, True

    answered = errors = 0
    for start in range(0, len(calls), CALLS_AT_ONCE):
        batch = calls[start : start + CALLS_AT_ONCE]
        for accepted, failed in await asyncio.gather(*(one(*c) for c in batch)):
            answered += accepted
            errors += failed
    return answered, errors


@pytest.mark.timeout(300)
def test_averaging_handlers_refuse_junk_and_stay_up() -> None:
    """A trainer's averaging handlers (node/averagers.py `MembersOnly`) and the membership
    proofs its gate reads (peer bindings in the DHT). A member stores junk bindings, some
    claiming the stranger's peer id; then the stranger sends junk and oversized join
    requests, all-reduce parts and state downloads. Nothing is answered but a refusal, the
    averagers stay up, and a member still takes the trainer's state."""
    with LoneTrainer("fuzz-avg") as lone:
        a, run, root = lone.a, lone.run, lone.root
        member = NodeIdentity.self_issued(root, "trainer-m")
        revoked = NodeIdentity.self_issued(root, "trainer-r")
        assert Directory(a.dht, run).revoke(RootKey.from_swarm_keys(root).revoke("trainer-r"))
        calls = _averaging_junk()

        async def scenario() -> tuple[int, int]:
            p2p = await P2P.create(initial_peers=visible_maddrs(a.dht))
            try:
                stranger, expires = p2p.peer_id.to_base58(), time.time() + 600
                swapped = msgspec.msgpack.decode(member.bind_peer(stranger, expires))
                swapped["signature"] = revoked.sign(b"not this binding")
                others = [
                    msgspec.msgpack.encode(swapped),
                    NodeIdentity.self_issued(new_keys(), "outsider").bind_peer(stranger, expires),
                    revoked.bind_peer(stranger, expires),
                ]
                for i, data in enumerate(_binding_junk(member, stranger, others)):
                    key = members_key(run.run_id)
                    assert a.dht.store(key, data, get_dht_time() + 600, subkey=f"junk-{i}")
                return await _stranger_throws(p2p, a.dht.peer_id, namespaces(a), calls)
            finally:
                await p2p.shutdown()

        answered, errors = asyncio.run(scenario())
        alive = a.optimizer.grad_averager.is_alive() and a.optimizer.state_averager.is_alive()
        record_fuzz("averaging", len(calls), crashed=not alive)
        assert alive
        assert answered == 0
        refused = sum(a.refusals().values())
        assert refused >= len(calls) - errors >= len(calls) // 2
        lone.member_takes_state()
