"""A tiny request/reply transport over ZeroMQ (asyncio), with counted rejection of bad input.

    Client (DEALER, one request in flight) ──frames──▶ Server (ROUTER) ──(peer, msg)──▶ role loop
                                         ◀── reply ──                  ◀── reply(peer, msg) ──

The server never raises on input: a message that is oversized or does not decode is
counted in `Server.rejected`, answered with `protocol.Error`, and the loop goes on.
The client follows ZeroMQ's "lazy pirate" pattern: a request that gets no reply in time
closes the socket and opens a fresh one, so a restarted server is reached again and a
late reply can never be taken for the answer to a newer request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from agentjet import protocol
from agentjet.errors import ProtocolError

log = logging.getLogger(__name__)

# ZeroMQ itself drops (disconnects) frames above this multiple of the configured limit, so
# a hostile peer cannot make us allocate without bound; between 1x and this, we count and
# answer with an error.
HARD_LIMIT_FACTOR = 2


class PeerUnavailable(TimeoutError):
    """The server did not answer in time; the request may be retried later."""


class Server:
    """A bound ROUTER socket that yields decoded requests and sends replies."""

    def __init__(
        self,
        endpoint: str,
        decoder: msgspec.msgpack.Decoder[Any],
        max_message_bytes: int,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.context = context or zmq.asyncio.Context.instance()
        self.decoder = decoder
        self.max_message_bytes = max_message_bytes
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, HARD_LIMIT_FACTOR * max_message_bytes)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.rejected = 0

    async def recv(self) -> tuple[list[bytes], Any]:
        """Next well-formed request as (routing envelope, message); bad ones are answered here."""
        while True:
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

    def close(self) -> None:
        self.socket.close(linger=0)


class Client:
    """A DEALER socket with one request in flight, a timeout and reconnect on timeout.

    The first request on every fresh socket is the `Hello` handshake; a server that speaks
    another protocol version raises ProtocolError (not retryable).
    """

    def __init__(
        self,
        endpoint: str,
        decoder: msgspec.msgpack.Decoder[Any],
        hello: protocol.Hello,
        max_message_bytes: int,
        timeout_s: float,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.context = context or zmq.asyncio.Context.instance()
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
        sock.connect(self.endpoint)
        return sock

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
        self._socket = None

    def close(self) -> None:
        self._reset()
