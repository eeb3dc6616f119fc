"""A tiny request/reply transport over ZeroMQ (asyncio), with counted rejection of bad input.

    Client (DEALER, one request in flight) ──frames──▶ Server (ROUTER) ──(peer, msg)──▶ role loop
                                         ◀── reply ──                  ◀── reply(peer, msg) ──

The server never raises on input: a message that is oversized or does not decode is
counted in `Server.rejected`, answered with `protocol.Error`, and the loop goes on.
The client follows ZeroMQ's "lazy pirate" pattern: a request that gets no reply in time
closes the socket and opens a fresh one, so a restarted server is reached again and a
late reply can never be taken for the answer to a newer request.

With the swarm's keys (agentjet/keys.py) both ends speak CURVE: encrypted, and the
server's ZAP handler admits only clients that present the swarm's public key (CURVE alone
admits any client key). A handshake that fails (wrong key, no keys, not ZeroMQ) never
reaches the role: the client hears nothing (PeerUnavailable), the server counts it in
`Server.denied` and logs it at most every DENIED_LOG_EVERY_S. Without keys (tests, or
`net.insecure`) the sockets are plaintext.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from agentjet import protocol
from agentjet.config import NetConfig
from agentjet.errors import ProtocolError
from agentjet.keys import SwarmKeys

log = logging.getLogger(__name__)

# ZeroMQ itself drops (disconnects) frames above this multiple of the configured limit, so
# a hostile peer cannot make us allocate without bound; between 1x and this, we count and
# answer with an error.
HARD_LIMIT_FACTOR = 2
# A peer without the keys may retry many times a second: log the count at most this often.
DENIED_LOG_EVERY_S = 60.0
# Where libzmq asks for the verdict on each handshake (RFC 27), one handler per context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class PeerUnavailable(TimeoutError):
    """The server did not answer in time; the request may be retried later."""


class Server:
    """A bound ROUTER socket that yields decoded requests and sends replies.

    With `keys` it is a CURVE server that admits only clients holding the swarm's keys.
    """

    def __init__(
        self,
        endpoint: str,
        decoder: msgspec.msgpack.Decoder[Any],
        max_message_bytes: int,
        keys: SwarmKeys | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        # A ZAP handler serves a whole context: a secured server gets a context of its own.
        self._own_context = keys is not None and context is None
        if context is None:
            context = zmq.asyncio.Context() if keys is not None else zmq.asyncio.Context.instance()
        self.context = context
        self.decoder = decoder
        self.max_message_bytes = max_message_bytes
        self.keys = keys
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, HARD_LIMIT_FACTOR * max_message_bytes)
        self.poller = zmq.asyncio.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.zap: zmq.asyncio.Socket | None = None  # handshake verdicts (with keys)
        self.monitor: zmq.asyncio.Socket | None = None  # failed handshakes (with keys)
        if keys is not None:
            # The handler is bound before the socket: libzmq admits every client while none is.
            self.zap = self.context.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind(ZAP_ENDPOINT)
            self.poller.register(self.zap, zmq.POLLIN)
            self.monitor = self.socket.get_monitor_socket(HANDSHAKE_FAILED)
            self.poller.register(self.monitor, zmq.POLLIN)
            keys.secure_server(self.socket)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.rejected = 0
        self.denied = 0
        self._denied_logged = 0
        self._denied_logged_at = -DENIED_LOG_EVERY_S

    async def recv(self) -> tuple[list[bytes], Any]:
        """Next well-formed request as (routing envelope, message); bad ones are answered here.

        Handshake verdicts and failures are handled here too, so they need a caller waiting
        in recv(); a handshake simply waits until one is.
        """
        while True:
            ready = dict(await self.poller.poll())
            if self.zap is not None and self.zap in ready:
                await self._answer_zap(self.zap)
            if self.monitor is not None and self.monitor in ready:
                await self._count_denied(self.monitor)
            if self.socket not in ready:
                continue
            frames = await self.socket.recv_multipart(copy=True)
            envelope, payload = frames[:-1], frames[-1]
            if not envelope:
                self.rejected += 1
                continue
            if len(payload) > self.max_message_bytes:
                await self._reject(envelope, f"message of {len(payload)} bytes is over the limit")
                continue
            try:
                return envelope, self.decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await self._reject(envelope, f"cannot decode message: {e}")

    async def reply(self, envelope: list[bytes], msg: msgspec.Struct) -> None:
        await self.socket.send_multipart([*envelope, protocol.encode(msg)])

    async def _reject(self, envelope: list[bytes], reason: str) -> None:
        self.rejected += 1
        log.warning("rejected a message: %s", reason[:200])
        await self.reply(envelope, protocol.Error(code="decode", message=reason[:500]))

    async def _answer_zap(self, zap: zmq.asyncio.Socket) -> None:
        """Admit a CURVE client only if it presents the swarm's public key."""
        assert self.keys is not None
        (
            version,
            request_id,
            _domain,
            _address,
            _identity,
            mechanism,
            *credentials,
        ) = await zap.recv_multipart()
        admitted = mechanism == b"CURVE" and credentials == [self.keys.public_raw]
        status = (b"200", b"OK") if admitted else (b"400", b"not a key of this swarm")
        await zap.send_multipart([version, request_id, *status, b"", b""])

    async def _count_denied(self, monitor: zmq.asyncio.Socket) -> None:
        event = parse_monitor_message(await monitor.recv_multipart())
        self.denied += 1
        now = time.monotonic()
        if now - self._denied_logged_at >= DENIED_LOG_EVERY_S:
            log.warning(
                "%s: refused %d connection attempts without this swarm's keys (latest: %s)",
                self.endpoint,
                self.denied - self._denied_logged,
                _handshake_failure(event),
            )
            self._denied_logged, self._denied_logged_at = self.denied, now

    def close(self) -> None:
        for socket in (self.monitor, self.zap, self.socket):
            if socket is not None:
                socket.close(linger=0)
        if self._own_context:
            self.context.term()


def _handshake_failure(event: Mapping[str, object]) -> str:
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "a client key that is not the swarm's"
    if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "a client without keys"
    if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "a client with other keys"
    return "a broken or abandoned handshake"


class Client:
    """A DEALER socket with one request in flight, a timeout and reconnect on timeout.

    The first request on every fresh socket is the `Hello` handshake; a server that speaks
    another protocol version raises ProtocolError (not retryable). With `keys` every fresh
    socket is a CURVE client of a server holding the same keys.
    """

    def __init__(
        self,
        endpoint: str,
        decoder: msgspec.msgpack.Decoder[Any],
        hello: protocol.Hello,
        max_message_bytes: int,
        timeout_s: float,
        keys: SwarmKeys | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.context = context or zmq.asyncio.Context.instance()
        self.keys = keys
        self.endpoint = endpoint
        self.decoder = decoder
        self.hello = hello
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.welcome: protocol.Welcome | None = None
        self._lock = asyncio.Lock()
        self._socket: zmq.asyncio.Socket | None = None

    async def request(self, msg: msgspec.Struct, timeout_s: float | None = None) -> Any:
        async with self._lock:
            if self._socket is None:
                self._socket = self._connect()
                self.welcome = None
            if self.welcome is None:
                reply = await self._roundtrip(self.hello, timeout_s)
                if isinstance(reply, protocol.Error):
                    raise ProtocolError(f"{self.endpoint} refused the handshake: {reply.message}")
                if not isinstance(reply, protocol.Welcome):
                    raise ProtocolError(f"{self.endpoint} answered Hello with {type(reply)}")
                self.welcome = reply
            return await self._roundtrip(msg, timeout_s)

    async def _roundtrip(self, msg: msgspec.Struct, timeout_s: float | None) -> Any:
        assert self._socket is not None
        await self._socket.send(protocol.encode(msg))
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not await self._socket.poll(int(timeout * 1000), zmq.POLLIN):  # type: ignore[call-arg]
            self._reset()
            raise PeerUnavailable(f"no reply from {self.endpoint} within {timeout:.1f} s")
        payload = await self._socket.recv()
        try:
            return self.decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._reset()
            raise ProtocolError(f"undecodable reply from {self.endpoint}: {e}") from None

    def _connect(self) -> zmq.asyncio.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_LIMIT_FACTOR * self.max_message_bytes)
        if self.keys is not None:
            self.keys.secure_client(sock)
        sock.connect(self.endpoint)
        return sock

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
        self._socket = None

    def close(self) -> None:
        self._reset()


def outsider_client(
    endpoint: str,
    role: Literal["coordinator", "trainer"],
    keys: SwarmKeys | None,
    timeout_s: float,
    name: str,
) -> Client:
    """A client that only looks (`agentjet status`, the dashboard): it says Hello as role
    "client", so the coordinator counts it as no node of the swarm."""
    decoder: msgspec.msgpack.Decoder[Any] = (
        protocol.coordinator_reply_decoder
        if role == "coordinator"
        else protocol.trainer_reply_decoder
    )
    hello = protocol.Hello(node_id=f"{name}-{os.getpid()}", role="client")
    return Client(
        endpoint,
        decoder,
        hello,
        NetConfig().max_message_bytes,
        timeout_s,
        keys,
    )
