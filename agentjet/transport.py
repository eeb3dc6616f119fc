"""A tiny request/reply transport over ZeroMQ (asyncio), with counted rejection of bad input.

    Client (DEALER, one request in flight) ──frames──▶ Server (ROUTER) ──(peer, msg)──▶ role loop
                                         ◀── reply ──                  ◀── reply(peer, msg) ──

The server never raises on input: a message that is oversized or does not decode is
counted in `Server.rejected`, answered with `protocol.Error`, and the loop goes on.
The client follows ZeroMQ's "lazy pirate" pattern: a request that gets no reply in time
closes the socket and opens a fresh one, so a restarted server is reached again and a
late reply can never be taken for the answer to a newer request.

With keys (agentjet/identity.py `NodeKeys`) both ends speak CURVE, encrypted: the server
holds the swarm's server key, which a client must know to complete a handshake, and each
client its own node key. A handshake that fails (no keys, not this swarm's server key, not
ZeroMQ) never reaches the role: the client hears nothing (PeerUnavailable), the server
counts it in `Server.denied`. Both kinds of bad input are logged as they come and then at
most every REPEATED_LOG_EVERY_S with their count (agentjet/logs.py), so the lines add up
to the counters `agentjet status` shows.

Which node a client is, the server learns from its certificate, checked here before any
request reaches the role (`Server._refusal`): the client's Hello carries its certificate,
which must be the swarm root's, current, not revoked, for the very CURVE key of the
connection (libzmq hands it over with each message, as the ZAP handler's user id) and for
the node id the Hello names. Every later request on that key must come from a certificate
still valid and name no other node (`protocol.claimed_node_id`). A refusal is answered
with Error(code="denied") and counted by kind in the membership (`refused`); the Client
raises NotAMember on it. Without keys (tests, or `net.insecure`) the sockets are plaintext.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

from agentjet import protocol
from agentjet.config import NetConfig
from agentjet.errors import ProtocolError
from agentjet.identity import Certificate, NodeKeys, encode_certificate
from agentjet.logs import RepeatedLog

log = logging.getLogger(__name__)

# ZeroMQ itself drops (disconnects) frames above this multiple of the configured limit, so
# a hostile peer cannot make us allocate without bound; between 1x and this, we count and
# answer with an error.
HARD_LIMIT_FACTOR = 2
# Where libzmq asks for the verdict on each handshake (RFC 27), one handler per context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class PeerUnavailable(TimeoutError):
    """The server did not answer in time; the request may be retried later."""


# A server's refusal of a request on a connection that has said no Hello (a server
# restarted behind a client's socket knows none): the client says Hello again.
HELLO_FIRST = "say Hello with this node's certificate first"


class NotAMember(ProtocolError):
    """The server refused this node as no member of the swarm (Error code "denied")."""


class Server:
    """A bound ROUTER socket that yields decoded requests and sends replies.

    With `keys` it is a CURVE server of the swarm that serves only its members.
    """

    def __init__(
        self,
        endpoint: str,
        decoder: msgspec.msgpack.Decoder[Any],
        max_message_bytes: int,
        keys: NodeKeys | None = None,
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
        # Client CURVE key (Z85) -> the certificate its Hello presented, once admitted.
        self.members: dict[bytes, Certificate] = {}
        # A peer may send junk, or retry without the keys, many times a second.
        at = self.endpoint.replace("{", "{{").replace("}", "}}")  # (the lines are templates)
        self._rejected_log = RepeatedLog(
            log,
            at + ": rejected a message: {detail}",
            at + ": rejected {count} more messages in the last {seconds:.0f} s; the last: {detail}",
        )
        self._denied_log = RepeatedLog(
            log,
            at + ": refused a connection without this swarm's keys ({detail})",
            at + ": refused {count} more connections without this swarm's keys in the last "
            "{seconds:.0f} s (the last: {detail})",
        )

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
            frames = await self.socket.recv_multipart(copy=False)
            envelope, last = [frame.bytes for frame in frames[:-1]], frames[-1]
            payload = last.bytes
            if not envelope:
                self.rejected += 1
                continue
            if len(payload) > self.max_message_bytes:
                await self._reject(envelope, f"message of {len(payload)} bytes is over the limit")
                continue
            try:
                msg = self.decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await self._reject(envelope, f"cannot decode message: {e}")
                continue
            if self.keys is not None:
                refusal = self._refusal(str(last.get("User-Id")).encode(), msg)
                if refusal is not None:
                    await self.reply(envelope, protocol.Error(code="denied", message=refusal))
                    continue
            return envelope, msg

    def _refusal(self, client_key: bytes, msg: msgspec.Struct) -> str | None:
        """Why this request is refused as not a member's (counted), or None to serve it."""
        assert self.keys is not None
        membership = self.keys.membership
        if isinstance(msg, protocol.Hello):
            if msg.protocol_version != protocol.PROTOCOL_VERSION:
                return None  # the role answers that the versions differ
            verdict = membership.verdict(msg.certificate)
            if not isinstance(verdict, Certificate):
                return f"this node's certificate is {verdict}"
            if verdict.curve_public.encode() != client_key or verdict.name != msg.node_id:
                membership.refuse(
                    "impersonation",
                    f"a Hello as {msg.node_id!r} with the certificate of {verdict.name!r}",
                )
                return "the certificate is not this connection's and node id's"
            self.members[client_key] = verdict
            return None
        certificate = self.members.get(client_key)
        if certificate is None:
            membership.refuse("anonymous", "a request before a Hello with a certificate")
            return HELLO_FIRST
        refused = membership.refusal(certificate, time.time())
        if refused is not None:
            membership.refuse(*refused)
            return f"this node's certificate is {refused[0]}"
        claimed = protocol.claimed_node_id(msg)
        if claimed is not None and claimed != certificate.name:
            membership.refuse("impersonation", f"{certificate.name!r} sending as {claimed[:100]!r}")
            return f"this connection is {certificate.name!r}, not {claimed[:100]!r}"
        return None

    @property
    def refused(self) -> dict[str, int]:
        """Requests refused as not a member's, by kind (agentjet/identity.py `Refusal`)."""
        if self.keys is None:
            return {}
        return {str(kind): n for kind, n in self.keys.membership.refused.items()}

    def refusals(self) -> dict[str, int]:
        """What a node's directory record lists it refused (`NodeRecord.refused`): requests
        by kind and handshakes without the swarm's keys, those that happened only."""
        return {k: n for k, n in (*self.refused.items(), ("handshakes", self.denied)) if n}

    async def reply(self, envelope: list[bytes], msg: msgspec.Struct) -> None:
        # Not copied again into libzmq's message (a weight chunk is megabytes): the socket
        # keeps the encoded bytes until they are sent.
        await self.socket.send_multipart([*envelope, protocol.encode(msg)], copy=False)

    async def _reject(self, envelope: list[bytes], reason: str) -> None:
        self.rejected += 1
        self._rejected_log.note(reason[:200])
        await self.reply(envelope, protocol.Error(code="decode", message=reason[:500]))

    async def _answer_zap(self, zap: zmq.asyncio.Socket) -> None:
        """Admit any CURVE client (it knew the swarm's server key), with its key as user id:
        which node it is, its Hello's certificate says (`_refusal`)."""
        (
            version,
            request_id,
            _domain,
            _address,
            _identity,
            mechanism,
            *credentials,
        ) = await zap.recv_multipart()
        if mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
            user_id = zmq.utils.z85.encode(credentials[0])
            await zap.send_multipart([version, request_id, b"200", b"OK", user_id, b""])
        else:
            await zap.send_multipart([version, request_id, b"400", b"CURVE only", b"", b""])

    async def _count_denied(self, monitor: zmq.asyncio.Socket) -> None:
        event = parse_monitor_message(await monitor.recv_multipart())
        self.denied += 1
        self._denied_log.note(_handshake_failure(event))

    def close(self) -> None:
        self._rejected_log.flush()
        self._denied_log.flush()
        for socket in (self.monitor, self.zap, self.socket):
            if socket is not None:
                socket.close(linger=0)
        if self._own_context:
            self.context.term()


def _handshake_failure(event: Mapping[str, object]) -> str:
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "a client that is not CURVE"
    if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "a client without keys"
    if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "a client that does not know this swarm's server key"
    return "a broken or abandoned handshake"


class Client:
    """A DEALER socket with one request in flight (several with `pipelined`), a timeout and
    reconnect on timeout.

    The first request on every fresh socket is the `Hello` handshake; a server that speaks
    another protocol version raises ProtocolError (not retryable). With `keys` every fresh
    socket is a CURVE client of the swarm with this node's key, and the Hello carries its
    certificate; a server that refuses it raises NotAMember.
    """

    def __init__(
        self,
        endpoint: str,
        decoder: msgspec.msgpack.Decoder[Any],
        hello: protocol.Hello,
        max_message_bytes: int,
        timeout_s: float,
        keys: NodeKeys | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.context = context or zmq.asyncio.Context.instance()
        self.keys = keys
        self.endpoint = endpoint
        self.decoder = decoder
        if keys is not None:
            certificate = encode_certificate(keys.identity.certificate)
            hello = msgspec.structs.replace(hello, certificate=certificate)
        self.hello = hello
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.welcome: protocol.Welcome | None = None
        self._lock = asyncio.Lock()
        self._socket: zmq.asyncio.Socket | None = None

    async def request(self, msg: msgspec.Struct, timeout_s: float | None = None) -> Any:
        async with self._lock:
            await self._handshake(timeout_s)
            await self._send(msg)
            reply = await self._receive(timeout_s)
            if _denied(reply) and reply.message == HELLO_FIRST:
                # A server restarted on the same endpoint behind this socket (ZMQ reconnects
                # by itself) knows no Hello from it and refuses every request (seen in the
                # fault suite: a rollout node stopped on its restarted coordinator's refusal).
                # A fresh socket says Hello again (once).
                self._reset()
                await self._handshake(timeout_s)
                await self._send(msg)
                reply = await self._receive(timeout_s)
            return self._checked(msg, reply)

    async def pipelined(
        self, msgs: Sequence[msgspec.Struct], window: int, timeout_s: float | None = None
    ) -> AsyncIterator[Any]:
        """The replies to `msgs`, in order, with up to `window` requests in flight (a server
        answers one client's requests in the order they came): the server sends the next
        reply while this side handles the last. Replies still due when the caller stops
        early are left behind with the socket (the next request opens a fresh one)."""
        async with self._lock:
            await self._handshake(timeout_s)
            sent = received = 0
            try:
                while received < len(msgs):
                    while sent < len(msgs) and sent - received < window:
                        await self._send(msgs[sent])
                        sent += 1
                    reply = self._checked(msgs[received], await self._receive(timeout_s))
                    received += 1
                    yield reply
            finally:
                if received < sent:
                    self._reset()

    async def handshake(self, timeout_s: float | None = None) -> None:
        """Connect and say Hello now (a request does it too, when needed)."""
        async with self._lock:
            await self._handshake(timeout_s)

    async def _handshake(self, timeout_s: float | None) -> None:
        if self._socket is None:
            self._socket = self._connect()
            self.welcome = None
        if self.welcome is None:
            await self._send(self.hello)
            reply = await self._receive(timeout_s)
            if isinstance(reply, protocol.Error):
                raise _refused(self.endpoint, "the handshake", reply)
            if not isinstance(reply, protocol.Welcome):
                raise ProtocolError(f"{self.endpoint} answered Hello with {type(reply)}")
            self.welcome = reply

    def _checked(self, msg: msgspec.Struct, reply: Any) -> Any:
        if _denied(reply):
            raise _refused(self.endpoint, type(msg).__name__, reply)
        return reply

    async def _send(self, msg: msgspec.Struct) -> None:
        assert self._socket is not None
        await self._socket.send(protocol.encode(msg))

    async def _receive(self, timeout_s: float | None) -> Any:
        assert self._socket is not None
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not await self._socket.poll(int(timeout * 1000), zmq.POLLIN):  # type: ignore[call-arg]
            self._reset()
            raise PeerUnavailable(f"no reply from {self.endpoint} within {timeout:.1f} s")
        frame = await self._socket.recv(copy=False)
        try:
            return self.decoder.decode(frame.buffer)  # a weight chunk's data stays in it
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


def _denied(reply: Any) -> bool:
    return isinstance(reply, protocol.Error) and reply.code == "denied"


def _refused(endpoint: str, what: str, error: protocol.Error) -> ProtocolError:
    if error.code == "denied":
        return NotAMember(f"{endpoint} refused {what}: not a member of its swarm ({error.message})")
    return ProtocolError(f"{endpoint} refused {what}: {error.message}")


def outsider_client(
    endpoint: str,
    role: Literal["coordinator", "trainer"],
    keys: NodeKeys | None,
    timeout_s: float,
    name: str,
) -> Client:
    """A client that only looks (`agentjet status`, the dashboard): it says Hello as role
    "client", so the coordinator counts it as no node of the swarm. With keys its node id
    is its certificate's name."""
    decoder: msgspec.msgpack.Decoder[Any] = (
        protocol.coordinator_reply_decoder
        if role == "coordinator"
        else protocol.trainer_reply_decoder
    )
    node_id = keys.name if keys is not None else f"{name}-{os.getpid()}"
    hello = protocol.Hello(node_id=node_id, role="client")
    return Client(
        endpoint,
        decoder,
        hello,
        NetConfig().max_message_bytes,
        timeout_s,
        keys,
    )
