"""A lone trainer's `SwarmOptimizer` (hivemind's DHT and averager processes underneath)
steps as AdamW does, writes none of hivemind's gradient buffers it need not, and steps as
its in-process twin, node/local_optimizer.py's `LocalOptimizer`, does: the unit tier steps
a `Learner` with that twin, so this keeps the twin from drifting from the real thing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from agentjet.config import SwarmConfig
from node.local_optimizer import LocalOptimizer
from node.rounds import StepOutcome
from node.swarm import SwarmOptimizer

pytestmark = pytest.mark.integration

PAGE_KB = 4


def lone_swarm(
    model: torch.nn.Module, target_batch_size: int, lr: float = 1e-3, weight_decay: float = 0.0
) -> SwarmOptimizer:
    """A one-peer hivemind optimizer of its own run (the same path as a swarm)."""
    return SwarmOptimizer(
        SwarmConfig(run_id=f"test-{time.monotonic_ns()}"),
        model.parameters(),
        lr=lr,
        weight_decay=weight_decay,
        target_batch_size=target_batch_size,
    )


def resident_kb(tensor: torch.Tensor) -> int:
    """The resident size of the mapping that holds `tensor`'s storage."""
    address = tensor.untyped_storage().data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_lone_trainer_steps_as_adamw_does_and_writes_no_gradient_buffer_of_hivemind():
    """Steps of a whole epoch each leave hivemind's accumulators and averaged gradients
    unwritten (their pages never exist); an epoch over two steps accumulates both."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 4))
    twin.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.0)
    for p in twin.parameters():  # hivemind makes Adam's state with a step on zeros
        p.grad = torch.zeros_like(p)
    plain.step()
    plain.zero_grad()

    def backward(batch: torch.Tensor) -> None:
        for m in (model, twin):
            m(batch).square().mean().backward()

    swarm = lone_swarm(model, target_batch_size=4)
    try:
        averager = swarm.optimizer.grad_averager
        for _ in range(3):
            backward(torch.randn(4, 256))
            plain.step()
            plain.zero_grad()
            assert swarm.step_outcome(batch_size=4).epoch == swarm.epoch
        assert swarm.epoch == 3
        assert all(
            torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
        )
        buffers = [*averager._local_accumulators, *averager._averaged_tensors]
        # none of their data written: at most one page each (the shared ones' refcount
        # header, where torch shares memory by file name, as hivemind sets it when imported
        # first); the largest is 1 MB
        assert all(resident_kb(t) <= PAGE_KB for t in buffers), [resident_kb(t) for t in buffers]

        # An epoch of 8 samples in two steps of 4: the first batch's gradients go into
        # the accumulators before `.grad` is cleared, and the step is on their mean.
        swarm.optimizer.tracker.target_batch_size = 8
        first, second = torch.randn(4, 256), torch.randn(4, 256)
        backward(first)
        assert swarm.step_outcome(batch_size=4).epoch == 3
        twin_grads = [p.grad.clone() for p in twin.parameters()]
        twin.zero_grad()
        backward(second)
        for p, g in zip(twin.parameters(), twin_grads, strict=True):
            p.grad = (g + p.grad) * 0.5
        plain.step()
        assert swarm.step_outcome(batch_size=4).epoch == 4
        assert all(
            torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
        )
        assert resident_kb(averager._local_accumulators[0]) > 0
    finally:
        swarm.shutdown()


def test_a_lone_swarm_optimizer_steps_as_the_local_one_does_bit_for_bit():
    """The same weights and the same gradients, through a one-peer `SwarmOptimizer` and a
    `LocalOptimizer`: the same outcome and the same weights after every call, over epochs
    of one batch and an epoch of two uneven ones, with weight decay (which hivemind's
    zero-gradient first step applies once), and calls with no backward before them (the
    learner's with only zero-advantage samples): the first on the zero `.grad`s hivemind
    leaves when it is made, a later one on none; at the learning rate each call names
    (trainer.lr_decay_versions), lr 0 moving nothing."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
    twin.load_state_dict(model.state_dict())
    lr, weight_decay, epoch_samples = 3e-3, 0.1, 6
    swarm = lone_swarm(model, epoch_samples, lr=lr, weight_decay=weight_decay)
    local = LocalOptimizer(
        twin.parameters(), lr=lr, weight_decay=weight_decay, target_batch_size=epoch_samples
    )

    def same_weights() -> bool:
        pairs = zip(model.parameters(), twin.parameters(), strict=True)
        return all(torch.equal(a, b) for a, b in pairs)

    def outcomes(size: int, backward: bool, rate: float | None) -> tuple[StepOutcome, ...]:
        batch = torch.randn(size, 64)
        for m in (model, twin):
            if backward:
                m(batch).square().mean().backward()
        return swarm.step_outcome(size, rate), local.step_outcome(size, rate)

    try:
        assert same_weights(), "both made Adam's state with a step on zero gradients"
        # (samples, a backward before, lr): an epoch with none, whole epochs, one with
        # none, an epoch of a batch of 2 and one of 4 (with none), a whole one again, one
        # at lr 0
        calls = [
            (6, False, None),
            (6, True, None),
            (6, True, lr / 2),
            (6, False, lr / 3),
            (2, True, lr / 4),
            (4, False, lr / 4),
            (6, True, lr / 5),
            (6, True, 0.0),
        ]
        for size, backward, rate in calls:
            before = [p.detach().clone() for p in model.parameters()]
            by_swarm, by_local = outcomes(size, backward, rate)
            assert by_swarm == by_local, (size, backward, rate)
            assert same_weights(), (size, backward, rate)
            assert all(p.grad is None for p in (*model.parameters(), *twin.parameters()))
            pairs = zip(model.parameters(), before, strict=True)
            if rate == 0.0:
                assert all(torch.equal(a, b) for a, b in pairs), "a step at lr 0 moves nothing"
        assert (swarm.epoch, local.epoch) == (7, 7)
    finally:
        swarm.shutdown()
