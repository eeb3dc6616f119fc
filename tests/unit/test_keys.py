"""The swarm's keys: the key file, the refusal to run without it, and CURVE on real sockets.

The transport tests run a real ZMQ server and clients in this process on loopback: a
member is served; a client without keys or with another swarm's hears nothing, and the
server counts each refused handshake; a client that knows the swarm's server key but holds
no valid certificate (forged, expired, revoked, another node's, none) is answered
"denied", and each refusal is counted by kind.
"""

from __future__ import annotations

import asyncio
import stat
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from agentjet import protocol
from agentjet.config import NetConfig, load_config
from agentjet.errors import ConfigError
from agentjet.identity import (
    Membership,
    NodeIdentity,
    NodeKeys,
    RootKey,
    node_keys,
    server_keys,
    write_node_keys,
)
from agentjet.keys import NO_KEYS, SwarmKeys, new_keys, read_keys, write_keys
from agentjet.transport import Client, NotAMember, PeerUnavailable, Server
from agentjet_app.cli import main

pytestmark = pytest.mark.unit

MAX_MESSAGE_BYTES = 1 << 16
# A request on loopback is answered in milliseconds; a refused one waits this long.
REPLY_TIMEOUT_S = 1.0
POLICY = protocol.PolicyInfo(version=0, nbytes=0, sha256="", num_chunks=0)


def test_keys_file_is_private_and_reads_back(tmp_path: Path):
    path = tmp_path / "swarm.keys"
    made = write_keys(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_keys(path) == made
    assert zmq.curve_public(made.secret) == made.public


def test_keys_init_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "swarm.keys"
    assert main(["keys", "init", "--out", str(path)]) == 0
    assert f"--keys {path}" in capsys.readouterr().out
    before = path.read_bytes()
    assert main(["keys", "init", "--out", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} already exists" in err
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\xff\xfe binary", "is not a keys file"),
        (b"public = ", "is not a keys file"),
        (b'public = "abc"\nsecret = "def"\n', "lacks a valid public and secret key"),
        (b'public = "' + b"~" * 40 + b'"\nsecret = "' + b"#" * 40 + b'"\n', "lacks a valid"),
        (b"secret = 7\n", "lacks a valid public and secret key"),
    ],
)
def test_garbled_keys_file_is_one_clear_error(tmp_path: Path, content: bytes, message: str):
    path = tmp_path / "swarm.keys"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as e:
        read_keys(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_keys_file_whose_halves_do_not_match_is_refused(tmp_path: Path):
    path = tmp_path / "swarm.keys"
    a, b = new_keys(), new_keys()
    path.write_text(f'public = "{a.public.decode()}"\nsecret = "{b.secret.decode()}"\n')
    with pytest.raises(ConfigError, match="does not belong to the secret"):
        read_keys(path)


def test_no_keys_is_refused_unless_insecure_is_chosen(keys_file: Path):
    with pytest.raises(ConfigError) as e:
        node_keys(NetConfig(), "trainer-1")
    assert str(e.value) == NO_KEYS
    assert node_keys(NetConfig(insecure=True), "trainer-1") is None
    keys = node_keys(NetConfig(keys=str(keys_file)), "trainer-1")
    assert keys is not None and keys.name == "trainer-1"  # the root file certifies the node
    assert keys.server == server_keys(read_keys(keys_file))
    with pytest.raises(ConfigError, match="net.insecure: net.keys is set too"):
        load_config(None, [f'net.keys="{keys_file}"', "net.insecure=true"])


@pytest.mark.parametrize(
    "argv",
    [["node", "--role", "trainer"], ["node", "--role", "rollout"], ["coordinator"]],
)
def test_nodes_without_keys_refuse_to_start(argv: list[str], capsys: pytest.CaptureFixture[str]):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"agentjet: error: {NO_KEYS}\n"


def test_status_without_keys_is_refused(capsys: pytest.CaptureFixture[str]):
    assert main(["status", "--coordinator", "tcp://127.0.0.1:1"]) == 2
    assert "agentjet keys init" in capsys.readouterr().err


def test_nodes_with_a_bad_keys_file_name_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    garbled = tmp_path / "garbled.keys"
    garbled.write_text("nonsense")
    assert main(["coordinator", "--keys", str(garbled)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(garbled) in err


# ── CURVE and certificates on real sockets ──────────────────────────────────────────────


@asynccontextmanager
async def serving(
    keys: NodeKeys | None,
    endpoint: str = "tcp://127.0.0.1:0",
    decoder: msgspec.msgpack.Decoder[Any] = protocol.trainer_request_decoder,
    answer_with: msgspec.Struct = POLICY,
) -> AsyncIterator[Server]:
    """A server that answers Hello with Welcome and anything else with `answer_with`."""
    server = Server(endpoint, decoder, MAX_MESSAGE_BYTES, keys)

    async def answer() -> None:
        while True:
            envelope, msg = await server.recv()
            hello = isinstance(msg, protocol.Hello)
            reply = protocol.answer_hello(msg, "test") if hello else answer_with
            await server.reply(envelope, reply)

    task = asyncio.create_task(answer())
    try:
        yield server
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()


def client(endpoint: str, keys: NodeKeys | None, node_id: str = "") -> Client:
    name = node_id or (keys.name if keys is not None else "test")
    hello = protocol.Hello(node_id=name, role="rollout")
    return Client(
        endpoint, protocol.trainer_reply_decoder, hello, MAX_MESSAGE_BYTES, REPLY_TIMEOUT_S, keys
    )


async def served(endpoint: str, keys: NodeKeys | None, node_id: str = "") -> bool:
    """Whether a client with `keys` is answered; NotAMember propagates."""
    peer = client(endpoint, keys, node_id)
    try:
        return isinstance(await peer.request(protocol.PolicyQuery()), protocol.PolicyInfo)
    except PeerUnavailable:
        return False
    finally:
        peer.close()


@pytest.fixture
def swarm() -> SwarmKeys:
    return new_keys()


def member(root: SwarmKeys, name: str) -> NodeKeys:
    return NodeKeys.from_root(root, name)


def test_members_are_served_and_strangers_hear_nothing(swarm: SwarmKeys):
    other_swarm = new_keys()

    async def scenario() -> None:
        async with serving(member(swarm, "trainer-1")) as server:
            assert await served(server.endpoint, member(swarm, "rollout-a"))
            assert server.denied == 0
            # No keys, or another swarm's: the handshake fails, the role never hears of it.
            for keys in (None, member(other_swarm, "rollout-a")):
                denied_before = server.denied
                assert not await served(server.endpoint, keys)
                assert server.denied > denied_before
            assert await served(server.endpoint, member(swarm, "rollout-a"))
            assert sum(server.keys.membership.refused.values()) == 0  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_a_node_with_its_own_key_file_is_served(tmp_path: Path, swarm: SwarmKeys):
    """`agentjet keys issue`: a node that holds only its own file, not the root."""
    root_file, node_file = tmp_path / "swarm.keys", tmp_path / "box-7.keys"
    root_file.write_text(
        f'public = "{swarm.public.decode()}"\nsecret = "{swarm.secret.decode()}"\n'
    )
    write_node_keys(
        node_file, NodeIdentity.new(RootKey.from_swarm_keys(swarm), "box-7"), server_keys(swarm)
    )
    node = node_keys(NetConfig(keys=str(node_file)), name="ignored")
    assert node is not None and node.name == "box-7"
    assert node.identity.curve != swarm and node.server == server_keys(swarm)

    async def scenario() -> None:
        async with serving(node_keys(NetConfig(keys=str(root_file)), "trainer-1")) as server:
            assert await served(server.endpoint, node)

    asyncio.run(scenario())


def test_refusals_are_answered_denied_and_counted_by_kind(swarm: SwarmKeys):
    """Peers that know the swarm's server key complete the CURVE handshake: their
    certificates decide, and each refusal is one NotAMember for them, one count here."""
    root = RootKey.from_swarm_keys(swarm)
    server_keys_ = server_keys(swarm)
    forger = RootKey.from_swarm_keys(new_keys())

    def holding(identity: NodeIdentity) -> NodeKeys:
        return NodeKeys(identity, server_keys_, Membership(root.public))

    async def refused_as(endpoint: str, keys: NodeKeys, node_id: str = "") -> str:
        with pytest.raises(NotAMember) as e:
            await served(endpoint, keys, node_id)
        return str(e.value)

    async def scenario() -> None:
        async with serving(member(swarm, "trainer-1")) as server:
            refused = server.keys.membership.refused  # type: ignore[union-attr]
            # a certificate another root signed
            await refused_as(server.endpoint, holding(NodeIdentity.new(forger, "rollout-a")))
            assert refused == {"forged": 1}
            # one that expired
            old = NodeIdentity.new(root, "rollout-old", days=1, now=time.time() - 2 * 86400)
            assert "expired" in await refused_as(server.endpoint, holding(old))
            assert refused["expired"] == 1
            # a Hello in another node's name
            mallory = member(swarm, "mallory")
            await refused_as(server.endpoint, mallory, node_id="trainer-2")
            assert refused["impersonation"] == 1
            # a member's certificate presented with another key (a copied certificate)
            alice = member(swarm, "alice")
            copied = NodeIdentity(
                mallory.identity.curve, mallory.identity.signing, alice.identity.certificate
            )
            await refused_as(server.endpoint, holding(copied))
            assert refused["impersonation"] == 2
            # revoked: refused from its next request on, and nobody else is
            assert await served(server.endpoint, alice)
            bob = member(swarm, "bob")
            server.keys.membership.revoke(root.revoke("alice"))  # type: ignore[union-attr]
            assert "revoked" in await refused_as(server.endpoint, alice)
            assert await served(server.endpoint, bob)
            assert refused["revoked"] == 1
            # a request before any Hello, from a member that never presented its certificate
            with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
                sock.setsockopt(zmq.LINGER, 0)
                member(swarm, "carol").secure_client(sock)
                sock.connect(server.endpoint)
                sock.send(protocol.encode(protocol.PolicyQuery()))
                assert await asyncio.to_thread(sock.poll, int(REPLY_TIMEOUT_S * 1000) * 5)
                reply = protocol.trainer_reply_decoder.decode(sock.recv())
            assert isinstance(reply, protocol.Error) and reply.code == "denied"
            assert refused["anonymous"] == 1
            assert refused == {
                "forged": 1,
                "expired": 1,
                "impersonation": 2,
                "revoked": 1,
                "anonymous": 1,
            }
            assert await served(server.endpoint, bob)  # members are served after all that

    asyncio.run(scenario())


def test_a_request_naming_another_node_is_refused(swarm: SwarmKeys):
    """After a valid Hello, a node's requests must name it: no reporting as another."""

    async def scenario() -> None:
        decoder = protocol.coordinator_request_decoder
        coordinator = member(swarm, "coordinator")
        async with serving(coordinator, decoder=decoder, answer_with=protocol.Ok()) as server:
            keys = member(swarm, "rollout-a")
            hello = protocol.Hello(node_id=keys.name, role="rollout")
            peer = Client(
                server.endpoint, protocol.coordinator_reply_decoder, hello, MAX_MESSAGE_BYTES,
                REPLY_TIMEOUT_S, keys,
            )  # fmt: skip
            try:
                ok = await peer.request(protocol.Heartbeat(node_id="rollout-a", role="rollout"))
                assert isinstance(ok, protocol.Ok)
                with pytest.raises(NotAMember, match="not 'rollout-b'"):
                    await peer.request(protocol.Heartbeat(node_id="rollout-b", role="rollout"))
            finally:
                peer.close()
            assert server.keys.membership.refused == {"impersonation": 1}  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_curve_without_a_zap_handler_admits_any_client_key_and_names_none(swarm: SwarmKeys):
    """Why the server runs a ZAP handler: libzmq's CURVE alone accepts every client key and
    tells the server none of them; the handler names each (the user id) for its certificate."""
    stranger = new_keys()
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as server, ctx.socket(zmq.DEALER) as peer:
        server.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.LINGER, 0)
        swarm.secure_server(server)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        stranger.secure_client(peer)
        peer.curve_serverkey = swarm.public
        peer.connect(f"tcp://127.0.0.1:{port}")
        peer.send(b"hello")
        assert server.poll(int(REPLY_TIMEOUT_S * 1000) * 5), "the stranger was not admitted"
        frames = server.recv_multipart(copy=False)
        assert frames[-1].bytes == b"hello"
        with pytest.raises(zmq.ZMQError):  # no user id: nothing to bind a certificate to
            frames[-1].get("User-Id")


def test_client_reconnects_with_curve_after_a_timeout(tmp_path: Path, swarm: SwarmKeys):
    endpoint = f"ipc://{tmp_path}/server.ipc"
    keys = member(swarm, "rollout-a")

    async def scenario() -> None:
        peer = client(endpoint, keys)
        with pytest.raises(PeerUnavailable):  # nobody listens yet
            await peer.request(protocol.PolicyQuery())
        async with serving(member(swarm, "trainer-1"), endpoint) as server:
            assert isinstance(await peer.request(protocol.PolicyQuery()), protocol.PolicyInfo)
            assert server.denied == 0
        with pytest.raises(PeerUnavailable):  # the server went away
            await peer.request(protocol.PolicyQuery())
        async with serving(member(swarm, "trainer-1"), endpoint):  # back: a fresh handshake
            assert isinstance(await peer.request(protocol.PolicyQuery()), protocol.PolicyInfo)
        peer.close()

    asyncio.run(scenario())


def test_a_client_says_hello_again_to_a_server_restarted_behind_its_socket(
    tmp_path: Path, swarm: SwarmKeys
):
    """ZMQ reconnects a client's socket by itself to a server restarted on the same
    endpoint, which knows no Hello from it and refuses its next request: the client says
    Hello again and is served (a rollout node stopped on its restarted coordinator's
    refusal, in the fault suite)."""
    endpoint = f"ipc://{tmp_path}/server.ipc"
    keys = member(swarm, "rollout-a")

    async def scenario() -> None:
        peer = client(endpoint, keys)
        async with serving(member(swarm, "trainer-1"), endpoint):
            assert isinstance(await peer.request(protocol.PolicyQuery()), protocol.PolicyInfo)
        async with serving(member(swarm, "trainer-1"), endpoint) as server:  # restarted
            assert isinstance(await peer.request(protocol.PolicyQuery()), protocol.PolicyInfo)
            # (the request on the reconnected socket came before any Hello: refused once)
            assert server.keys.membership.refused == {"anonymous": 1}  # type: ignore[union-attr]
        peer.close()

    asyncio.run(scenario())


def test_dht_tokens_are_node_certificates(swarm: SwarmKeys):
    """The swarm's DHT admits a peer whose token carries a current certificate of this root,
    signed by that node: not another swarm's, not one changed in flight, not a revoked one."""
    from node.dht import SwarmAuthorizer

    alice, bob = SwarmAuthorizer(member(swarm, "alice")), SwarmAuthorizer(member(swarm, "bob"))
    stranger = SwarmAuthorizer(member(new_keys(), "alice"))

    async def tokens() -> tuple[Any, Any]:
        return await alice.get_token(), await stranger.get_token()

    token, foreign = asyncio.run(tokens())
    assert bob.is_token_valid(token) and alice.is_token_valid(token)
    assert not bob.is_token_valid(foreign)
    for field, value in (
        ("public_key", b"another RSA key"),
        ("expiration_time", "2999-01-01T00:00:00+00:00"),
        ("username", "bm90IGEgY2VydGlmaWNhdGU="),
        ("signature", b"\0" * 64),
    ):
        changed = type(token)()
        changed.CopyFrom(token)
        setattr(changed, field, value)
        assert not bob.is_token_valid(changed), field
    bob.membership.revoke(RootKey.from_swarm_keys(swarm).revoke("alice"))
    assert not bob.is_token_valid(token)
    assert bob.membership.refused == {"forged": 2, "revoked": 1}
