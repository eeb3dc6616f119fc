"""Where each group a trainer has heard of is, until it is trained or dropped: the
trainer side's counterpart of the rollout node's `Ledger` (node/delivery.py).

    SubmitGroup ─accept─▶ queued ─take─▶ batch ─step─▶ accumulated ─swarm steps─▶ trained
                 │                  │              │                              │
               stale       stale, other    round failed: queued          checkpoint, or
                 ▼                  ▼       again (front); failed on     a live peer past
              dropped        lineage        this side only: doubtful     it: durable
                                            (a peer's mark settles it)

Under dynamic sampling (trainer.dynamic_sampling) a group whose rewards all agree never
enters the book's queue: it is acked "zero_variance" on arrival, remembered as dropped, and
counted by the step being filled (`Filling`), which waits for `groups_per_step` groups
that teach something, or trains what it holds once `trainer.fill_timeout_s` has passed.

"Trained" is said to a rollout node (GroupStatus) only once the weights holding the group
survive this trainer's death: a checkpoint here of a version at or past the step's. (The
DHT's trained marks, read when a trainer is gone, also count a live trainer whose lineage
holds the step: node/directory.py `durable`.) Until then the group is "queued" for the rollout
node, which keeps its copy. Every trained group is appended to trained_groups.log
(`version<TAB>group id<TAB>lineage`), so a trainer resumed from a checkpoint, or one that
takes a peer's weights, knows again the groups those weights hold (`open_log`, `adopt`);
the rest of the book lives in memory.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from agentjet import protocol, rl
from agentjet.config import SwarmConfig
from agentjet.roles import wait_for

# Ids of acknowledged groups kept for duplicate detection; a re-send arrives within minutes.
SEEN_GROUP_IDS = 1_000_000
# In a trainer's run dir: every trained group, with its step's version and lineage.
TRAINED_LOG = "trained_groups.log"

Status = Literal["queued", "trained", "dropped", "unknown"]


@dataclass
class DoubtfulBatch:
    """Groups whose gradients went into a round that failed on this trainer's side only
    (`RoundFailed.sent`): a peer may have stepped with them. The peer's mark of the batch
    (node/directory.py, round marks) settles it (`settle`)."""

    batch_id: str
    epoch: int  # the version of the round: a peer that took the batch stepped from it
    groups: list[protocol.TrajectoryGroup]
    deadline: float  # time.monotonic(): not settled by then, its groups are trained again


def doubt_wait_s(swarm: SwarmConfig) -> float:
    """How long a doubtful batch may wait for its mark at most. A peer that stepped with
    the batch marks it after its parameter round (a matchmaking time and an averaging
    timeout at most), and a peer that died meanwhile leaves the directory within
    record_ttl_s; `settle` mostly decides well before."""
    return swarm.matchmaking_time_s + swarm.averaging_timeout_s + swarm.record_ttl_s


def settle(
    doubtful: list[DoubtfulBatch],
    marked: set[str],
    version: int,
    other_versions: Iterable[int],
    now: float,
) -> tuple[list[DoubtfulBatch], list[DoubtfulBatch], list[DoubtfulBatch]]:
    """Split doubtful batches into (trained by a peer, to train again, still in doubt).

    A marked batch is trained once this trainer holds a version past its round's (it
    catches up to get the peer's weights). An unmarked one is trained again once no other
    live trainer can still be in the step that would take it: each lists a version past
    the round's (a trainer stores its marks before its record shows the step's version),
    or none is listed. At its deadline a batch not settled is trained again: training a
    group twice is the lesser harm than holding it in no weights."""
    others = list(other_versions)
    trained, again, waiting = [], [], []
    for batch in doubtful:
        untaken = batch.batch_id not in marked and all(v > batch.epoch for v in others)
        if batch.batch_id in marked and version > batch.epoch:
            trained.append(batch)
        elif untaken or now >= batch.deadline:
            again.append(batch)
        else:
            waiting.append(batch)
    return trained, again, waiting


def take_batch(
    queue: deque[protocol.TrajectoryGroup],
    size: int,
    version: int,
    max_policy_lag: int,
    lineage: protocol.Lineage | None = None,
) -> tuple[list[protocol.TrajectoryGroup], list[protocol.TrajectoryGroup]]:
    """Pop up to `size` fresh groups from the queue front; also return the stale ones dropped:
    too old, or sampled by a policy `lineage` does not descend from (`Lineage.trains`)."""
    batch: list[protocol.TrajectoryGroup] = []
    stale: list[protocol.TrajectoryGroup] = []
    while queue and len(batch) < size:
        group = queue.popleft()
        oldest = oldest_version(group)
        foreign = lineage is not None and not lineage.trains(group.lineage, oldest)
        old = rl.is_stale(oldest, version, max_policy_lag)
        (stale if foreign or old else batch).append(group)
    return batch, stale


def oldest_version(group: protocol.TrajectoryGroup) -> int:
    return min(s.policy_version for s in group.samples)


@dataclass
class Filling:
    """The step being filled under dynamic sampling: since when it waits for its groups,
    and how many zero-variance groups were left out meanwhile."""

    timeout_s: float  # trainer.fill_timeout_s; 0 = wait for a full step however long
    since: float = field(default_factory=time.monotonic)
    left_out: int = 0

    def restart(self, now: float | None = None) -> None:
        """A step was taken (or a wait reported): the next one starts filling now."""
        self.since = time.monotonic() if now is None else now
        self.left_out = 0

    def remaining_s(self, now: float) -> float | None:
        """How long the step may still wait to fill; None: no bound."""
        if not self.timeout_s:
            return None
        return max(0.0, self.since + self.timeout_s - now)

    async def wait(self, ready: asyncio.Event) -> bool:
        """Wait for `ready` (a full step's groups are queued) at most until the timeout:
        True when full, False when the step's time to fill has passed."""
        remaining = self.remaining_s(time.monotonic())
        if remaining is None:
            await ready.wait()
            return True
        try:
            await wait_for(ready.wait(), remaining)
        except TimeoutError:
            return ready.is_set()
        return True

    def empty_handed(self, now: float) -> str:
        """What to log when the time to fill passed with no group to train."""
        waited = now - self.since
        return (
            f"no group whose rewards vary in {waited:.0f} s ({self.left_out} left out as "
            "zero-variance): the tasks may be all solved or all out of the policy's reach; "
            "the step waits on (trainer.fill_timeout_s, trainer.dynamic_sampling)"
        )


# A logged step: (the version it made, a group it trained, the lineage it stepped in).
LoggedStep = tuple[int, str, str]


def read_trained_log(path: Path) -> list[LoggedStep]:
    """trained_groups.log's steps, every life of the trainer (none if there is no log)."""
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        version, group_id, lineage = ([*line.split("\t"), ""])[:3]
        if version.isdigit() and group_id:
            steps.append((int(version), group_id, lineage))
    return steps


@dataclass
class StepGroups:
    """What a step's outcome did to the groups of the book (for the caller's I/O)."""

    trained: list[protocol.TrajectoryGroup] = field(default_factory=list)
    requeued: list[protocol.TrajectoryGroup] = field(default_factory=list)
    doubtful: DoubtfulBatch | None = None


class GroupBook:
    """A trainer's groups: the queue, the gradients waiting for the swarm's step, the
    batches in doubt, and what each group id it has seen became."""

    def __init__(self) -> None:
        self.queue: deque[protocol.TrajectoryGroup] = deque()
        # Groups whose gradients wait in the accumulator for the swarm's next step.
        self.accumulated: list[protocol.TrajectoryGroup] = []
        # Batches whose round failed on this side only: a peer may have trained them.
        self.doubtful: list[DoubtfulBatch] = []
        # Every group id seen (insertion-ordered, bounded): "queued" until its gradients
        # are in an optimizer step, then "trained"; "dropped" when stale or failing a check.
        self.seen: dict[str, Status] = {}
        # Trained groups whose step no checkpoint holds yet, with the version of that step.
        self.undurable: dict[str, int] = {}
        self.checkpointed_version = -1
        self.log: IO[str] | None = None

    # ── what a rollout node hears ─────────────────────────────────────────────────

    def known(self, group_id: str) -> bool:
        return group_id in self.seen

    def status(self, group_id: str) -> Status:
        """What a rollout node holding `group_id` is told: "trained" only once a checkpoint
        here holds its step. A live peer that took the step is not enough: both may die at
        once (the fault suite's "kill both trainers" lost groups that way)."""
        status = self.seen.get(group_id, "unknown")
        if status == "trained" and self.undurable.get(group_id, -1) > self.checkpointed_version:
            return "queued"
        return status

    # ── transitions ───────────────────────────────────────────────────────────────

    def accept(self, group: protocol.TrajectoryGroup) -> None:
        self._remember(group.group_id, "queued")
        self.queue.append(group)

    def drop(self, group_ids: Iterable[str]) -> None:
        """Final: stale, from another lineage, or failing a check."""
        for group_id in group_ids:
            self._remember(group_id, "dropped")

    def take(
        self,
        size: int,
        version: int,
        max_policy_lag: int,
        lineage: protocol.Lineage,
        short: bool = False,
        least: int | None = None,
    ) -> tuple[list[protocol.TrajectoryGroup], list[protocol.TrajectoryGroup]]:
        """A batch of up to `size` fresh groups from the queue front, and the stale ones
        dropped on the way (`take_batch`); a batch short of `least` (default `size`; less
        when replays fill the rest, node/replay.py) stays in the queue (returned empty)
        unless `short` (a step whose time to fill has passed takes what there is).
        Lineage is checked here, not on arrival: a trainer that has yet to catch up with
        the swarm takes its lineage first."""
        batch, stale = take_batch(self.queue, size, version, max_policy_lag, lineage)
        self.drop(g.group_id for g in stale)
        if len(batch) < (size if least is None else least) and not short:
            self.queue.extendleft(reversed(batch))
            batch = []
        return batch, stale

    def requeue(self, groups: list[protocol.TrajectoryGroup]) -> None:
        """Groups whose gradients no step took go back to the queue front."""
        self.queue.extendleft(reversed(groups))

    def stepped(
        self,
        batch: list[protocol.TrajectoryGroup],
        applied: bool,
        discarded: bool,
        in_doubt: str | None,
        version: int,
        deadline: float,
    ) -> StepGroups:
        """Apply a step's outcome to `batch` (the groups it added gradients for) and
        those accumulated before; `version`: the version before the step."""
        self.accumulated += batch
        if discarded and in_doubt:
            held, self.accumulated = self.accumulated, []
            doubt = DoubtfulBatch(in_doubt, version, held, deadline)
            self.doubtful.append(doubt)
            return StepGroups(doubtful=doubt)
        if discarded:
            requeue, self.accumulated = self.accumulated, []
            self.requeue(requeue)
            return StepGroups(requeued=requeue)
        if applied:
            trained, self.accumulated = self.accumulated, []
            return StepGroups(trained=trained)
        # hivemind keeps the gradients for the next epoch (the swarm's target batch is not
        # reached yet): the groups stay accumulated.
        return StepGroups()

    def trained(
        self, groups: list[protocol.TrajectoryGroup], version: int, lineage: str = ""
    ) -> None:
        """These groups' gradients are in the weights `version` of `lineage`; logged so."""
        for group in groups:
            self._remember(group.group_id, "trained")
            self.undurable[group.group_id] = version
            if self.log is not None:
                self.log.write(f"{version}\t{group.group_id}\t{lineage}\n")
        if self.log is not None:
            self.log.flush()

    def checkpointed(self, version: int) -> None:
        """A checkpoint holds the weights of `version`: its steps' groups are durable."""
        self.checkpointed_version = version
        self.undurable = {g: v for g, v in self.undurable.items() if v > version}

    def settle(
        self, marked: set[str], version: int, others: list[int]
    ) -> tuple[list[DoubtfulBatch], list[DoubtfulBatch]]:
        """Settle the doubtful batches (`settle`); those no peer took go back to the queue.
        Returns (trained by a peer, queued again)."""
        trained, again, self.doubtful = settle(
            self.doubtful, marked, version, others, time.monotonic()
        )
        for batch in again:
            self.requeue(batch.groups)
        return trained, again

    def forget_held(self) -> int:
        """Drop every group held but not trained (cut off from the swarm: rollout nodes
        sent them to the trainers they could still reach). They become "unknown", so a
        rollout node that asks offers them again. Returns how many."""
        held = [*self.accumulated, *self.queue, *(g for b in self.doubtful for g in b.groups)]
        self.accumulated, self.queue, self.doubtful = [], deque(), []
        for group in held:
            self.seen.pop(group.group_id, None)
        return len(held)

    def adopt(self, steps: list[LoggedStep], lineage: protocol.Lineage, version: int) -> int:
        """The trainer took a peer's weights, `version` of `lineage` (joining, or catching
        up): the groups of logged `steps` (`read_trained_log`, every life of this trainer)
        those weights hold are trained, durable once a checkpoint here holds them (the
        checkpoint this trainer had is of other weights); groups whose steps no checkpoint
        held and those weights do not hold become "unknown" (offered again). Without the
        first half a trainer killed past its checkpoint, whose peer stepped with it and
        checkpointed, said "unknown" for groups in the weights it took, and they were
        trained twice (the fault suite's "kill both trainers"). Returns how many groups
        were forgotten."""
        # A group trained in two lives (the first's step lost, then trained again) is held
        # if either step is.
        held = {g: v for v, g, step in steps if lineage.holds(step, v, version)}
        forgotten = [g for g in self.undurable if g not in held]
        for group_id in forgotten:
            del self.undurable[group_id]
            self.seen.pop(group_id, None)
        for group_id, step_version in held.items():
            if self.seen.get(group_id) != "trained" or group_id in self.undurable:
                self._remember(group_id, "trained")
                self.undurable[group_id] = step_version
        # sent again meanwhile (it was "unknown" here) and queued: in the weights already
        self.queue = deque(g for g in self.queue if g.group_id not in held)
        self.checkpointed_version = -1
        return len(forgotten)

    def held_ids(self) -> list[str]:
        return [g.group_id for g in [*self.accumulated, *self.queue]]

    # ── the trained log ───────────────────────────────────────────────────────────

    def open_log(
        self, path: Path, resumed_version: int, lineage: protocol.Lineage | None = None
    ) -> None:
        """Append-only: each trained group's id, and the version and lineage of its step.
        On start, the groups of steps the checkpoint resumed from holds (its version
        `resumed_version`, in the history of `lineage`, the one resumed into) count as
        trained, and durable, again; steps of earlier lives past their checkpoints do not."""
        history = lineage or protocol.Lineage()
        if resumed_version > 0:
            for version, group_id, step_lineage in read_trained_log(path):
                if history.holds(step_lineage, version, resumed_version):
                    self._remember(group_id, "trained")
        self.checkpointed_version = max(self.checkpointed_version, resumed_version)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(path, "a")  # noqa: SIM115 (closed by close_log)

    def close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def _remember(self, group_id: str, status: Status) -> None:
        self.seen[group_id] = status
        if len(self.seen) > SEEN_GROUP_IDS:
            del self.seen[next(iter(self.seen))]
