"""How long a trainer waits for its peers' gradients, sized from what it measures, and
what it says when its rounds keep failing.

Two trainers fed by the same rollout nodes finish their batches at different times: how
far apart depends on how long a step takes here, which on a busy box is ten times what it
is on an idle one. A trainer whose batch is ready waits for the other live trainers'
batches (node/rendezvous.py `Rendezvous.meet`) up to `RoundPace.wait_s`: a few of
its own measured step cycles, never less than `swarm.averaging_timeout_s`. A fixed wait
shorter than that spread fails every round on a busy box (issue 47: 2 rounds of 24 in
20 minutes), and each failure throws a computed batch away.

`RoundTimeout` sizes how long one gradient round may take from the rounds that
succeeded: a fixed `swarm.averaging_timeout_s` that fits an idle box's all-reduce of the
full model does not fit a busy box's (bench/LOG.md, 2026-12-06: "no round within 30 s,
still running allreduce"), and one that fits a busy box holds an idle box's dead rounds
for minutes.

`RoundTrouble` turns a streak of failed rounds into one warning that names the cause the
trainer sees and the setting to change, and a line for `agentjet status`.

`StepOutcome` is what one optimizer step did, as `SwarmOptimizer.step_outcome` (and its
in-process twin for a lone trainer, node/local_optimizer.py) returns it.

`step_share` splits one step's groups between the live trainers: a policy version is
`trainer.groups_per_step` groups whatever the number of trainers, so a second trainer
halves each one's work instead of doubling the groups a version waits for (with both
taking whole batches, two trainers fed by the same rollout nodes made versions at half a
lone trainer's pace at best).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

# The wait for the other trainers' batches covers this many of this trainer's step cycles
# (a cycle: from one step to the next, waiting for groups included): the others, fed by
# the same rollout nodes, finish theirs within about one.
ROUND_WAIT_CYCLES = 2.0
# ... and never more than this (a live peer that has not sent a batch for so long is
# starved of groups, not late; the round is given up and tried again at the next step).
MAX_ROUND_WAIT_S = 600.0
# Weight of the newest cycle in the running mean (the box's load changes over minutes).
CYCLE_EMA_WEIGHT = 0.3
# A gradient round may take this many times the running mean of the rounds that succeeded
# (hivemind's own advice for averaging_timeout: about twice an all-reduce) ...
ROUND_TIMEOUT_ROUNDS = 3.0
# ... times this for each round in a row that ran out of time (the box got busier) ...
ROUND_TIMEOUT_BACKOFF = 1.5
# ... never less than swarm.averaging_timeout_s, never more than this.
MAX_ROUND_TIMEOUT_S = 300.0
# A step waiting on a round or a state download looks this often whether the trainer stops.
STOP_POLL_S = 0.25
# This many failed rounds in a row make the trainer say why, once per streak.
TROUBLE_AFTER_FAILURES = 3


@dataclass(frozen=True)
class StepOutcome:
    epoch: int
    applied: bool  # the accumulated gradients went into an optimizer step
    discarded: bool  # they were thrown away (a failed round, or this peer was out of sync)
    # When applied after a round with peers: the batches of those peers whose whole
    # gradients were in it (to mark trained: `Directory.mark_trained`).
    peer_batches: tuple[str, ...] = ()
    # When discarded after a round that may have gone on without this trainer
    # (`RoundFailed.sent`): the id of the batch a peer may have stepped with.
    in_doubt: str | None = None
    # This version's weights may be this trainer's own, not the swarm's (its parameter
    # round failed and no peer sent its state): not to checkpoint or publish.
    withheld: bool = False


def step_share(groups_per_step: int, trainers: int) -> int:
    """The groups one of `trainers` live trainers takes for a step of `groups_per_step`
    (the larger share where they do not divide evenly; at least one)."""
    return max(1, -(-groups_per_step // max(1, trainers)))


@dataclass
class RoundPace:
    """The running mean of a trainer's step cycle, and the wait for peers sized from it."""

    floor_s: float  # swarm.averaging_timeout_s
    cycle_s: float | None = None
    _last: float | None = None

    def step_began(self, now: float | None = None) -> None:
        """A step starts now: the time since the last one is one cycle."""
        now = time.monotonic() if now is None else now
        if self._last is not None:
            cycle = now - self._last
            self.cycle_s = (
                cycle
                if self.cycle_s is None
                else CYCLE_EMA_WEIGHT * cycle + (1 - CYCLE_EMA_WEIGHT) * self.cycle_s
            )
        self._last = now

    @property
    def wait_s(self) -> float:
        measured = ROUND_WAIT_CYCLES * self.cycle_s if self.cycle_s is not None else 0.0
        return min(MAX_ROUND_WAIT_S, max(self.floor_s, measured))


@dataclass
class RoundTimeout:
    """How long a gradient round may take: its matchmaking and, again, its all-reduce
    (hivemind's `averaging_timeout` and `allreduce_timeout`), sized from the rounds that
    succeeded here and stretched after each that ran out of time."""

    floor_s: float  # swarm.averaging_timeout_s
    round_s: float | None = None  # running mean of the rounds that succeeded
    backoff: float = 1.0

    @property
    def s(self) -> float:
        measured = ROUND_TIMEOUT_ROUNDS * self.round_s if self.round_s is not None else 0.0
        return min(MAX_ROUND_TIMEOUT_S, max(self.floor_s, measured) * self.backoff)

    def succeeded(self, took_s: float) -> None:
        self.round_s = (
            took_s
            if self.round_s is None
            else CYCLE_EMA_WEIGHT * took_s + (1 - CYCLE_EMA_WEIGHT) * self.round_s
        )
        self.backoff = 1.0

    def timed_out(self) -> None:
        if self.s < MAX_ROUND_TIMEOUT_S:
            self.backoff *= ROUND_TIMEOUT_BACKOFF


def advice(reason: str) -> str:
    """What a failed round's reason says to change (its text as RoundFailed gives it)."""
    if "still looking for group" in reason:
        return (
            "the trainers' averagers did not find each other in time (a busy box or a slow "
            "link): raise swarm.matchmaking_time_s and swarm.request_timeout_s"
        )
    if "never came" in reason or "TimeoutError" in reason or "a peer's gradients" in reason:
        return (
            "a peer's averager answers too slowly (a busy box or a slow link): raise "
            "swarm.averaging_timeout_s, the least a round may take (each part of a round "
            "may take a third of it; rounds that succeed stretch it)"
        )
    if "epochs" in reason:
        return "the trainers are at different versions: the one behind catches up by itself"
    if "no gradient round" in reason or "batches" in reason:
        return (
            "the other trainers' batches come later than this trainer waits (sized from its "
            "step time, at least swarm.averaging_timeout_s): raise that, or check that the "
            "rollout nodes reach every trainer (agentjet status)"
        )
    return "see the trainers' logs; swarm.averaging_timeout_s bounds each round"


@dataclass
class RoundTrouble:
    """Failed gradient rounds in a row; `failed` returns the warning to log once a streak
    reaches TROUBLE_AFTER_FAILURES (then None until a round succeeds again)."""

    streak: int = 0
    problem: str = ""  # for the trainer's record in the directory ("" = rounds work)
    said: bool = field(default=False, repr=False)

    def failed(self, reason: str) -> str | None:
        self.streak += 1
        if self.streak < TROUBLE_AFTER_FAILURES:
            return None
        self.problem = f"{self.streak} gradient rounds failed in a row, the last: {reason}"
        if self.said:
            return None
        self.said = True
        return f"{self.problem}. Likely cause: {advice(reason)}"

    def succeeded(self) -> None:
        self.streak, self.problem, self.said = 0, "", False


class RoundAbandoned(Exception):
    """A step gave up the round it waited on because the trainer stops."""


def result_unless_stopping(future: Any, timeout: float | None, stopping: threading.Event) -> Any:
    """A hivemind future's result, waited for in turns of STOP_POLL_S up to `timeout` (None:
    no bound): RoundAbandoned as soon as `stopping` is set, TimeoutError when the time is up
    (or the future's own error)."""
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    while True:
        if stopping.is_set():
            raise RoundAbandoned("the trainer is stopping")
        try:
            return future.result(min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            if future.done() or time.monotonic() >= deadline:
                raise
