"""Real hivemind averagers (each with its own DHT and p2pd) average one tensor.

hivemind's own all-reduce leaves each peer with `own + (mean - own)`, rounded its own way;
node/allreduce.py makes every peer end with the reducer's average, bit for bit. This is
what "same version, same weights" across trainers rests on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
)
from hivemind.compression.quantization import Quantization

from node.allreduce import ExactAllReduceRunner, ExactAverager, incomplete

pytestmark = pytest.mark.integration

SIZE = 50_000


def peer_tensors(peers: int = 2) -> list[torch.Tensor]:
    """Far-apart tensors, as trainers' gradients of different samples are: values of both
    signs, spread over several orders of magnitude."""
    generator = torch.Generator().manual_seed(7)

    def draw() -> torch.Tensor:
        return torch.randn(SIZE, generator=generator)

    return [draw() * torch.exp(3 * draw()) for _ in range(peers)]


class PeerWithFaultyReducer(ExactAverager):
    """An exact averager whose reducer refuses every part sent to it when `faulty`."""

    def __init__(self, *args: Any, faulty: bool = False, **kwargs: Any) -> None:
        self.faulty = faulty  # set before hivemind starts the averager's process
        super().__init__(*args, **kwargs)

    async def rpc_aggregate_part(self, stream: Any, context: Any) -> AsyncIterator[Any]:
        if self.faulty:
            raise RuntimeError("this peer's reducer fails")
        async for message in super().rpc_aggregate_part(stream, context):
            yield message


class SenderThatStops(ExactAllReduceRunner):
    """Sends its first part to the first other peer's reducer, then stops (as a peer whose
    link is cut mid-round); every other reducer gets all its parts."""

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        first_other = next(i for i, p in enumerate(self.ordered_peer_ids) if p != self.peer_id)
        sent = 0
        async for message in super()._generate_input_for_peer(peer_index):
            if peer_index == first_other and sent == 1:
                return
            yield message
            sent += 1


class PeerThatMayStopSending(ExactAverager):
    """An exact averager whose rounds use `SenderThatStops` when `stops`. (All peers of a
    round must be of one class: hivemind names its RPC handlers after it.)"""

    def __init__(self, *args: Any, stops: bool = False, **kwargs: Any) -> None:
        self.runner_type = SenderThatStops if stops else ExactAllReduceRunner
        super().__init__(*args, **kwargs)


def average_once(
    averager_type: type,
    compression: CompressionBase,
    peer_kwargs: Sequence[dict] = ({}, {}),
    weights: Sequence[float] | None = None,
    silent_sender_s: float = 30.0,
) -> tuple[list[torch.Tensor], list[Any], list[Any]]:
    """One averaging round of `len(peer_kwargs)` peers; each peer's tensor afterwards, its
    result, and its peer id. A reducer leaves out a sender silent for `silent_sender_s`:
    long by default, so that a busy box (CI once stalled a sender past 3 s) does not cut a
    healthy round short; the tests of a failed reducer and of a sender that stops, whose
    rounds wait it out, set it short."""
    peers = len(peer_kwargs)
    dhts = [hivemind.DHT(start=True)]
    for _ in range(peers - 1):
        dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True))
    averagers = []
    try:
        for dht, tensor, kwargs in zip(dhts, peer_tensors(peers), peer_kwargs, strict=True):
            averagers.append(
                averager_type(
                    **kwargs,
                    averaged_tensors=[tensor],
                    dht=dht,
                    prefix="exact_test",
                    target_group_size=peers,
                    min_matchmaking_time=2.0,
                    request_timeout=1.0,
                    next_chunk_timeout=silent_sender_s,
                    compression=compression,
                    # Many parts, so that each peer reduces some and receives the others.
                    part_size_bytes=1 << 14,
                    start=True,
                )
            )
        controls = [
            averager.step(weight=weight, wait=False)
            for averager, weight in zip(averagers, weights or [1.0] * peers, strict=True)
        ]
        outcomes = [control.result(timeout=60) for control in controls]
        assert all(outcome is not None for outcome in outcomes), "the peers formed no round"
        assert all(len(outcome) == peers for outcome in outcomes), "not all peers in one round"
        results = []
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                results.append(tensor.clone())
        return results, outcomes, [averager.peer_id for averager in averagers]
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()


@pytest.mark.parametrize(
    "compression",
    [NoCompression(), Float16Compression(), Uniform8BitQuantization(), Quantile8BitQuantization()],
    ids=["float32", "fp16", "uint8", "quantile8"],
)
def test_both_peers_end_a_round_with_the_same_bits(compression: CompressionBase) -> None:
    (first, second), outcomes, peers = average_once(ExactAverager, compression)
    # (a reducer that timed out leaves a peer its own values, and says so: a failed round)
    assert not any(incomplete(outcome) for outcome in outcomes)
    assert torch.equal(first, second)
    # each peer vouches that the other's whole tensor is in its average
    assert [outcome.contributors for outcome in outcomes] == [{peers[1]}, {peers[0]}]
    a, b = peer_tensors()
    mean = (a + b) / 2
    if isinstance(compression, NoCompression):
        assert torch.allclose(first, mean, rtol=1e-6, atol=0)
    elif isinstance(compression, Quantization):
        # 8 bits a value, rounded twice (each sender's part, then the reducer's average),
        # of values spread over orders of magnitude: far from the mean (tests/unit/
        # test_compression.py measures gradient-like values), but one rounding for all.
        assert not torch.equal(first, mean)
    else:
        # fp16 on the wire, where fp16 can hold the values: each input and the mean are
        # rounded once to 11 significant bits.
        held = (a.abs() < 6e4) & (b.abs() < 6e4)
        bound = ((a.abs() + b.abs()) / 2 + mean.abs()) * 2.0**-11 + 1e-7
        assert ((first - mean).abs() <= bound)[held].all()


def test_hivemind_alone_leaves_the_peers_with_different_roundings() -> None:
    """Why node/allreduce.py exists: on the same inputs, stock hivemind's peers disagree,
    by float rounding of the inputs (measured: 6,592 of 50,000 values; with fp16 on the
    wire, 49,994 of them, by up to 72% of the inputs' size)."""
    (first, second), _, _ = average_once(DecentralizedAverager, NoCompression())
    assert not torch.equal(first, second)
    a, b = peer_tensors()
    assert ((first - second).abs() <= (a.abs() + b.abs()) * 2.0**-23).all()


def test_a_peer_that_a_reducer_failed_is_told_its_round_is_incomplete() -> None:
    """hivemind ends a round as a success when a reducer fails, leaving the parts it should
    have averaged at the peer's own values; a trainer stepping on that would differ from
    the others at the same version. The peer's result says so instead."""
    (healthy, faulty), (told_healthy, _), _ = average_once(
        PeerWithFaultyReducer, NoCompression(), ({}, {"faulty": True}), silent_sender_s=3.0
    )
    # (The faulty peer may be told too: the healthy one, its own outputs complete, can
    # stop serving it before the last averages reach it.)
    assert incomplete(told_healthy) and 0 < told_healthy.missing < 1
    assert told_healthy.contributors == set()  # it can vouch for no one
    assert not torch.equal(healthy, faulty)
    own, _ = peer_tensors()
    # The share the faulty reducer held is the healthy peer's own input, untouched.
    assert (healthy == own).float().mean().item() >= told_healthy.missing


def test_a_peer_that_tags_along_with_weight_zero_is_no_contributor() -> None:
    """hivemind joins a scheduled gradient round with weight zero once it has thrown its
    gradients away; the other peer must not vouch for them."""
    (first, second), outcomes, peers = average_once(
        ExactAverager, NoCompression(), weights=(1.0, 0.0)
    )
    assert torch.equal(first, second)
    own, _ = peer_tensors()
    assert torch.equal(first, own)  # the average of one weighted tensor
    assert [outcome.contributors for outcome in outcomes] == [set(), {peers[0]}]


def test_a_sender_that_stops_midway_makes_the_round_partial_for_every_peer() -> None:
    """Three peers; one stops sending to one reducer after a part. hivemind averages that
    reducer's later parts without it and calls the round a success, so the others' averages
    hold its tensor in some parts only. The third peer's own reducer got all of it: only
    the parts' total weights, which every reply carries, tell it. Both are told the round
    is partial and vouch for no one; the peer that stopped is told its round is incomplete."""
    (first, second, _), outcomes, _ = average_once(
        PeerThatMayStopSending,
        NoCompression(),
        peer_kwargs=({}, {}, {"stops": True}),
        silent_sender_s=3.0,
    )
    for outcome in outcomes[:2]:
        assert outcome.partial and not incomplete(outcome)
        assert outcome.contributors == set()
    assert incomplete(outcomes[2])
    assert torch.equal(first, second)  # partial, but the same parts for both


def test_a_round_every_sender_finishes_is_whole() -> None:
    """The same three peers without the fault: one set of peers in every part."""
    _, outcomes, peers = average_once(ExactAverager, NoCompression(), peer_kwargs=({}, {}, {}))
    for outcome, peer in zip(outcomes, peers, strict=True):
        assert not outcome.partial and not incomplete(outcome)
        assert outcome.contributors == set(peers) - {peer}
