"""Replay: a trainer trains recently trained groups again while their policy lag is bounded.

When generation is what a step waits for, a group can teach more than once: PPO trains
each batch for several epochs, and ReFlow reuses recent trajectories across versions while
their lag stays bounded (DESIGN.md §10). With `trainer.replay.share` > 0, each step of
`groups_per_step` groups may hold up to that share of replays, and waits only for the
fresh rest; fresh groups keep priority (a step with enough fresh groups holds no replay).
With `trainer.replay.extra` > 0, every step also takes up to that many replays on top of
its fresh groups, however many: the trained samples per generated sample grow.

    step trained (applied) ──▶ Replay.add ──▶ buffer ──Replay.take──▶ next steps' batches
                                   ▲ bounded: uses, lag, groups, bytes

- A group enters when a step that trained it applied (its first use) and is replayed while
  it has been trained fewer than `max_uses` times and was sampled at most `max_lag`
  versions before the step's. Least-used and freshest first.
- A replayed sample is importance-corrected like any lagged one: the clipped token-level
  ratio pi_theta / mu against the logprobs of the policy that sampled it (rl.policy_loss).
  No proximal policy (decoupled PPO): docs/training.md, "Replay", says why.
- "Trained" is untouched: a replay is never queued, named in the DHT, marked or
  acknowledged; its group was acknowledged once, by the step that first trained it.
- What may not be trained is never replayed: a group that failed a check never entered;
  a node quarantined later loses its groups here (`forget_node`); a replay whose logprob
  gap is over the bound leaves the buffer (`drop`), with no mark against its node (it
  passed when fresh: the policy moved). Weights of another lineage empty it (`clear`).
- A group whose rewards all agree carries no gradient and is not kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agentjet import protocol, rl
from agentjet.config import TrainerConfig
from node.groups import oldest_version


@dataclass
class _Entry:
    group: protocol.TrajectoryGroup
    version: int  # the oldest policy version among its samples
    nbytes: int
    uses: int = 1  # times trained, its first (fresh) step included


def group_bytes(group: protocol.TrajectoryGroup) -> int:
    """The token, logprob, mask and teacher score bytes a group holds (what the buffer's
    bound counts)."""
    return sum(
        len(s.prompt_ids)
        + len(s.completion_ids)
        + len(s.logprobs)
        + len(s.loss_mask)
        + len(s.teacher_logprobs)
        + len(s.teacher_top_ids)
        + len(s.teacher_top_logprobs)
        for s in group.samples
    )


@dataclass(frozen=True)
class ReplayStats:
    """What the replays of one step were, for its metrics row."""

    groups: int
    samples: int
    uses_mean: float  # uses of the replayed groups, this one included
    lag_mean: float  # policy lag of the replayed samples at this step
    lag_max: int

    def row(self) -> dict[str, float]:
        return {
            "charts/replay_groups": self.groups,
            "charts/replay_samples": self.samples,
            "charts/replay_uses_mean": self.uses_mean,
            "charts/replay_lag_mean": self.lag_mean,
            "charts/replay_lag_max": self.lag_max,
        }


class Replay:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config.replay
        # This trainer's groups per step (its share of the swarm's step: the trainer sets
        # it as trainers come and go).
        self.groups_per_step = config.groups_per_step
        self._entries: dict[str, _Entry] = {}  # by group id, in the order they entered
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def slots(self) -> int:
        """Replay slots per step: the share of a step, rounded down."""
        return int(self.groups_per_step * self.config.share)

    @property
    def on(self) -> bool:
        return self.slots > 0 or self.config.extra > 0

    def add(self, groups: Iterable[protocol.TrajectoryGroup]) -> None:
        """Groups a step just trained (applied): their first use."""
        if not self.on:
            return
        for group in groups:
            if group.group_id in self._entries or rl.zero_variance(
                [s.reward for s in group.samples]
            ):
                continue
            entry = _Entry(group, oldest_version(group), group_bytes(group))
            self._entries[group.group_id] = entry
            self.nbytes += entry.nbytes
        self._bound()

    def _eligible(self, version: int, lineage: protocol.Lineage) -> list[_Entry]:
        """Entries a step at `version` of `lineage` may replay, least-used and freshest
        first; entries that never can again (lag over the bound) leave."""
        self._remove(
            [g for g, e in self._entries.items() if version - e.version > self.config.max_lag]
        )
        ready = [
            e
            for e in self._entries.values()
            if e.uses < self.config.max_uses and lineage.trains(e.group.lineage, e.version)
        ]
        return sorted(ready, key=lambda e: (e.uses, version - e.version))

    def fresh_needed(self, version: int, lineage: protocol.Lineage) -> int:
        """Fresh groups a step at `version` waits for: its batch less the replays that can
        fill it now."""
        if not self.slots:
            return self.groups_per_step
        return self.groups_per_step - min(self.slots, len(self._eligible(version, lineage)))

    def take(
        self, fresh: int, version: int, lineage: protocol.Lineage
    ) -> list[protocol.TrajectoryGroup]:
        """Replays to join `fresh` fresh groups in a step at `version`: the batch's rest,
        at most its replay share, and `extra` more. They stay in the buffer; `used` counts
        the use."""
        if not self.on:
            return []
        room = min(self.slots, max(0, self.groups_per_step - fresh)) + self.config.extra
        return [e.group for e in self._eligible(version, lineage)[:room]]

    def used(self, group_ids: Iterable[str], version: int) -> ReplayStats:
        """These replays' gradients went into a step at `version` (not discarded): count
        the use; a group used `max_uses` times leaves."""
        entries = [self._entries[g] for g in group_ids if g in self._entries]
        for entry in entries:
            entry.uses += 1
        lags = [version - s.policy_version for e in entries for s in e.group.samples]
        stats = ReplayStats(
            groups=len(entries),
            samples=len(lags),
            uses_mean=sum(e.uses for e in entries) / len(entries) if entries else 0.0,
            lag_mean=sum(lags) / len(lags) if lags else 0.0,
            lag_max=max(lags, default=0),
        )
        self._remove([e.group.group_id for e in entries if e.uses >= self.config.max_uses])
        return stats

    def drop(self, group_ids: Iterable[str]) -> None:
        """Never replay these again (a replay over the logprob gap bound)."""
        self._remove(group_ids)

    def forget_node(self, node_id: str) -> int:
        """A quarantined node's groups leave; returns how many."""
        gone = [g for g, e in self._entries.items() if e.group.node_id == node_id]
        self._remove(gone)
        return len(gone)

    def clear(self) -> None:
        """The weights are another lineage's now: no ratio across lineages."""
        self._remove(list(self._entries))

    def _remove(self, group_ids: Iterable[str]) -> None:
        for group_id in list(group_ids):
            entry = self._entries.pop(group_id, None)
            if entry is not None:
                self.nbytes -= entry.nbytes

    def _bound(self) -> None:
        """Within max_groups and max_mb: the groups sampled longest ago go first."""
        limit = self.config.max_mb * 1e6
        if len(self._entries) <= self.config.max_groups and self.nbytes <= limit:
            return
        by_age = sorted(self._entries.values(), key=lambda e: e.version)
        while by_age and (len(self._entries) > self.config.max_groups or self.nbytes > limit):
            self._remove([by_age.pop(0).group.group_id])
