"""node/weights.py across processes: another process on the trainer's host maps a version
and reads it without a copy of its own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from agentjet import protocol
from node.publisher import Publisher
from node.weights import from_safetensors, frozen_safetensors
from tests import procs
from tests.unit.test_weights import frozen_version

pytestmark = pytest.mark.integration


MAP_AND_MEASURE = """
import ctypes, sys
import msgspec
from agentjet import protocol
from node.weights import WeightAssembly
info = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=protocol.PolicyInfo)
assembly = WeightAssembly.mapped(info)
total = float(assembly.finish()["w"].sum())
address = ctypes.addressof(ctypes.c_char.from_buffer(assembly.blob))
inside, seen = False, {}
for row in open("/proc/self/smaps").read().splitlines():
    head = row.split()[0]
    if "-" in head and not head.endswith(":"):
        low, high = (int(x, 16) for x in head.split("-"))
        inside = low <= address < high
    elif inside and head in ("Rss:", "Pss:", "Private_Dirty:"):
        seen[head] = int(row.split()[1])
print(total, seen["Rss:"], seen["Pss:"], seen["Private_Dirty:"])
"""


def test_a_mapped_version_is_in_memory_once_for_the_trainer_and_the_node() -> None:
    """Another process maps the version and reads all of it: the pages it reads are the
    trainer's (its share of them is half: two processes map them), none its own copy."""
    snap = frozen_version({"w": torch.randn(16, 1024, 1024)}, seal=False)  # 64 MB
    info = Publisher(snap, "run").info(protocol.Lineage())
    out = procs.run(
        [sys.executable, "-c", MAP_AND_MEASURE],
        input=msgspec.msgpack.encode(info),
        capture_output=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()
    total, rss, pss, private = float(out[0]), int(out[1]), int(out[2]), int(out[3])
    assert total == pytest.approx(
        float(from_safetensors(bytearray(snap.stored))["w"].sum()), rel=1e-5
    )
    assert rss >= 64 * 1024  # all of it read
    assert pss <= rss * 0.55 and private == 0  # shared with this process, not copied


class ForkingTensors(dict):
    """Tensors whose every walk forks a child that lives until the test lets it go: a
    trainer's hivemind averagers fork whenever a trainer joins, while a version may be
    being written in a thread."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.release_read, self.release_write = os.pipe()
        self.children: list[int] = []

    def items(self):  # type: ignore[override]
        pid = os.fork()
        if pid == 0:
            try:
                os.close(self.release_write)  # else no child would ever read the end
                os.read(self.release_read, 1)
            finally:
                os._exit(0)
        self.children.append(pid)
        return super().items()

    def release(self) -> None:
        os.close(self.release_write)
        os.close(self.release_read)
        for pid in self.children:
            assert os.waitpid(pid, 0)[1] == 0


def test_a_process_forked_while_a_version_is_written_does_not_stop_it_being_frozen() -> None:
    tensors = ForkingTensors({"a": torch.randn(40, 100), "b": torch.randn(3, 7)})
    try:
        blob, fd = frozen_safetensors(tensors, {"policy_version": "3"}, torch.bfloat16)
    finally:
        tensors.release()
    assert len(tensors.children) == 2  # forked while laid out and while written
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    os.close(fd)
    state = from_safetensors(bytearray(blob))
    assert all(torch.equal(state[k], t.to(torch.bfloat16)) for k, t in tensors.items())
