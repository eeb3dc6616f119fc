"""Exact all-reduce: every peer of a hivemind averaging round ends with the same bits.

    each part of the tensors ──sent to its reducer peer──▶ weighted average
        ──▶ rounded once, as it goes on the wire (the reducer's compression)
        ──▶ every peer copies that value in, the reducer included

hivemind's AllReduceRunner returns to each peer the *difference* between the average and
the peer's own part, and the peer adds it back: `own + (mean - own)`. In floating point
that is exactly the mean only when `own` and `mean` are close (within a factor of two).
Parameters of trainers in step are; gradients of different samples are not. So each
trainer ended a gradient round with its own rounding of the average gradient, and after
the optimizer step the trainers' weights at one version could differ by an ulp
(bench/LOG.md, "same version, same weights"). With fp16 compression the difference
itself travels as fp16 and is added to the peer's float32 value, so the peers' averages
differed by fp16 rounding.

Here the reducer of a part replies with the average itself, and keeps for itself the same
value as it would arrive on the wire. A part whose reducer fails keeps the peer's own
values, as hivemind's zero delta does, and hivemind still reports the round a success
(it only logs "received N% results"). Then this peer's tensors are no average, and its
step would differ from its peers' at the same version, so the round's result says so
(`RoundResult.missing`), for the caller to treat as a failed round. A stock hivemind
peer, which would add the average to its own tensor as if it were a difference, never
joins these rounds: hivemind names its RPC handlers after the averager's class, and
these classes are agentjet's.

A peer that stops sending midway is left out by each reducer from where it stopped
(hivemind "bans" it), so its tensors can be in some parts of the average and not in
others, with every other peer none the wiser. Here each reducer's reply carries the part's
total weight (the sum of the weights of the senders in it); a peer that sees two parts
with different totals knows the average is not of one set of peers (`RoundResult.partial`),
and every peer that got the whole average sees the same totals. A gradient round is then
all or nothing: the trainers treat a partial round as failed (node/optimizer.py).

A round's result also names the peers whose whole tensors, with a weight above zero, are
in this peer's average (`RoundResult.contributors`): a trainer vouches for those peers'
gradients (node/directory.py, "trained" marks).
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.quantization import Quantization
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor, as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time


class RoundResult(dict):  # type: ignore[type-arg]
    """A round's gathered data (peer -> what it sent with its join request), and:
    `missing`: the share of the average that never came (a reducer failed this peer; those
    parts hold its own values); `partial`: the parts came, but not all of the same peers
    (a sender stopped midway at some reducer); `contributors`: the other peers whose
    tensors are all in this peer's average with a weight above zero
    (`complete_contributors`)."""

    def __init__(
        self,
        gathered: dict[Any, Any],
        missing: float,
        contributors: frozenset[Any],
        partial: bool = False,
    ) -> None:
        super().__init__(gathered)
        self.missing = missing
        self.contributors = contributors
        self.partial = partial

    def __reduce__(self) -> tuple[Any, ...]:  # crosses from the averager's process
        return RoundResult, (dict(self), self.missing, self.contributors, self.partial)


def _extract_quantized(self: Quantization, serialized: Any) -> torch.Tensor:
    """hivemind 1.1.12's 8-bit formats (uniform, quantile), read back: an int64 codebook
    size, the float32 codebook, a uint8 index per value. hivemind's own reader calls
    `int()` on a one-element array, which NumPy 2 refuses ("only 0-dimensional arrays can
    be converted"), so every round with swarm.grad_compression "uint8" or "quantile8"
    failed. Installed over `Quantization.extract` when this module is imported, before any
    averager process is forked."""
    buffer = serialized.buffer
    (size,) = struct.unpack_from("<q", buffer)
    codebook = torch.frombuffer(bytearray(buffer[8 : 8 + 4 * size]), dtype=torch.float32)
    indices = torch.frombuffer(bytearray(buffer[8 + 4 * size :]), dtype=torch.uint8)
    values = codebook.to(getattr(torch, serialized.dtype))[indices.long()]
    return values.reshape(tuple(serialized.size)).requires_grad_(serialized.requires_grad)


Quantization.extract = _extract_quantized


def incomplete(result: object) -> bool:
    """Whether an averaging round's result says this peer did not get the whole average."""
    return isinstance(result, RoundResult) and result.missing > 0


def uneven(part_weights: Sequence[float]) -> bool:
    """Whether the total weights of an average's parts differ: not every part averaged the
    same peers. Weights are sample counts in a trainer, so totals of one set are equal;
    the tolerance only covers other weights summed in another order."""
    return bool(part_weights) and not math.isclose(
        min(part_weights), max(part_weights), rel_tol=1e-9
    )


def complete_contributors(
    weights: dict[Any, float], banned: set[Any], some_reducer_failed: bool, partial: bool = False
) -> frozenset[Any]:
    """The peers whose whole tensors are in this peer's average: `weights` holds the weight
    each other peer sent with its parts to this peer's reducer. hivemind finishes a round
    without a peer that stops sending (`banned`: averaged without it from where it
    stopped), and a peer that tags along sends weight zero. After a failed reducer this
    peer holds its own values for that reducer's parts, and in a partial round some
    reducer left a sender out: no other peer is surely all in."""
    if some_reducer_failed or partial:
        return frozenset()
    return frozenset(p for p, w in weights.items() if w > 0 and p not in banned)


class _WeighingReducer(TensorPartReducer):  # type: ignore[misc]
    """hivemind's reducer, keeping each finished part's total weight (`part_weights`, in
    part order): the sum of the weights of the senders averaged into it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.part_weights: list[float] = []
        super().__init__(*args, **kwargs)

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from == self.num_current_senders:
            self.part_weights.append(self.denominator)
        super().check_current_part_finished()


class _RepliesWeighed:
    """A peer's stub whose `rpc_aggregate_part` replies pass through `seen`, which keeps
    their weights (the reducer's part totals)."""

    def __init__(self, stub: Any, seen: list[float]) -> None:
        self._stub = stub
        self._seen = seen

    async def rpc_aggregate_part(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        stream = await self._stub.rpc_aggregate_part(*args, **kwargs)

        async def weighed() -> AsyncIterator[Any]:
            async for message in stream:
                if message.code == averaging_pb2.AVERAGED_PART:
                    self._seen.append(message.weight)
                yield message

        return weighed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


class ExactAllReduceRunner(AllReduceRunner):  # type: ignore[misc]
    """An AllReduceRunner whose outputs are averages, not differences from the average."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        container = self.tensor_part_container
        # A failed reducer's parts are then the peer's own values, not zeros.
        container.return_deltas = False
        # How averages travel; a reducer rounds every reply, and its own copy, this one way.
        self.wire = container.compression.compression_type
        # The weight each other peer sent with its parts to this peer's reducer.
        self.sender_weights: dict[PeerID, float] = {}
        # Replaced before the round runs: the same reducer, keeping each part's total weight.
        reducer: Any = self.tensor_part_reducer
        self.tensor_part_reducer: _WeighingReducer = _WeighingReducer(
            reducer.part_shapes, reducer.num_senders
        )
        reducer.finished.set()  # never used: else it warns, when collected, that nothing came
        # The total weight of every part that came back from other peers' reducers.
        self.reply_weights: list[float] = []

    def part_weights(self) -> list[float]:
        """The total weight of each part of this peer's average that came so far, this
        peer's own reducer's included."""
        return [*self.tensor_part_reducer.part_weights, *self.reply_weights]

    def _get_peer_stub(self, peer: PeerID) -> Any:
        return _RepliesWeighed(super()._get_peer_stub(peer), self.reply_weights)

    def _as_sent(self, average: torch.Tensor) -> Any:
        return serialize_torch_tensor(average, self.wire)

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        if peer_id != self.peer_id:
            # A remote reducer: its replies are averages now (see _accumulate_parts_streaming).
            await super()._communicate_with_peer(peer_id)
            return
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, part in enumerate(self.parts_for_local_averaging):
            average = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part, weight=self.weight
            )
            self.tensor_part_container.register_processed_part(
                peer_index, part_index, deserialize_torch_tensor(self._as_sent(average))
            )

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Serve one sender: add each of its parts to the average, reply with the average."""
        loop = asyncio.get_event_loop()
        received = 0
        try:
            async for part, weight in amap_in_executor(
                lambda message: (deserialize_torch_tensor(message.tensor_part), message.weight),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                self.sender_weights[self.sender_peer_ids[sender_index]] = weight
                try:
                    average = await self.tensor_part_reducer.accumulate_part(
                        sender_index, received, part, weight=weight
                    )
                except BannedException:
                    break  # the sender was too slow and is out of the round
                total_weight = self.tensor_part_reducer.part_weights[received]
                received += 1
                reply = await loop.run_in_executor(None, self._as_sent, average)
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=reply, weight=total_weight
                )
        finally:
            if received != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class ExactAverager(DecentralizedAverager):  # type: ignore[misc]
    """A DecentralizedAverager whose rounds use ExactAllReduceRunner and copy the average
    into the averaged tensors (hivemind adds a difference to them), and whose results are
    `RoundResult`s."""

    runner_type: type[ExactAllReduceRunner] = ExactAllReduceRunner  # a test may send faults

    async def _aggregate_with_group(self, group_info: GroupInfo, **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, **kwargs)
        # The group stays registered (with its runner) until this returns.
        runner = self._running_groups[group_info.group_id].result()
        container = runner.tensor_part_container
        partial = uneven(runner.part_weights())
        contributors = complete_contributors(
            runner.sender_weights, set(runner.banned_senders), container.failed_size > 0, partial
        )
        missing = container.failed_size / container.total_size
        return RoundResult(gathered, missing, contributors, partial)

    async def _run_allreduce_inplace_(
        self,
        tensors: Sequence[torch.Tensor],
        group_info: GroupInfo,
        group_id: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        if self._averaging_alpha != 1.0:
            raise ValueError("an exact average replaces the tensors: averaging_alpha must be 1")
        group_id = group_info.group_id if group_id is None else group_id
        runner = self.runner_type(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("an auxiliary peer received averaged tensors")
            return
        async for tensor, average in azip(as_aiter(*tensors), runner):
            tensor.copy_(average)
            self.last_updated = get_dht_time()
            self._state_updated.set()
