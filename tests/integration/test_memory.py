"""node/memory.py with a forked child: one forked in `left_behind()` does not hold the
parent's tensors, and shared zeros are shared with it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from node import memory
from tests.unit.test_memory import pss_kb

pytestmark = pytest.mark.integration


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
