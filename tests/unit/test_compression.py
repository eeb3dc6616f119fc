"""swarm.grad_compression's formats (node/swarm.py COMPRESSIONS) on the wire and back, as
a gradient round's reducer sends them (node/allreduce.py reads the 8-bit ones)."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

from node.swarm import COMPRESSIONS

pytestmark = pytest.mark.unit

# Relative error ‖restored - g‖ / ‖g‖ of one rounding of normal values, and of the same with
# one value in 5,000 twenty times larger (gradients have such outliers): the 8-bit formats
# clip or lump outliers (measured 0.017 / 0.027 without, 0.21 / 0.22 with), which is what
# they cost a round's average.
BOUNDS = {
    "none": (0.0, 0.0),
    "fp16": (1e-3, 1e-3),
    "uint8": (0.025, 0.25),
    "quantile8": (0.035, 0.25),
}


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_each_format_gives_back_what_it_was_sent_within_its_bound(
    name: str, outliers: bool
) -> None:
    generator = torch.Generator().manual_seed(3)
    grads = torch.randn(200_000, generator=generator) * 1e-3
    if outliers:
        grads[::5000] *= 20
    compression = COMPRESSIONS[name]()
    wire = serialize_torch_tensor(grads, compression.compression_type)
    restored = deserialize_torch_tensor(wire)
    assert restored.shape == grads.shape and restored.dtype == torch.float32
    error = float((restored - grads).norm() / grads.norm())
    assert error <= BOUNDS[name][outliers]
    # what it costs on the wire, per value
    bits = 8 * len(wire.buffer) / grads.numel()
    assert bits <= {"none": 32, "fp16": 16, "uint8": 8.1, "quantile8": 8.1}[name]


def test_8bit_formats_read_back_a_tensor_of_any_shape_and_dtype() -> None:
    grads = torch.randn(3, 5, 7).to(torch.bfloat16)
    for name in ("uint8", "quantile8"):
        compression = COMPRESSIONS[name]()
        wire = serialize_torch_tensor(grads, compression.compression_type)
        restored = deserialize_torch_tensor(wire)
        assert restored.shape == (3, 5, 7) and restored.dtype == torch.bfloat16
        assert float((restored.float() - grads.float()).abs().max()) < 0.5
