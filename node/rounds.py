"""How long a trainer waits for its peers' gradients, sized from what it measures, and
what it says when its rounds keep failing.

Two trainers fed by the same rollout nodes finish their batches at different times: how
far apart depends on how long a step takes here, which on a busy box is ten times what it
is on an idle one. A trainer whose batch is ready waits for the other live trainers'
batches (node/swarm.py `SwarmOptimizer.step_outcome`) up to `RoundPace.wait_s`: a few of
its own measured step cycles, never less than `swarm.averaging_timeout_s`. A fixed wait
shorter than that spread fails every round on a busy box (issue 47: 2 rounds of 24 in
20 minutes), and each failure throws a computed batch away.

`RoundTrouble` turns a streak of failed rounds into one warning that names the cause the
trainer sees and the setting to change, and a line for `agentjet status`.

`step_share` splits one step's groups between the live trainers: a policy version is
`trainer.groups_per_step` groups whatever the number of trainers, so a second trainer
halves each one's work instead of doubling the groups a version waits for (with both
taking whole batches, two trainers fed by the same rollout nodes made versions at half a
lone trainer's pace at best).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# The wait for the other trainers' batches covers this many of this trainer's step cycles
# (a cycle: from one step to the next, waiting for groups included): the others, fed by
# the same rollout nodes, finish theirs within about one.
ROUND_WAIT_CYCLES = 2.0
# ... and never more than this (a live peer that has not sent a batch for so long is
# starved of groups, not late; the round is given up and tried again at the next step).
MAX_ROUND_WAIT_S = 600.0
# Weight of the newest cycle in the running mean (the box's load changes over minutes).
CYCLE_EMA_WEIGHT = 0.3
# This many failed rounds in a row make the trainer say why, once per streak.
TROUBLE_AFTER_FAILURES = 3


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
            "swarm.averaging_timeout_s (each part of a round may take a third of it)"
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
