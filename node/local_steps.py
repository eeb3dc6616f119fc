"""`LocalSteps`: DiLoCo's local steps over a trainer's swarm optimizer (swarm.local_steps = H
> 1): one gradient round every H batches instead of every batch.

    batches 1..H ──each an inner AdamW step on this trainer's own groups (no round)──▶ θ_inner
    after the H-th ──▶ the pseudo-gradient Δ = θ_version − θ_inner as `.grad`, and the
        weights back to θ_version
        ──▶ the outer optimizer's step (node/swarm.py `SwarmOptimizer`, or the lone twin
            node/local_optimizer.py): one exact round averages every trainer's Δ (in
            swarm.grad_compression's format), then SGD with Nesterov momentum
            (swarm.outer_lr, swarm.outer_momentum) steps from θ_version
        ──▶ θ of the next version, the same bits on every trainer; the next inner steps
            start from it

What holds as in exact mode:
- One version number = one weight set. Only the outer step makes a version; every
  trainer starts it from the version's weights and applies the same averaged Δ.
- A group is trained once it is in a version. The groups of the inner steps stay
  accumulated (node/groups.py GroupBook) until the outer step: trained if it is applied;
  if the round fails, or this trainer was out of sync, the inner steps are dropped (the
  weights are the version's again, or the swarm's) and the groups go back to the queue,
  as a failed gradient round's do.

What differs: rollout nodes get a version every H batches, so samples are older; the
inner AdamW's moments live in this process only (a checkpoint holds the outer
optimizer's momentum, and a resumed trainer starts its inner moments afresh).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch

from agentjet.config_schema import SwarmConfig
from node.learner import StepOptimizer
from node.rounds import StepOutcome

MakeOptimizer = Callable[[Sequence[torch.nn.Parameter]], torch.optim.Optimizer]


def outer_optimizer(config: SwarmConfig, lr: float, weight_decay: float) -> MakeOptimizer:
    """The optimizer the swarm's step applies to the averaged `.grad`s: AdamW(`lr`,
    `weight_decay`) on gradients (local_steps = 1), or SGD with Nesterov momentum on
    pseudo-gradients (local_steps > 1; the inner AdamW has the weight decay)."""
    if config.local_steps == 1:
        return partial(torch.optim.AdamW, lr=lr, weight_decay=weight_decay)
    return partial(
        torch.optim.SGD, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=True
    )


class LocalSteps(StepOptimizer):
    def __init__(
        self,
        outer: StepOptimizer,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float,
        steps: int,
    ) -> None:
        """`steps` inner AdamW(`lr`, `weight_decay`) steps over `params`, then one step of
        `outer` on their pseudo-gradient (made with `outer_optimizer`)."""
        if steps < 2:
            raise ValueError(f"local steps need at least 2 inner steps, not {steps}")
        self.outer = outer
        self.params = tuple(params)
        self.inner = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.steps = steps
        self.taken = 0  # inner steps since the weights were last the version's
        self.samples = 0  # the samples of those steps
        self.rounds = 0  # outer steps asked for
        self.dropped = 0  # inner steps dropped: their weights were replaced (`_replaced`)
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self.params]
        self.anchored = self._where()

    @property
    def epoch(self) -> int:
        """The policy version of the last outer step (the inner steps make none)."""
        return self.outer.epoch

    def name_groups(self, group_ids: Iterable[str]) -> str:
        """The outer optimizer's batch: every inner step's groups are in the one round."""
        return self.outer.name_groups(group_ids)

    @torch.no_grad()
    def step_outcome(self, batch_size: int) -> StepOutcome:
        """An inner step on the `.grad`s of `batch_size` samples; after the `steps`-th,
        the outer step on the pseudo-gradient, and what became of the inner steps' groups
        (kept accumulated before it)."""
        if self._where() != self.anchored:
            # The weights were replaced since the inner steps began (a trainer catching up
            # with the swarm, node/trainer_catch_up.py): the inner steps are lost with
            # them, so their groups go back to the queue with this batch's.
            self.dropped += self.taken
            self.inner.zero_grad(set_to_none=True)
            self._anchor_here()
            return StepOutcome(self.epoch, applied=False, discarded=True)
        self.inner.step()
        self.taken += 1
        self.samples += batch_size
        if self.taken < self.steps:
            self.inner.zero_grad(set_to_none=True)
            return StepOutcome(self.epoch, applied=False, discarded=False)
        for param, anchor in zip(self.params, self.anchor, strict=True):
            if param.grad is None:
                param.grad = torch.empty_like(param)
            torch.sub(anchor, param, out=param.grad)
            param.copy_(anchor)
        samples = self.samples
        self.rounds += 1
        outcome = self.outer.step_outcome(samples)
        # Whatever came of it, the weights are now a version's: the new one (applied), the
        # one before (a failed round, or the swarm's target not reached yet), or the
        # swarm's (this trainer was out of sync).
        self._anchor_here()
        return outcome

    @property
    def state_loads(self) -> int:
        return self.outer.state_loads

    def _where(self) -> tuple[int, int]:
        """The version the weights are at, and the state downloads that put them there."""
        return self.outer.epoch, self.outer.state_loads

    def _anchor_here(self) -> None:
        """The weights as they are now are the version the next inner steps start from."""
        with torch.no_grad():
            for param, anchor in zip(self.params, self.anchor, strict=True):
                anchor.copy_(param)
        self.anchored = self._where()
        self.taken = self.samples = 0


def with_local_steps(
    swarm: StepOptimizer,
    params: Iterable[torch.nn.Parameter],
    config: SwarmConfig,
    lr: float,
    weight_decay: float,
) -> StepOptimizer:
    """What a trainer's learner steps: `swarm` itself (local_steps = 1), or `LocalSteps` of
    AdamW(`lr`, `weight_decay`) over `params` (those `swarm` averages) around it."""
    if config.local_steps == 1:
        return swarm
    return LocalSteps(swarm, params, lr=lr, weight_decay=weight_decay, steps=config.local_steps)
