"""A trainer's sockets as node/trainer.py serves policy versions, without CURVE and without
a trainer: PolicyQuery and chunks on its own socket; with `seal`, sealed chunks for the
version's ticket on a second one (node/publisher.py); `publish` serves a next version,
with its delta from the one before (node/delta.py). For tests of the fetching side."""

from __future__ import annotations

import asyncio

import torch

from agentjet import protocol
from agentjet.transport import Client, Server
from node.delta import delta_snapshot
from node.publisher import Publisher
from node.weights import chunked, to_safetensors

HOST = "tcp://127.0.0.1:*"


class VersionServer:
    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        version: int,
        chunk_bytes: int,
        max_message_bytes: int,
        seal: bool = False,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = chunk_bytes
        self.seal = seal
        snap = chunked(to_safetensors(tensors, {}), version, chunk_bytes, seal)
        self.server = Server(HOST, protocol.trainer_request_decoder, max_message_bytes)
        sealed = Server(HOST, protocol.trainer_request_decoder, max_message_bytes) if seal else None
        self.publisher = Publisher(snap, "run", sealed)
        self.publisher.announce(self.server.endpoint)
        self.served = 0  # chunks on its own socket
        self.queries = 0  # PolicyQuery requests answered
        self.tasks = [asyncio.create_task(self._serve())]
        if sealed is not None:
            self.tasks.append(asyncio.create_task(self.publisher.serve_sealed()))

    def publish(self, tensors: dict[str, torch.Tensor], version: int, delta: bool = True) -> None:
        """Serve `tensors` as `version`, with its delta from the version served so far
        (`delta`: when there is one to make)."""
        snap = chunked(to_safetensors(tensors, {}), version, self.chunk_bytes, self.seal)
        changes = delta_snapshot(self.publisher.published, snap) if delta else None
        self.publisher.publish(snap, changes)

    @property
    def chunks_sent(self) -> int:
        return self.served + self.publisher.sealed_served

    async def _serve(self) -> None:
        while True:
            envelope, msg = await self.server.recv()
            reply: protocol.TrainerReply
            match msg:
                case protocol.Hello():
                    reply = protocol.answer_hello(msg, "run")
                case protocol.PolicyQuery():
                    self.queries += 1
                    reply = self.publisher.info(protocol.Lineage(), msg.manifest)
                case protocol.WeightChunkRequest():
                    reply = self.publisher.chunk(msg)
                    self.served += isinstance(reply, protocol.WeightChunk)
                case _:
                    reply = protocol.Error(code="unknown", message="not here")
            await self.server.reply(envelope, reply)

    def client(self, name: str) -> Client:
        hello = protocol.Hello(node_id=name, role="rollout")
        return Client(
            self.server.endpoint,
            protocol.trainer_reply_decoder,
            hello,
            self.max_message_bytes,
            10.0,
        )

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.server.close()
        if self.publisher.sealed is not None:
            self.publisher.sealed.close()
