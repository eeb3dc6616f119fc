"""Verified trajectories: what a trainer checks before it trusts a group, beyond its shape.

    SubmitGroup ──sender quarantined?──▶ GroupAck "rejected", reason "quarantined: ..."
                ──protocol.check_group (shapes, vocabulary, lengths)
                ──picked for a reward check? (a share trainer.reward_check_fraction of group ids)
                      ──task rebuilt from its id, every completion re-scored──▶ wrong: "rejected"
                        (awaited: the trainer serves on; past trainer.reward_check_timeout_s
                        given up, the rewards taken as sent, counted `reward_check_timeouts`)
                ──queued ──▶ learner forward: logprob gap > trainer.max_logprob_gap ──▶ "dropped"
    every failed check ──▶ Quarantine.failed(sender) ──▶ quarantined after trainer.quarantine_after
    a quarantined sender's group ──▶ Quarantine.admit: refused; when no other node's group came
        since the quarantine (the trainer's only node): said again every QUARANTINE_REMINDER_S,
        and lifted after QUARANTINE_ALONE_LIFT_S (its failures forgiven)

Rewards are re-checked for the environments `reward_checkers` gives a checker (arithmetic,
"prompt" with your reward function imported here, unless it is sandboxed or verify_rewards
is off, and "reasoning_gym" with its dataset's scorer: one turn, scored from the completion
text alone) when the trainer's
own `[[envs]]` can rebuild the task: a generated task from its id, a task-file task by its
id. Other groups are trained unchecked and counted (`groups_reward_unchecked`): multi-turn
and sandboxed environments score with tools and programs the trainer does not run. A
sample whose reward function failed on the rollout node (its error says "reward ...") must
report 0 and is not re-scored: a timeout there need not repeat here. A re-check runs the
user's code again (`RewardCheck`; async functions on the loop, sync ones in a bridge thread)
bounded as a whole by trainer.reward_check_timeout_s: one that runs past it proves nothing,
so the group trains on the rewards it was sent with, counted. The sender is the node id a
group names: quarantine stops a misbehaving or broken node, not one that forges its name
too. A quarantine that leaves the trainer with nothing to train is never silent nor
for good: a trainer alone with a quarantined node trains nothing either way, while a check
wrong about an honest node (a bound set too tight for its lr) would stop the run.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentjet import protocol
from agentjet.bridge import abandoned, detached
from agentjet.config import EnvConfig, TrainerConfig
from agentjet.logs import RepeatedLog
from agentjet.reasoning_gym_tasks import GymTasks, ScoreError
from agentjet.roles import wait_for
from agentjet.tasks import TaskSource
from sandboxes.envs.arithmetic import score_completion
from sandboxes.envs.prompt import REWARD_ERROR, REWARD_TIMEOUT_S, Rewards

log = logging.getLogger(__name__)

# Sending nodes whose failures are remembered; the oldest is forgotten beyond this (node ids
# come from the wire: a flood of made-up ones must not grow memory without bound).
MAX_TRACKED_NODES = 10_000
# Quarantined nodes a trainer lists in its directory record (the newest): DHT records are small.
MAX_LISTED_NODES = 32
# A quarantine during which no other node's group arrived lifts after this long: the trainer
# trained nothing meanwhile. A forger alone gets quarantine_after more groups checked (and
# refused) per period; an honest node wrongly quarantined costs the run minutes, not its life.
QUARANTINE_ALONE_LIFT_S = 300.0
# How often a trainer whose every sender is quarantined says so again (log and metrics row).
QUARANTINE_REMINDER_S = 60.0
# The settings a user changes when honest groups fail the logprob check.
QUARANTINE_SETTINGS = "trainer.max_logprob_gap (0 = off) or trainer.quarantine_after"
# Sync reward functions given up on and still running (their threads, process-wide) at
# which a trainer starts no re-check until some end, each group counted as timed out and
# taken as sent: a thread cannot be stopped, so a function that never returns would
# otherwise leave one more thread behind per check, for good.
MAX_ABANDONED_REWARD_CHECKS = 32

# Re-scores the completions (token ids) of one task, as the environment scores them; raises
# TimeoutError when a function of the user's ran past its time.
Checker = Callable[[Any, list[list[int]], protocol.Task], Awaitable[list[float]]]


def reward_checkers(
    envs: Sequence[EnvConfig], timeout_s: float = REWARD_TIMEOUT_S
) -> dict[str, Checker]:
    """The environments whose rewards this trainer can recompute, with how (an async reward
    function given `timeout_s` per completion)."""

    credit = next((env.partial_credit for env in envs if env.name == "arithmetic"), 0.0)

    async def arithmetic(
        tokenizer: Any, completions: list[list[int]], task: protocol.Task
    ) -> list[float]:
        return [score_completion(tokenizer, ids, task, credit) for ids in completions]

    checkers: dict[str, Checker] = {"arithmetic": arithmetic}
    for env in envs:
        if env.name == "prompt" and env.verify_rewards and not env.reward_sandbox:
            rewards = Rewards(env.reward_terms(), timeout_s=timeout_s)

            async def prompt(tokenizer: Any, completions: list[list[int]], task: protocol.Task,
                             rewards: Rewards = rewards) -> list[float]:  # fmt: skip
                texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]
                scored = await rewards.score(task, texts)
                if any(s.timed_out for s in scored):
                    raise TimeoutError(f"a reward function ran past {rewards.timeout_s:g} s")
                return [s.reward for s in scored]

            checkers["prompt"] = prompt
        if env.name == "reasoning_gym" and env.verify_rewards and not env.task_file:
            gym = GymTasks.from_config(env)

            async def reasoning_gym(
                tokenizer: Any,
                completions: list[list[int]],
                task: protocol.Task,
                gym: GymTasks = gym,
            ) -> list[float]:
                texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]
                return await detached(lambda: [_gym_score(gym, task, text) for text in texts])

            checkers["reasoning_gym"] = reasoning_gym
    return checkers


def _gym_score(gym: GymTasks, task: protocol.Task, text: str) -> float:
    """A reasoning-gym score as the rollout node gives it (a failed one is 0 there, marked
    as a failed reward and not re-checked; failing only here, it is 0 too)."""
    try:
        return gym.score(task, text)
    except ScoreError:
        return 0.0


def picked_for_reward_check(group_id: str, fraction: float, secret: bytes) -> bool:
    """Whether this group's rewards are re-checked: true for a share `fraction` of group
    ids, decided by a hash of the id and `secret` (the trainer's own, drawn at start, so a
    sender cannot pick ids that escape the check; a test passes a fixed one)."""
    digest = hashlib.sha256(secret + group_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def find_task(
    group: protocol.TrajectoryGroup, sources: Sequence[TaskSource]
) -> protocol.Task | None:
    """The task `group` says it played, rebuilt from this trainer's task sources, or None."""
    for source in sources:
        if source.env == group.env:
            task = source.find(group.task_id)
            if task is not None:
                return task
    return None


async def reward_problem(
    group: protocol.TrajectoryGroup, task: protocol.Task, tokenizer: Any, check: Checker
) -> str | None:
    """Why `group`'s rewards are wrong for `task`, or None when every one is right.

    A sample must show the model the task's prompt: a reward is only right for the question
    that was asked, and a forger could otherwise pair a right answer with another question.
    """
    asks: dict[bytes, bool] = {}  # a group's samples share their prompt: decoded once
    rescored: list[int] = []
    for i, sample in enumerate(group.samples):
        if sample.prompt_ids not in asks:
            prompt = tokenizer.decode(protocol.unpack_ids(sample.prompt_ids).tolist())
            asks[sample.prompt_ids] = all(m["content"] in prompt for m in task.messages())
        if not asks[sample.prompt_ids]:
            return f"sample {i}: the prompt does not ask task {task.id!r}"
        if sample.error.startswith(REWARD_ERROR):
            if sample.reward != 0:
                return f"sample {i}: reward {sample.reward:g} reported for a failed reward"
        else:
            rescored.append(i)
    completions = [protocol.unpack_ids(group.samples[i].completion_ids).tolist() for i in rescored]
    rewards = await check(tokenizer, completions, task) if completions else []
    for i, reward in zip(rescored, rewards, strict=True):
        if reward != group.samples[i].reward:
            return (
                f"sample {i}: reward {group.samples[i].reward:g} reported, {reward:g} on re-check"
            )
    return None


class RewardCheck:
    """A trainer's re-check of rewards on arrival: a share `fraction` of the groups of
    environments it can re-score, picked by `secret` (`picked_for_reward_check`).

    A check that runs past `timeout_s` (sync and async reward functions alike) is given up:
    the group keeps the rewards its node sent, counted (`reward_check_timeouts`) and logged
    once per interval. A sync function given up on still runs in its thread, which cannot
    be stopped (agentjet/bridge.py `detached`): counted while it runs
    (`reward_threads_left`); at MAX_ABANDONED_REWARD_CHECKS of them no check starts.
    """

    def __init__(self, envs: Sequence[EnvConfig], config: TrainerConfig, secret: bytes) -> None:
        self.fraction = config.reward_check_fraction
        self.timeout_s = config.reward_check_timeout_s
        self.secret = secret
        self.checkers = reward_checkers(envs, self.timeout_s)
        # Where checked groups' tasks are rebuilt from.
        self.sources = [TaskSource.from_config(env) for env in envs if env.name in self.checkers]
        self.in_check: set[str] = set()  # the ids of the groups being checked now
        self.counts: Counter[str] = Counter()
        self._given_up = RepeatedLog(
            log,
            f"gave up a reward re-check (trainer.reward_check_timeout_s = {self.timeout_s:g} s):"
            " {detail}; the group trains on the rewards its node sent",
            "gave up {count} more reward re-checks in the last {seconds:.0f} s (the last: "
            "{detail}); their groups train on the rewards their nodes sent",
        )

    async def problem(self, group: protocol.TrajectoryGroup, tokenizer: Any) -> str | None:
        """Why `group`'s rewards are wrong; None when they are right, the group is not
        picked, its task is not rebuilt here (counted `groups_reward_unchecked`), or its
        check is given up."""
        check = self.checkers.get(group.env)
        if check is None or not picked_for_reward_check(group.group_id, self.fraction, self.secret):
            return None
        task = find_task(group, self.sources)
        if task is None:
            self.counts["groups_reward_unchecked"] += 1
            return None
        if abandoned() >= MAX_ABANDONED_REWARD_CHECKS:
            self._give_up(group, started=False)
            return None
        self.in_check.add(group.group_id)
        try:
            return await wait_for(reward_problem(group, task, tokenizer, check), self.timeout_s)
        except TimeoutError:
            self._give_up(group)
            return None
        finally:
            self.in_check.discard(group.group_id)

    def metrics(self) -> dict[str, int]:
        """The counts above, and the threads of reward functions given up on still running."""
        return {**self.counts, "reward_threads_left": abandoned()}

    def _give_up(self, group: protocol.TrajectoryGroup, started: bool = True) -> None:
        self.counts["reward_check_timeouts"] += 1
        detail = f"group {group.group_id} from {group.node_id}"
        if left := abandoned():
            detail += f"; {left} sync reward functions given up on still run, in threads that"
            detail += " cannot be stopped"
        if not started:
            detail += f" (at {MAX_ABANDONED_REWARD_CHECKS}, no check starts until some end)"
        self._given_up.note(detail)


def over_gap(gaps: Mapping[str, float], max_gap: float) -> set[str]:
    """The groups whose logprob gap exceeds `max_gap` (0: none, the check is off)."""
    return {g for g, gap in gaps.items() if max_gap and gap > max_gap}


@dataclass(frozen=True)
class Admission:
    """What `Quarantine.admit` says of a group's sender: `refused`, why the group is refused
    (None: checked and trained as any); `lifted` and `reminder`, a line to log and show."""

    refused: str | None = None
    lifted: str | None = None
    reminder: str | None = None


@dataclass
class Quarantine:
    """Failed checks per sending node; a node with `after` failures is quarantined for the
    life of this trainer process (a restart forgives), unless no other node's group arrives
    during `alone_lift_s`: then it lifts, its failures forgiven (0: never). Meanwhile every
    `reminder_s` a refused group brings a reminder. Times are monotonic seconds."""

    after: int
    alone_lift_s: float = QUARANTINE_ALONE_LIFT_S
    reminder_s: float = QUARANTINE_REMINDER_S
    failures: Counter[str] = field(default_factory=Counter)
    reasons: dict[str, str] = field(default_factory=dict)  # quarantined node -> last failure
    since: dict[str, float] = field(default_factory=dict)  # quarantined node -> when
    admitted_at: float = -math.inf  # the last group of a node not quarantined
    reminded_at: float = -math.inf

    def failed(self, node_id: str, reason: str, now: float | None = None) -> bool:
        """Count a failed check of `node_id`'s; True when this one quarantines it."""
        if node_id in self.reasons:
            return False
        if node_id not in self.failures and len(self.failures) >= MAX_TRACKED_NODES:
            oldest = next(iter(self.failures))
            del self.failures[oldest]
            self.reasons.pop(oldest, None)
            self.since.pop(oldest, None)
        self.failures[node_id] += 1
        if self.failures[node_id] < self.after:
            return False
        self.reasons[node_id] = reason
        self.since[node_id] = time.monotonic() if now is None else now
        return True

    def reason(self, node_id: str) -> str | None:
        """Why `node_id` is quarantined, or None when it is not."""
        reason = self.reasons.get(node_id)
        if reason is None:
            return None
        return (
            f"quarantined: {self.failures[node_id]} failed checks"
            f" (trainer.quarantine_after={self.after}), the last: {reason}"
        )

    def consequence(self) -> str:
        """What a quarantine means, in a line for its user."""
        lifts = (
            f"lifts after {self.alone_lift_s:.0f} s without another node's group"
            if self.alone_lift_s
            else "lasts until the trainer restarts"
        )
        return (
            f"its groups are refused; if it is the trainer's only node, training stops (said"
            f" again every {self.reminder_s:.0f} s) and the quarantine {lifts}. If the node is"
            f" honest, change {QUARANTINE_SETTINGS}"
        )

    def admit(self, node_id: str, now: float) -> Admission:
        """The verdict on a group `node_id` sent at `now`."""
        refused = self.reason(node_id)
        if refused is None:
            self.admitted_at = now
            return Admission()
        since = self.since[node_id]
        if self.admitted_at >= since:  # other nodes' groups still arrive: they train
            return Admission(refused)
        alone_s = now - since
        if self.alone_lift_s and alone_s >= self.alone_lift_s:
            del self.reasons[node_id], self.since[node_id], self.failures[node_id]
            self.admitted_at = now
            lifted = (
                f"quarantine of {node_id} lifted after {alone_s:.0f} s in which no other node"
                f" sent a group ({refused}); its groups are checked again"
            )
            return Admission(lifted=lifted)
        if now - self.reminded_at < self.reminder_s:
            return Admission(refused)
        self.reminded_at = now
        lifts = (
            f"lifts in {self.alone_lift_s - alone_s:.0f} s"
            if self.alone_lift_s
            else "lasts until the trainer restarts"
        )
        reminder = (
            f"training stopped: every group arriving is from quarantined node {node_id}"
            f" ({refused}), for {alone_s:.0f} s; the quarantine {lifts}. If the node is"
            f" honest, change {QUARANTINE_SETTINGS}"
        )
        return Admission(refused, reminder=reminder)

    def listed(self) -> list[str]:
        """The newest quarantined nodes, for this trainer's directory record."""
        return list(self.reasons)[-MAX_LISTED_NODES:]
