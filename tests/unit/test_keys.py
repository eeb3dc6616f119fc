"""The swarm's keys: the key file, the refusal to run without it, and CURVE on real sockets.

The transport tests run a real ZMQ server and clients in this process on loopback: a
client with the swarm's keys is served; one without keys, one with another keypair and one
that knows the swarm's public key but not its secret hear nothing, and the server counts
each refused handshake.
"""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import zmq

from agentjet import protocol
from agentjet.cli import main
from agentjet.config import NetConfig, load_config
from agentjet.errors import ConfigError
from agentjet.keys import NO_KEYS, SwarmKeys, new_keys, read_keys, swarm_keys, write_keys
from agentjet.transport import Client, PeerUnavailable, Server

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
        swarm_keys(NetConfig())
    assert str(e.value) == NO_KEYS
    assert swarm_keys(NetConfig(insecure=True)) is None
    assert swarm_keys(NetConfig(keys=str(keys_file))) == read_keys(keys_file)
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


# ── CURVE on real sockets ───────────────────────────────────────────────────────────────


@asynccontextmanager
async def serving(
    keys: SwarmKeys | None, endpoint: str = "tcp://127.0.0.1:0"
) -> AsyncIterator[Server]:
    """A trainer-protocol server that answers Hello with Welcome and anything else with POLICY."""
    server = Server(endpoint, protocol.trainer_request_decoder, MAX_MESSAGE_BYTES, keys)

    async def answer() -> None:
        while True:
            envelope, msg = await server.recv()
            hello = isinstance(msg, protocol.Hello)
            await server.reply(envelope, protocol.answer_hello(msg, "test") if hello else POLICY)

    task = asyncio.create_task(answer())
    try:
        yield server
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()


def client(endpoint: str, keys: SwarmKeys | None) -> Client:
    hello = protocol.Hello(node_id="test", role="rollout")
    return Client(
        endpoint, protocol.trainer_reply_decoder, hello, MAX_MESSAGE_BYTES, REPLY_TIMEOUT_S, keys
    )


async def refused(endpoint: str, keys: SwarmKeys | None) -> bool:
    peer = client(endpoint, keys)
    try:
        await peer.request(protocol.PolicyQuery())
    except PeerUnavailable:
        return True
    finally:
        peer.close()
    return False


def test_only_clients_with_the_swarm_keys_are_served():
    swarm, stranger = new_keys(), new_keys()

    async def scenario() -> None:
        async with serving(swarm) as server:
            member = client(server.endpoint, swarm)
            assert isinstance(await member.request(protocol.PolicyQuery()), protocol.PolicyInfo)
            assert server.denied == 0
            for keys in (None, stranger):
                denied_before = server.denied
                assert await refused(server.endpoint, keys)
                assert server.denied > denied_before
            # the refusal that needs the ZAP handler: a stranger who knows the swarm's public
            # key (it is no secret) completes a CURVE handshake with a key of its own
            denied_before = server.denied
            with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
                sock.setsockopt(zmq.LINGER, 0)
                stranger.secure_client(sock)
                sock.curve_serverkey = swarm.public
                sock.connect(server.endpoint)
                sock.send(protocol.encode(protocol.Hello(node_id="x", role="rollout")))
                assert not await asyncio.to_thread(sock.poll, int(REPLY_TIMEOUT_S * 1000))
            assert server.denied > denied_before
            # members are still served after all that
            assert isinstance(await member.request(protocol.PolicyQuery()), protocol.PolicyInfo)
            member.close()

    asyncio.run(scenario())


def test_curve_without_a_zap_handler_admits_any_client_key():
    """Why the server runs a ZAP handler: libzmq's CURVE alone accepts every client key."""
    swarm, stranger = new_keys(), new_keys()
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
        assert server.recv_multipart()[-1] == b"hello"


def test_client_reconnects_with_curve_after_a_timeout(tmp_path: Path):
    keys = new_keys()
    endpoint = f"ipc://{tmp_path}/server.ipc"

    async def scenario() -> None:
        peer = client(endpoint, keys)
        with pytest.raises(PeerUnavailable):  # nobody listens yet
            await peer.request(protocol.PolicyQuery())
        async with serving(keys, endpoint) as server:
            assert isinstance(await peer.request(protocol.PolicyQuery()), protocol.PolicyInfo)
            assert server.denied == 0
        with pytest.raises(PeerUnavailable):  # the server went away
            await peer.request(protocol.PolicyQuery())
        async with serving(keys, endpoint):  # and came back: a fresh handshake
            assert isinstance(await peer.request(protocol.PolicyQuery()), protocol.PolicyInfo)
        peer.close()

    asyncio.run(scenario())
