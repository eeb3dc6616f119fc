"""The one module that imports hivemind: a DHT plus `hivemind.Optimizer` for the trainer.

    learner ──grads──▶ SwarmOptimizer.step(samples) ──hivemind──▶ averaged with peers ──▶ AdamW
                                    │
                                    └── epoch (= policy version) advances when the swarm's
                                        target batch is reached; a lone peer advances at once.

Local mode uses this exact path with a single peer, so the swarm code is always exercised.
Lessons from DESIGN.md §8 live here: request_timeout passed to the gradient averager too,
explicit ordered shutdown (optimizer, then DHT) so no `p2pd` is orphaned, and hivemind's
own logging kept quiet.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable
from functools import partial

import hivemind
import torch
from hivemind.optim.grad_averager import GradientAverager
from hivemind.utils.logging import use_hivemind_log_handler

from agentjet.config import SwarmConfig

log = logging.getLogger(__name__)


def quiet_hivemind() -> None:
    """Route hivemind's logs through ours at WARNING so users see progress, not its noise."""
    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(logging.ERROR)


class SwarmOptimizer:
    def __init__(
        self,
        config: SwarmConfig,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float,
        target_batch_size: int,
    ) -> None:
        quiet_hivemind()
        # hivemind's DHT, averager processes and p2pd inherit SIGINT ignored: a Ctrl-C in a
        # terminal (sent to the whole process group) then reaches only this process, which
        # shuts them down in order instead of racing their deaths mid optimizer step.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.dht = hivemind.DHT(
                initial_peers=config.initial_peers,
                host_maddrs=config.host_maddrs,
                start=True,
                startup_timeout=config.startup_timeout_s,
            )
            try:
                self.optimizer = hivemind.Optimizer(
                    dht=self.dht,
                    run_id=config.run_id,
                    target_batch_size=target_batch_size,
                    optimizer=partial(torch.optim.AdamW, lr=lr, weight_decay=weight_decay),
                    params=params,
                    matchmaking_time=config.matchmaking_time_s,
                    averaging_timeout=config.averaging_timeout_s,
                    averager_opts={"request_timeout": config.request_timeout_s},
                    grad_averager_factory=partial(
                        GradientAverager, request_timeout=config.request_timeout_s
                    ),
                    verbose=False,
                )
            except BaseException:
                self.dht.shutdown()
                raise
        finally:
            signal.signal(signal.SIGINT, previous)

    @property
    def epoch(self) -> int:
        """The swarm's optimizer epoch: the policy version of the current weights."""
        return int(self.optimizer.local_epoch)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def step(self, batch_size: int) -> int:
        """Hand the accumulated `.grad`s of `batch_size` samples to the swarm; returns the epoch."""
        self.optimizer.step(batch_size=batch_size)
        self.optimizer.zero_grad()
        return self.epoch

    def load_state_from_peers(self) -> None:
        self.optimizer.load_state_from_peers()

    def shutdown(self) -> None:
        """Optimizer first (says goodbye, stops averagers), then the DHT and its p2pd."""
        try:
            self.optimizer.shutdown()
        finally:
            self.dht.shutdown()
