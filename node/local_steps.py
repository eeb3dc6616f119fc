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
  as a failed gradient round's do. A catch-up between batches (the swarm's weights taken
  from a peer) moves the inner steps over onto the new weights (`_rebase`).

Between batches the model holds the version's weights, so whatever reads them then (a
checkpoint, a version published, the state served to a joining trainer) gets a version's;
the inner weights are copied in only while the learner's passes run (`training`, under
the swarm's step lock, which serving a state takes too), and out again after.

What differs: rollout nodes get a version every H batches, so samples are older; a
trainer holds two more copies of the trainable weights (the version's and the inner
ones), the inner AdamW's moments, and the outer optimizer's momentum instead of AdamW's
two moments; the inner moments live in this process only (a checkpoint holds the outer
optimizer's momentum, and a resumed trainer starts its inner moments afresh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from functools import partial

import torch

from agentjet.config_schema import SwarmConfig
from node.learner import StepOptimizer, set_lr
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
        lock: AbstractContextManager[object] | None = None,
    ) -> None:
        """`steps` inner AdamW(`lr`, `weight_decay`) steps over `params`, then one step of
        `outer` on their pseudo-gradient (made with `outer_optimizer`). `lock`: held while
        the inner weights are in `params` (the swarm's step lock, under which a trainer
        serves its state: a peer downloading it gets the version's weights)."""
        if steps < 2:
            raise ValueError(f"local steps need at least 2 inner steps, not {steps}")
        self.outer = outer
        self.params = tuple(params)
        self.lock = lock or contextlib.nullcontext()
        # Between batches `params` hold the version's weights (a checkpoint, a state served
        # or published, is of them); the inner steps' weights are kept here, and swapped in
        # only while the learner trains (`training`).
        with torch.no_grad():
            self.version = [p.detach().clone() for p in self.params]
            self.weights = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.inner = torch.optim.AdamW(self.weights, lr=lr, weight_decay=weight_decay)
        self.steps = steps
        self.taken = 0  # inner steps since the weights were last the version's
        self.samples = 0  # the samples of those steps
        self.rounds = 0  # outer steps asked for
        self.rebased = 0  # times the version's weights were replaced under the inner steps
        self.anchored = self._where()

    @property
    def epoch(self) -> int:
        """The policy version of the last outer step (the inner steps make none)."""
        return self.outer.epoch

    @property
    def state_loads(self) -> int:
        return self.outer.state_loads

    def name_groups(self, group_ids: Iterable[str]) -> str:
        """The outer optimizer's batch: every inner step's groups are in the one round."""
        return self.outer.name_groups(group_ids)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """The inner steps' weights in `params` while the learner's passes run, under
        `lock`; the version's again after."""
        with self.lock:
            if self._where() != self.anchored:
                self._rebase()
            _copy(self.params, self.weights)
            try:
                yield
            finally:
                _copy(self.params, self.version)

    @torch.no_grad()
    def step_outcome(self, batch_size: int, lr: float | None = None) -> StepOutcome:
        """An inner step, at `lr`, on the `.grad`s of `batch_size` samples; after the
        `steps`-th, the outer step on the pseudo-gradient (at swarm.outer_lr), and what
        became of the inner steps' groups (kept accumulated before it)."""
        for weights, param in zip(self.weights, self.params, strict=True):
            weights.grad, param.grad = param.grad, None
        set_lr(self.inner, lr)
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.taken += 1
        self.samples += batch_size
        if self.taken < self.steps:
            return StepOutcome(self.epoch, applied=False, discarded=False)
        # The pseudo-gradient, with the version's weights in `params` (as between batches).
        for param, version, weights in zip(self.params, self.version, self.weights, strict=True):
            param.grad = version - weights
        self.rounds += 1
        outcome = self.outer.step_outcome(self.samples)
        # Whatever came of it, the weights are now a version's: the new one (applied), the
        # one before (a failed round, or the swarm's target not reached yet), or the
        # swarm's (this trainer was out of sync).
        self._anchor_here()
        return outcome

    def _where(self) -> tuple[int, int]:
        """The version the weights are at, and the state downloads that put them there."""
        return self.outer.epoch, self.outer.state_loads

    @torch.no_grad()
    def _rebase(self) -> None:
        """The version's weights were replaced between batches (a trainer catching up with
        the swarm, node/trainer_catch_up.py; it may do so at every batch while its version
        is withheld): the inner steps so far move over onto the new weights, as a delta.
        Their groups are in no version yet, so they are still trained once, by the outer
        step that averages this delta with the others'."""
        for param, version, weights in zip(self.params, self.version, self.weights, strict=True):
            weights.add_(param - version)
            version.copy_(param)
        self.anchored = self._where()
        self.rebased += 1

    def _anchor_here(self) -> None:
        """The weights in `params` now are the version the next inner steps start from."""
        _copy(self.version, self.params)
        _copy(self.weights, self.params)
        self.anchored = self._where()
        self.taken = self.samples = 0


@torch.no_grad()
def _copy(into: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    for tensor, value in zip(into, values, strict=True):
        tensor.copy_(value)


def with_local_steps(
    swarm: StepOptimizer,
    params: Iterable[torch.nn.Parameter],
    config: SwarmConfig,
    lr: float,
    weight_decay: float,
    lock: AbstractContextManager[object] | None = None,
) -> StepOptimizer:
    """What a trainer's learner steps: `swarm` itself (local_steps = 1), or `LocalSteps` of
    AdamW(`lr`, `weight_decay`) over `params` (those `swarm` averages) around it, under
    `lock` (the swarm's step lock) while it trains."""
    if config.local_steps == 1:
        return swarm
    steps = config.local_steps
    return LocalSteps(swarm, params, lr=lr, weight_decay=weight_decay, steps=steps, lock=lock)
