"""`LocalOptimizer`, the in-process twin of a lone trainer's `SwarmOptimizer`, steps as
torch's AdamW does on the same gradients (tests/integration/test_lone_trainer.py holds it
to the swarm's steps)."""

from __future__ import annotations

import pytest
import torch

from node.local_optimizer import LocalOptimizer
from node.rounds import StepOutcome

pytestmark = pytest.mark.unit

LR, WEIGHT_DECAY = 1e-2, 0.1


def twins() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.AdamW]:
    """A model, its copy, and AdamW over the copy with Adam's state made as hivemind
    makes it: one step on zero gradients (which applies weight decay once)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    twin.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for p in twin.parameters():
        p.grad = torch.zeros_like(p)
    plain.step()
    plain.zero_grad()
    return model, twin, plain


def grads(model: torch.nn.Module, batch: torch.Tensor) -> list[torch.Tensor]:
    model(batch).square().mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_epochs_of_one_batch_are_adamw_steps_on_its_gradients() -> None:
    model, twin, plain = twins()
    local = LocalOptimizer(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, target_batch_size=4
    )
    assert same(model, twin), "Adam's state is made with a step on zero gradients"
    for version in (1, 2, 3):
        batch = torch.randn(4, 8)
        grads(model, batch)
        grads(twin, batch)
        plain.step()
        plain.zero_grad()
        assert local.step_outcome(batch_size=4) == StepOutcome(
            version, applied=True, discarded=False
        )
        assert local.epoch == version and same(model, twin)
        assert all(p.grad is None for p in model.parameters())


def test_an_epoch_of_several_batches_steps_once_on_their_size_weighted_mean() -> None:
    """hivemind's accumulation: each batch's gradients times its size over the first
    batch's, summed, divided by the number of batches (2 then 6 samples: (g1 + 3 g2) / 2)."""
    model, twin, plain = twins()
    local = LocalOptimizer(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, target_batch_size=8
    )
    first, second = torch.randn(2, 8), torch.randn(6, 8)
    grads(model, first)
    kept = local.step_outcome(batch_size=2)
    assert kept == StepOutcome(0, applied=False, discarded=False)
    assert same(model, twin), "a batch short of the epoch moves nothing"
    assert all(p.grad is None for p in model.parameters())
    grads(model, second)
    assert local.step_outcome(batch_size=6) == StepOutcome(1, applied=True, discarded=False)
    g1 = grads(twin, first)
    twin.zero_grad()
    g2 = grads(twin, second)
    for p, a, b in zip(twin.parameters(), g1, g2, strict=True):
        p.grad = (a + b * 3.0) / 2
    plain.step()
    assert torch.allclose(
        torch.cat([p.flatten() for p in model.parameters()]),
        torch.cat([p.flatten() for p in twin.parameters()]),
        rtol=0,
        atol=1e-7,
    )


def test_a_step_with_no_backward_since_it_was_made_is_on_zero_gradients() -> None:
    """As a lone `SwarmOptimizer`'s: hivemind's gradient averager leaves zeros in `.grad`
    when it is made (a learner's batch of zero-advantage samples steps with no backward)."""
    model, twin, plain = twins()
    local = LocalOptimizer(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, target_batch_size=4
    )
    assert local.step_outcome(batch_size=4) == StepOutcome(1, applied=True, discarded=False)
    for p in twin.parameters():
        p.grad = torch.zeros_like(p)
    plain.step()
    plain.zero_grad()
    batch = torch.randn(4, 8)
    grads(model, batch)
    grads(twin, batch)
    plain.step()
    assert local.step_outcome(batch_size=4).epoch == 2 and same(model, twin)


def test_each_epoch_is_a_batch_of_its_own_id() -> None:
    model = torch.nn.Linear(2, 1)
    local = LocalOptimizer(model.parameters(), lr=LR, weight_decay=0.0, target_batch_size=2)
    ids = []
    for _ in range(3):
        ids.append(local.name_groups(["g"]))
        model(torch.ones(1, 2)).sum().backward()
        local.step_outcome(batch_size=1)
    assert ids[0] == ids[1] != ids[2], "a batch holds the groups until its epoch steps"
