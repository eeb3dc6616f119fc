"""`LocalSteps` (node/local_steps.py): H inner AdamW steps, then one outer step on their
pseudo-gradient, over the lone trainer's in-process optimizer (node/local_optimizer.py) with
the outer optimizer a trainer's swarm uses (`outer_optimizer`)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from agentjet.config_schema import SwarmConfig
from node.local_optimizer import LocalOptimizer
from node.local_steps import LocalSteps, outer_optimizer, with_local_steps

pytestmark = pytest.mark.unit

LR = 1e-2
CONFIG = SwarmConfig(local_steps=3, outer_lr=0.7, outer_momentum=0.9)


def model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def backward(net: torch.nn.Module, seed: int, optimizer: LocalSteps | None = None) -> None:
    """A batch's gradients, on the weights `optimizer` trains (as the learner's passes)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(5, 4, generator=generator)
    with optimizer.training() if optimizer else contextlib.nullcontext():
        net(inputs).pow(2).mean().backward()


def local_steps(net: torch.nn.Module, steps: int = 3) -> tuple[LocalSteps, LocalOptimizer]:
    params = list(net.parameters())
    make = outer_optimizer(CONFIG, LR, 0.0)
    outer = LocalOptimizer(params, lr=LR, weight_decay=0.0, target_batch_size=1, make=make)
    return LocalSteps(outer, params, lr=LR, weight_decay=0.0, steps=steps), outer


def test_h_inner_adamw_steps_then_one_nesterov_step_on_their_pseudo_gradient() -> None:
    """The inner steps at the learning rate each names (the learner's schedule), the outer
    one at swarm.outer_lr."""
    net, reference = model(), model()
    start = [p.detach().clone() for p in net.parameters()]
    optimizer, _ = local_steps(net)
    inner = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    for seed in range(3):
        backward(net, seed, optimizer)
        rate = LR / (1 + seed)
        inner.param_groups[0]["lr"] = rate
        outcome = optimizer.step_outcome(batch_size=5, lr=rate)
        assert outcome.applied == (seed == 2) and not outcome.discarded
        assert optimizer.epoch == (1 if seed == 2 else 0)
        if seed < 2:  # between batches the model holds the version's weights, not the inner
            assert all(
                torch.equal(p.detach(), b) for p, b in zip(net.parameters(), start, strict=True)
            )
            assert not torch.equal(optimizer.weights[0].detach(), start[0])
        backward(reference, seed)
        inner.step()
        inner.zero_grad()
    # The outer SGD's first step: momentum buffer = Δ, Nesterov: Δ + 0.9 Δ, times lr 0.7.
    for param, begin, moved in zip(net.parameters(), start, reference.parameters(), strict=True):
        delta = begin - moved.detach()
        assert torch.allclose(param.detach(), begin - 0.7 * 1.9 * delta, atol=1e-7)
    # The next inner steps start from the version's weights.
    assert all(
        torch.equal(a, p.detach()) for a, p in zip(optimizer.version, net.parameters(), strict=True)
    )


def test_the_samples_of_every_inner_step_count_toward_the_outer_step() -> None:
    net = model()
    optimizer, outer = local_steps(net, steps=2)
    outer.target_batch_size = 12  # the swarm's target: two inner batches of 5 fall short
    for seed in range(2):
        backward(net, seed, optimizer)
        assert not optimizer.step_outcome(batch_size=5).applied
    # kept for the next epoch, as hivemind keeps them: the weights are the version's again
    assert outer.epoch == 0 and optimizer.rounds == 1
    assert all(
        torch.equal(a, p.detach()) for a, p in zip(optimizer.version, net.parameters(), strict=True)
    )
    for seed in range(2, 4):
        backward(net, seed, optimizer)
        outcome = optimizer.step_outcome(batch_size=5)
    assert outcome.applied and outer.epoch == 1


def test_weights_replaced_between_inner_steps_carry_the_inner_steps_over() -> None:
    net = model()
    optimizer, outer = local_steps(net)
    backward(net, 0, optimizer)
    assert not optimizer.step_outcome(batch_size=5).discarded
    moved = [w.detach() - v for w, v in zip(optimizer.weights, optimizer.version, strict=True)]
    # a catch-up: the swarm's weights of a later version come in between two inner steps
    with torch.no_grad():
        for param in net.parameters():
            param.add_(1.0)
    outer._epoch = 4
    swarm = [p.detach().clone() for p in net.parameters()]
    with optimizer.training():  # the inner step so far, moved onto the swarm's weights
        assert all(
            torch.allclose(p.detach(), s + m, atol=1e-6)
            for p, s, m in zip(net.parameters(), swarm, moved, strict=True)
        )
    assert optimizer.rebased == 1
    assert all(torch.equal(p.detach(), s) for p, s in zip(net.parameters(), swarm, strict=True))
    for seed in range(1, 3):
        backward(net, seed, optimizer)
        outcome = optimizer.step_outcome(batch_size=5)
    assert outcome.applied and not outcome.discarded and optimizer.epoch == 5
    assert all(
        torch.equal(a, p.detach()) for a, p in zip(optimizer.version, net.parameters(), strict=True)
    )


def test_one_local_step_is_the_swarm_itself_and_fewer_than_two_inner_steps_are_refused() -> None:
    net = model()
    outer = LocalOptimizer(net.parameters(), lr=LR, weight_decay=0.0, target_batch_size=1)
    plain = SwarmConfig()
    assert with_local_steps(outer, net.parameters(), plain, LR, 0.0) is outer
    assert isinstance(with_local_steps(outer, net.parameters(), CONFIG, LR, 0.0), LocalSteps)
    with pytest.raises(ValueError, match="at least 2"):
        LocalSteps(outer, net.parameters(), lr=LR, weight_decay=0.0, steps=1)
    assert isinstance(
        outer_optimizer(plain, LR, 0.0)([torch.nn.Parameter(torch.ones(1))]), torch.optim.AdamW
    )
