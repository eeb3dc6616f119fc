"""RL math against hand-computed values."""

import math

import pytest
import torch

from agentjet.rl import (
    group_advantages,
    is_stale,
    policy_lag,
    policy_loss,
    sample_advantages,
    zero_variance,
)

pytestmark = pytest.mark.unit


def test_advantages_binary_group():
    # rewards [1, 0, 0, 1]: mean 0.5, population std 0.5 -> +-1
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)


def test_advantages_uneven_group():
    # rewards [1, 0, 0, 0]: mean 0.25, std sqrt(0.1875) = 0.4330
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert adv[0] == pytest.approx(0.75 / math.sqrt(0.1875), rel=1e-4)
    assert adv[1] == pytest.approx(-0.25 / math.sqrt(0.1875), rel=1e-4)
    assert sum(adv) == pytest.approx(0.0, abs=1e-6)


def test_dr_grpo_advantages_are_not_divided_by_the_std():
    # rewards [1, 0, 0, 0]: r - mean = [0.75, -0.25, -0.25, -0.25]; all-equal groups stay 0
    assert group_advantages([1.0, 0.0, 0.0, 0.0], std=False) == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )
    assert group_advantages([1.0] * 4, std=False) == [0.0] * 4
    assert sample_advantages([1.0, 0.0], [-1, -1], std=False) == pytest.approx([0.5, -0.5])


def test_clip_higher_lets_a_positive_advantage_ratio_rise_further():
    # ratio 1.5, A = 1: symmetric clip at 1.2 gives -1.2; clip_eps_high 0.28 gives -1.28,
    # and the lower bound stays at 1 - clip_eps (ratio 0.5, A = -1: clipped at 0.8)
    sampler = torch.log(torch.tensor([[0.4]]))
    up = torch.log(torch.tensor([[0.6]]))
    loss, _ = policy_loss(up, sampler, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 1, 0.28)
    assert float(loss) == pytest.approx(-1.28, rel=1e-5)
    down = torch.log(torch.tensor([[0.2]]))
    loss, _ = policy_loss(down, sampler, torch.tensor([-1.0]), torch.ones(1, 1), 0.2, 1, 0.28)
    assert float(loss) == pytest.approx(0.8, rel=1e-5)


def test_zero_variance_group_has_zero_advantage():
    assert group_advantages([1.0] * 8) == [0.0] * 8
    assert group_advantages([0.0] * 8) == [0.0] * 8
    assert zero_variance([0.5] * 4) and zero_variance([])
    assert not zero_variance([0.5, 0.5, 0.6])


def test_loss_on_policy_equals_minus_advantage_mean():
    # ratio = 1 everywhere: loss = -sum(mask * A) / num_tokens
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.3, 0.9]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = policy_loss(lp, lp.clone(), adv, mask, clip_eps=0.2, num_tokens=5)
    # tokens: 2 of sample 0 (A=2) and 3 of sample 1 (A=-1): -(2*2 - 3) / 5 = -0.2
    assert float(loss) == pytest.approx(-0.2)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_frac"] == 0.0


def test_loss_clips_ratio_for_positive_advantage():
    # ratio 1.5 with A = 1: clipped term -1.2 is larger than -1.5, so loss_t = -1.2
    sampler = torch.log(torch.tensor([[0.4]]))
    new = torch.log(torch.tensor([[0.6]]))
    loss, stats = policy_loss(new, sampler, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 1)
    assert float(loss) == pytest.approx(-1.2, rel=1e-5)
    assert stats["clip_frac"] == 1.0


def test_loss_does_not_clip_ratio_below_range_for_positive_advantage():
    # ratio 0.5, A = 1: unclipped -0.5 > clipped -0.8, so loss_t = -0.5 (pessimistic bound)
    sampler = torch.log(torch.tensor([[0.4]]))
    new = torch.log(torch.tensor([[0.2]]))
    loss, _ = policy_loss(new, sampler, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 1)
    assert float(loss) == pytest.approx(-0.5, rel=1e-5)


def test_loss_gradient_ignores_masked_tokens():
    lp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1, 0, 1]])
    loss, _ = policy_loss(lp, torch.zeros(1, 3), torch.tensor([1.0]), mask, 0.2, 2)
    loss.backward()
    # d/dlp of -A * exp(lp - lp_old) / 2 at ratio 1 = -0.5 on trained tokens, 0 on masked
    assert lp.grad[0].tolist() == pytest.approx([-0.5, 0.0, -0.5])


def test_staleness_bound():
    assert policy_lag(3, 5) == 2
    assert not is_stale(3, 5, max_policy_lag=2)
    assert is_stale(2, 5, max_policy_lag=2)
    assert not is_stale(5, 5, max_policy_lag=0)


def test_advantages_count_each_episode_once_when_it_spans_several_samples() -> None:
    # episode 0 forked into two sequences; each episode counts once
    forked = sample_advantages([1.0, 1.0, 0.0], [0, 0, 1])
    assert forked == pytest.approx([1.0, 1.0, -1.0], abs=1e-5)
    assert sample_advantages([1.0, 0.0], [-1, -1]) == group_advantages([1.0, 0.0])
