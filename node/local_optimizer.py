"""`LocalOptimizer`: a lone trainer's optimizer in this process, the in-process twin of
node/swarm.py's `SwarmOptimizer` (both are the `StepOptimizer` node/learner.py steps).

    learner grads ──step_outcome(samples)──▶ kept until the epoch's target_batch_size
        samples are in ──▶ AdamW ──▶ the epoch (= policy version) advances

It steps as `SwarmOptimizer` steps with no peer, bit for bit, and
tests/integration/test_lone_trainer.py holds the two to that: an epoch of one batch steps
on `.grad` as it is; an epoch of several on their gradients accumulated as hivemind 1.1.12's
`GradientAverager` accumulates them (each batch's scaled by its size over the epoch's first
batch's, the sum divided by the number of batches); Adam's state is made as hivemind
makes it, with one step on zero gradients; and `.grad`s left None are zeros when it is made,
as hivemind's gradient averager leaves them.

No trainer runs it: a trainer, a lone one included, always takes the swarm's path (so that
path is always exercised). It is what the unit tier steps a `Learner` with, where starting
hivemind's DHT and averager processes is not allowed (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from functools import partial

import torch

from node.learner import StepOptimizer, set_lr
from node.local_steps import MakeOptimizer
from node.rounds import StepOutcome


class LocalOptimizer(StepOptimizer):
    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float,
        target_batch_size: int,
        make: MakeOptimizer | None = None,
    ) -> None:
        """AdamW over `params` (`lr`, `weight_decay`; or `make(params)`, as the swarm's
        `outer_optimizer`), stepping once `target_batch_size` samples have been handed to
        `step_outcome` since the last step."""
        self.params = tuple(params)
        make = make or partial(torch.optim.AdamW, lr=lr, weight_decay=weight_decay)
        self.optimizer = make(self.params)
        self.target_batch_size = target_batch_size
        self._epoch = 0
        self.batches = 0  # epochs' batches of gradients taken by a step
        self._samples = 0  # of the epoch so far
        self._times = 0  # `step_outcome` calls of the epoch so far
        self._anchor = 0  # the epoch's first batch's size
        self._accumulators: list[torch.Tensor] = []
        _initialize_state(self.optimizer)
        # As hivemind's gradient averager leaves them when it is made: a first step with no
        # backward before it is an Adam step on zero gradients.
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    @property
    def epoch(self) -> int:
        """The policy version of the current weights: the steps taken."""
        return self._epoch

    # The learner trains the weights the model holds: the version's.
    training = staticmethod(contextlib.nullcontext)

    @property
    def state_loads(self) -> int:
        """None: there is no swarm to download a state from."""
        return 0

    def name_groups(self, group_ids: Iterable[str]) -> str:
        """The id of the batch the next `step_outcome` adds to (there is no swarm to tell
        of its groups)."""
        return f"local/{self.batches}"

    @torch.no_grad()
    def step_outcome(self, batch_size: int, lr: float | None = None) -> StepOutcome:
        """Add the `.grad`s of `batch_size` samples to the epoch's, step (at `lr`) once
        the epoch's samples are in, and clear `.grad`."""
        epoch = self._epoch
        self._samples += batch_size
        self._times += 1
        if self._times == 1:
            self._anchor = batch_size
        else:
            for grad, accumulator in zip(self._grads(), self._accumulators, strict=True):
                accumulator.add_(grad, alpha=batch_size / self._anchor)
        if self._samples >= self.target_batch_size:
            if self._times > 1:
                for grad, accumulator in zip(self._grads(), self._accumulators, strict=True):
                    grad.copy_(accumulator).mul_(1.0 / self._times)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            self._epoch += 1
            self.batches += 1
            self._samples = self._times = self._anchor = 0
            self._accumulators = []
        elif self._times == 1:
            self._accumulators = [grad.clone() for grad in self._grads()]
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(self._epoch, applied=self._epoch > epoch, discarded=False)

    def _grads(self) -> Iterator[torch.Tensor]:
        """Every parameter's `.grad`, zeros where it has none (as hivemind's accumulation
        reads them)."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            yield param.grad


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam's state as hivemind 1.1.12 makes it (`initialize_optimizer_state_`): one step
    on zero gradients, which counts in Adam's bias corrections and applies weight decay
    once."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, grad in zip(params, kept, strict=True):
        p.grad = grad
