"""node/memory.py: which of a process's memory is private, and zeros that cost nothing until
written (with a forked child: tests/integration/test_memory.py)."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node import memory

pytestmark = pytest.mark.unit


@pytest.fixture
def shared_by_descriptor() -> Iterator[None]:
    """torch's own sharing strategy for the test: hivemind, once another test of the run has
    imported it, sets "file_system", under which sharing a tensor starts torch's
    torch_shm_manager process."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    yield
    torch.multiprocessing.set_sharing_strategy(before)


def test_ranges_are_whole_pages_inside_large_private_storages_only(
    shared_by_descriptor: None,
) -> None:
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
