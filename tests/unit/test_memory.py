"""node/memory.py: a child forked in `left_behind()` does not hold the parent's tensors."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from node import memory

pytestmark = pytest.mark.unit


def mapped(address: int) -> bool:
    """Whether `address` lies in a mapping of this process."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low <= address < high:
            return True
    return False


def in_child(probe: Callable[[], Any]) -> Any:
    """Fork, run `probe` in the child, return what it returned (as JSON); reaps the child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write, json.dumps(probe()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(answer)


def middle(tensor: torch.Tensor) -> int:
    return tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2


def test_a_child_forked_inside_the_block_has_no_copy_of_the_parents_tensor() -> None:
    weights = torch.full((8 << 20,), 3.0)  # 32 MiB, private to this process
    averaged = torch.full((1 << 20,), 5.0).share_memory_()
    with memory.left_behind():
        seen = in_child(lambda: [mapped(middle(weights)), float(averaged[7])])
    assert seen == [False, 5.0]  # shared memory still reaches the child
    # The parent keeps its tensor, and a later fork inherits it as usual.
    weights.add_(1)
    assert float(weights[12345]) == 4.0
    assert in_child(lambda: [mapped(middle(weights)), float(weights[12345])]) == [True, 4.0]


def test_ranges_are_whole_pages_inside_large_private_storages_only() -> None:
    large = torch.zeros(3 << 20, dtype=torch.uint8)[1:]  # a view: its storage counts once
    small = torch.zeros(1000)
    shared = torch.zeros(1 << 20).share_memory_()
    ranges = memory.private_ranges()
    base = large.untyped_storage().data_ptr()
    mine = [(a, n) for a, n in ranges if base <= a < base + (3 << 20)]
    assert len(mine) == 1
    address, length = mine[0]
    assert address % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
    assert base <= address and address + length <= base + (3 << 20)
    assert length >= (3 << 20) - 2 * mmap.PAGESIZE
    for tensor in (small, shared):
        start = tensor.untyped_storage().data_ptr()
        assert not any(a <= start + 8192 < a + n for a, n in ranges)


def pss_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise AssertionError("no Pss line")


def test_shared_zeros_cost_nothing_until_written_and_a_forked_child_sees_the_writes() -> None:
    like = torch.ones(64, 1024, 1024)  # 256 MB
    before = pss_kb()
    zeros = memory.shared_zeros(like)
    assert zeros.shape == like.shape and zeros.dtype == torch.float32 and zeros.is_shared()
    assert pss_kb() - before < 16 * 1024  # not 256 MB
    assert not zeros[::97].any()
    zeros[:8].fill_(2.0)  # 32 MB written: those pages exist now
    assert 24 * 1024 < pss_kb() - before < 64 * 1024
    # shared, as an averager's buffers must be: a forked child reads the parent's writes
    assert in_child(lambda: float(zeros[7, 5, 3])) == 2.0


def test_untouched_zeros_cost_nothing_until_written_and_are_each_their_own_tensor() -> None:
    likes = (torch.ones(32, 1024, 1024), torch.ones(3, 5, dtype=torch.bfloat16))  # 128 MB
    before = pss_kb()
    big, small = memory.untouched_zeros(likes)
    assert (big.shape, big.dtype, small.shape, small.dtype) == (
        likes[0].shape,
        torch.float32,
        likes[1].shape,
        torch.bfloat16,
    )
    assert pss_kb() - before < 16 * 1024  # not 128 MB
    assert not big[::97].any() and not small.any()
    big[:8].fill_(1.0)  # 32 MB written
    small.fill_(3.0)  # its own place: the big one's first bytes are untouched by it
    assert 24 * 1024 < pss_kb() - before < 64 * 1024
    assert float(big[0, 0, 0]) == 1.0 and float(big[8:].abs().sum()) == 0.0
    assert float(small.sum()) == 45.0
