"""The trainer's decisions and its agreement with the sampler.

`take_batch` is pure. The learner test is the important one: on samples the engine just
drew (temperature 0.7, prompts of different lengths, multi-turn masks), the trainer's
recomputed logprobs must equal the sampler's, i.e. importance ratios of exactly 1.
"""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import pytest
import torch

from agentjet import protocol
from agentjet.config import TrainerConfig
from agentjet.episode import Episode, SamplingParams
from node.groups import take_batch
from node.learner import Learner, scheduled_lr
from node.local_optimizer import LocalOptimizer
from node.model import load_causal_lm
from node.rollout_produce import build_group
from node.torch_engine import TorchEngine
from tests.factories import make_group

pytestmark = pytest.mark.unit


def test_take_batch_drops_stale_groups_and_keeps_order():
    queue = deque(
        [
            make_group("old", 1),
            make_group("a", 3),
            make_group("b", 4),
            make_group("c", 5),
            make_group("d", 5),
        ]
    )
    batch, stale = take_batch(queue, size=2, version=5, max_policy_lag=2)
    assert [g.group_id for g in batch] == ["a", "b"]
    assert [g.group_id for g in stale] == ["old"]
    assert [g.group_id for g in queue] == ["c", "d"]


def test_take_batch_returns_short_batch_when_queue_runs_out():
    queue = deque([make_group("a", 0)])
    batch, stale = take_batch(queue, size=4, version=0, max_policy_lag=0)
    assert [g.group_id for g in batch] == ["a"] and not stale and not queue


def test_learner_logprobs_match_the_sampler(tiny_model_dir: Path, one_torch_thread: None):
    temperature = 0.7
    engine = TorchEngine(tiny_model_dir, seed=1)
    prompts = [[1, 5, 9, 200], [1, 7, 300, 400, 500, 600, 700]]
    completions = asyncio.run(
        engine.generate(prompts, 3, SamplingParams(temperature=temperature, max_new_tokens=6))
    )
    grants, groups = [], []
    for i, (prompt, samples) in enumerate(zip(prompts, completions, strict=True)):
        episodes = []
        for j, completion in enumerate(samples):
            episode = Episode(prompt_ids=prompt)
            episode.add_model_turn(completion)
            if i == 1:  # a tool turn in between: context tokens are never trained
                episode.add_context([11, 12, 13])
                [[turn]] = asyncio.run(
                    engine.generate(
                        [episode.context_ids],
                        1,
                        SamplingParams(temperature=temperature, max_new_tokens=4),
                    )
                )
                episode.add_model_turn(turn)
            episode.reward = float(j == 0)
            episodes.append(episode)
        task = protocol.Task(id=f"t{i}", env="arithmetic", prompt="", answer=0)
        grant = protocol.WorkGrant(grant_id=f"g{i}", task=task, group_size=3, lease_s=1.0)
        grants.append(grant)
        groups.append(build_group(grant, episodes, "n", 0.0))

    model, _ = load_causal_lm(tiny_model_dir)
    optimizer = lone_optimizer(model, target_batch_size=6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, optimizer, TrainerConfig(micro_batch_samples=2), temperature, 0)
    row = learner.train_step(groups).row()
    assert row["losses/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert row["losses/sampler_kl"] == pytest.approx(0.0, abs=1e-4)
    assert row["losses/clip_frac"] == 0.0
    assert row["charts/trained_samples"] == 6 and row["policy_version"] == 1
    masked = sum(int(protocol.unpack_mask(s.loss_mask).sum()) for g in groups for s in g.samples)
    assert row["charts/trained_tokens"] == masked
    changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert changed, "an optimizer step with non-zero advantages must move the weights"


def test_with_a_sample_budget_a_version_waits_for_enough_gradient(tiny_model_dir: Path) -> None:
    """trainer.informative_samples_per_step: batches whose samples carry no gradient add
    nothing; the optimizer steps once the budget of samples with gradient is reached."""
    model, _ = load_causal_lm(tiny_model_dir)
    optimizer = lone_optimizer(model, target_batch_size=4)
    # The factory's groups carry made-up logprobs: the logprob check is off.
    config = TrainerConfig(informative_samples_per_step=4, max_logprob_gap=0.0)
    learner = Learner(model, optimizer, config, 1.0, 0)
    versions = [
        learner.train_step([make_group(name, rewards=rewards)]).outcome.epoch
        for name, rewards in (("same", (1.0, 1.0)), ("a", (1.0, 0.0)), ("b", (0.0, 1.0)))
    ]
    assert versions == [0, 0, 1]


def test_the_learning_rate_falls_with_the_policy_version(tiny_model_dir: Path) -> None:
    """trainer.lr_decay_versions: each step is taken at the rate its version is due, linear
    from `lr` to `lr_end`, then `lr_end`; the step's metrics say which."""
    config = TrainerConfig(lr=4e-3, lr_end=1e-3, lr_decay_versions=3, max_logprob_gap=0.0)
    assert [scheduled_lr(config, v) for v in range(5)] == pytest.approx(
        [4e-3, 3e-3, 2e-3, 1e-3, 1e-3]
    )
    assert scheduled_lr(TrainerConfig(lr=4e-3), 1000) == 4e-3, "no schedule: lr throughout"
    model, _ = load_causal_lm(tiny_model_dir)
    optimizer = lone_optimizer(model, target_batch_size=2, lr=1.0)  # the schedule overrides it
    learner = Learner(model, optimizer, config, 1.0, 0)
    used, rates = [], []
    for i in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        result = learner.train_step([make_group(f"g{i}", rewards=(1.0, 0.0))])
        assert result.outcome.applied
        rates.append(result.metrics["charts/lr"])
        used.append(optimizer.optimizer.param_groups[0]["lr"])
        pairs = zip(model.parameters(), before, strict=True)
        moved = max((p - b).abs().max().item() for p, b in pairs)
        assert 0 < moved < 0.1, "a step at lr 1.0 would move a weight by about 1"
    assert rates == used == pytest.approx([4e-3, 3e-3, 2e-3, 1e-3, 1e-3])


def lone_optimizer(
    model: torch.nn.Module, target_batch_size: int, lr: float = 1e-3
) -> LocalOptimizer:
    """A lone trainer's optimizer in this process: it steps as a one-peer `SwarmOptimizer`
    does (tests/integration/test_lone_trainer.py), with no hivemind process."""
    return LocalOptimizer(
        model.parameters(), lr=lr, weight_decay=0.0, target_batch_size=target_batch_size
    )
