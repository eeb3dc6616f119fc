"""A trainer's step, stage by stage, from a batch taken off its queue to the version made.

    batch (+ replays: trained groups again, node/replay.py)
        ──(thread)──▶ Learner.train_step (node/learner.py; the swarm's round inside)
        ──▶ freed memory handed back ──▶ groups left out for their logprobs rejected
            (Intake.reject_for_logprobs)
        ──▶ the outcome in the GroupBook (`stepped`): trained, queued again, or in doubt
        ──▶ trained: in the book and marked in the DHT (node/directory.py), kept for replay
        ──▶ a new version: published (Versions.publish), unless withheld
        ──▶ the step's metrics row
        ──▶ a checkpoint every trainer.checkpoint_every versions, or once
            MAX_UNDURABLE_GROUPS trained groups wait for one (Versions.checkpoint)

The trainer role (node/trainer.py) takes the batch and runs `Step.run` shielded from its
learn loop's cancellation: a stop never cuts a step in two.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from agentjet import protocol, rl
from agentjet.bridge import blocking
from agentjet.config import Config
from agentjet.devices import peak_memory
from agentjet.metrics import MetricsWriter
from node import memory
from node.directory import Directory, Mark
from node.gpu_monitor import metrics as gpu_metrics
from node.groups import Filling, GroupBook, StepGroups, doubt_wait_s, oldest_version
from node.learner import Learner, StepResult
from node.publisher import Publisher
from node.replay import Replay, ReplayStats
from node.rounds import StepOutcome
from node.swarm import SwarmOptimizer
from node.trainer_intake import Head, Intake
from node.trainer_status import Status
from node.trainer_versions import Versions

log = logging.getLogger(__name__)

# Trained groups rollout nodes must keep (spooled) until a checkpoint holds their steps:
# past this many the trainer checkpoints early, whatever trainer.checkpoint_every says.
MAX_UNDURABLE_GROUPS = 512


@dataclass
class Step:
    """Runs a trainer's steps (see the module docstring)."""

    config: Config
    head: Head
    book: GroupBook
    replay: Replay
    filling: Filling
    learner: Learner
    intake: Intake
    swarm: SwarmOptimizer
    directory: Directory
    versions: Versions
    publisher: Publisher
    status: Status
    metrics: MetricsWriter
    counts: Counter[str]
    device: torch.device
    local_batch: int  # samples: what a short or shared batch counts for toward the swarm's
    lag_histogram: Counter[int] = field(default_factory=Counter)

    async def run(
        self,
        batch: list[protocol.TrajectoryGroup],
        last: float,
        short: bool = False,
        replays: list[protocol.TrajectoryGroup] | None = None,
        shared: bool = False,
    ) -> float:
        """Train on `batch` (and `replays`: trained groups again, node/replay.py), publish
        and record the new version; returns the step's end time.

        The batch's gradients join those already accumulated. When the swarm steps, every
        accumulated group is trained; when hivemind discards them (this trainer was out of
        sync, or the round with peers failed), the groups go back to the queue front.
        A `short` batch (dynamic sampling's time to fill passed), and one `shared` with
        the other trainers (its share of the step's groups), counts as a full local batch
        toward the swarm's target, so the step is taken now.
        """
        lags = [
            rl.policy_lag(s.policy_version, self.head.version) for g in batch for s in g.samples
        ]
        self.lag_histogram.update(lags)
        if short:
            log.info(
                "time to fill a step passed (trainer.fill_timeout_s): training %d of %d groups",
                len(batch),
                self.replay.groups_per_step,
            )
            self.counts["steps_short"] += 1
        left_out = self.filling.left_out
        self.filling.restart()
        self.publisher.retire_idle()  # (what the step allocates can take its memory)
        replays = replays or []
        result: StepResult = await blocking(
            self.learner.train_step, batch, self.local_batch if short or shared else 0, replays
        )
        # What the step freed goes back to the kernel whatever came of it: a trainer whose
        # rounds kept failing made no version, so no snapshot trimmed, and its heap grew by
        # the step's free memory at every retry (9-13 GB at version 0, issue 47).
        await blocking(memory.trim)
        self.intake.reject_for_logprobs(batch, result)
        outcome = result.outcome
        replayed, replay_stats = replays_used(
            self.replay, replays, result, self.head.version, self.counts
        )
        groups = self.book.stepped(
            [g for g in batch if g.group_id not in result.rejected],
            applied=outcome.applied,
            discarded=outcome.discarded,
            in_doubt=outcome.in_doubt,
            version=self.head.version,
            deadline=time.monotonic() + doubt_wait_s(self.config.swarm),
        )
        changed = await self._record(groups, outcome)
        now = time.perf_counter()
        self.status.measured(last, now, result.metrics["charts/samples"])
        self.metrics.write(
            result.row()
            | self._row(groups, replayed, replay_stats, lags, now - last, short, left_out)
        )
        due = self.head.version % self.config.trainer.checkpoint_every == 0
        undurable = len(self.book.undurable) >= MAX_UNDURABLE_GROUPS
        if changed and not self.swarm.withheld and (due or undurable):
            await blocking(self.versions.checkpoint)
        return now

    async def _record(self, groups: StepGroups, outcome: StepOutcome) -> bool:
        """Record what a step did to its groups (trained ones in the book and the DHT) and
        publish the version it made; returns whether it made one."""
        if groups.doubtful is not None:
            self.counts["groups_in_doubt"] += len(groups.doubtful.groups)
            log.info(
                "step not taken here, maybe by a peer: %d groups wait aside",
                len(groups.doubtful.groups),
            )
        if groups.requeued:
            self.counts["groups_requeued"] += len(groups.requeued)
            log.info("step not taken: %d groups go back to the queue", len(groups.requeued))
        if groups.trained:
            self.replay.add(groups.trained)
            self.book.trained(groups.trained, outcome.epoch, self.head.lineage.id)
            self.counts["groups_trained"] += len(groups.trained)
            ids = [g.group_id for g in groups.trained]
            mark = Mark(self.head.lineage.id, outcome.epoch)
            await blocking(self.directory.mark_trained, ids, mark, outcome.peer_batches)
        changed = outcome.epoch != self.head.version
        self.head.version = outcome.epoch
        if changed and self.swarm.withheld:
            log.warning(
                "version %d may differ from the swarm's: withheld until it takes theirs",
                self.head.version,
            )
            self.counts["versions_withheld"] += 1
        elif changed:
            await self.versions.publish()
        return changed

    def _row(
        self,
        groups: StepGroups,
        replayed: list[str],
        replay_stats: ReplayStats,
        lags: list[int],
        spent_s: float,
        short: bool,
        left_out: int,
    ) -> dict[str, Any]:
        """The step's metrics row, past the learner's own (`StepResult.row`)."""
        return {
            "event": "step",
            "lineage": self.head.lineage.id,
            "trained_group_ids": [g.group_id for g in groups.trained],
            "trained_group_versions": [oldest_version(g) for g in groups.trained],
            # trained again (node/replay.py): already trained, never acknowledged again
            "replayed_group_ids": replayed,
            **replay_stats.row(),
            "replay_buffer_groups": len(self.replay),
            "policy_sha256": self.publisher.published.sha256,
            "charts/staleness_mean": sum(lags) / len(lags),
            "charts/staleness_max": max(lags),
            "perf/s_per_version": spent_s,
            "short_step": short,
            # zero-variance groups dynamic sampling left out while this step filled
            "groups_left_out": left_out,
            "perf/samples_per_s": self.status.samples_per_s,
            "queue": len(self.book.queue),
            **gpu_metrics(self.status.gpus),
            **peak_memory(self.device),
            **self.status.counts_row(),
        }


def replays_used(
    replay: Replay,
    replays: list[protocol.TrajectoryGroup],
    result: StepResult,
    version: int,
    counts: Counter[str],
) -> tuple[list[str], ReplayStats]:
    """The ids of the `replays` a step trained again (none if its gradients were thrown
    away), and their stats; those its learner left out for their logprobs leave the buffer."""
    replay.drop(result.replays_dropped)
    counts["replays_dropped_logprobs"] += len(result.replays_dropped)
    replayed = [g.group_id for g in replays if g.group_id not in result.replays_dropped]
    if result.outcome.discarded:  # their gradients went nowhere: no use
        replayed = []
    stats = replay.used(replayed, version)
    counts["groups_replayed"] += stats.groups
    return replayed, stats
