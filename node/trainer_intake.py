"""What a trainer takes in: groups from rollout nodes, checked on arrival (and after its
learner's forward pass), and the other requests it answers.

    rollout ──SubmitGroup──▶ Intake.receive: addressed here? known? policy? quarantined?
        room in the queue? well-formed? reward right (node/verify.py RewardCheck)? fresh?
        ──▶ GroupBook queue (or "rejected" / "stale" / "zero_variance", counted)
    rollout, peers ──Hello / GroupStatusQuery / PolicyQuery / WeightChunkRequest /
        MetricsRequest──▶ Intake.answer

A group that fails a check is held against its node (`hold_against`): after
`trainer.quarantine_after` failures the node is quarantined (node/verify.py). The trainer
role (node/trainer.py) serves from its loop and hands every request here; its step
(node/trainer_step.py) hands back the groups the learner left out for their logprobs
(`reject_for_logprobs`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentjet import protocol, rl
from agentjet.config import Config
from agentjet.metrics import MetricsWriter
from node.groups import Filling, GroupBook, oldest_version
from node.learner import StepResult
from node.publisher import Publisher
from node.replay import Replay
from node.verify import Quarantine, RewardCheck

log = logging.getLogger(__name__)

# Longest prompt+completion accepted from the wire, in tokens (bounds learner memory).
MAX_SEQUENCE_TOKENS = 8192


@dataclass
class Head:
    """A trainer's current policy version and the lineage that names its weights, shared by
    the trainer's parts (each reads them; the role and its steps move them)."""

    version: int = 0
    lineage: protocol.Lineage = field(default_factory=protocol.Lineage)


@dataclass
class Intake:
    """Receives groups and answers a trainer's requests (see the module docstring)."""

    config: Config
    policy: str
    node_id: str
    head: Head
    book: GroupBook
    replay: Replay
    quarantine: Quarantine
    reward_check: RewardCheck
    filling: Filling
    batch_ready: asyncio.Event  # set when the queue holds a step's fresh groups
    publisher: Publisher
    metrics: MetricsWriter
    counts: Counter[str]
    tokenizer: Any
    vocab_size: int
    teacher_coefs: dict[str, float]

    def answer(self, msg: protocol.TrainerRequest) -> protocol.TrainerReply:
        """Every request but SubmitGroup (`receive`), answered at once."""
        head = self.head
        match msg:
            case protocol.Hello():
                return protocol.answer_hello(msg, self.config.swarm.run_id, head.version)
            case protocol.GroupStatusQuery(group_ids=ids):
                if len(ids) > protocol.MAX_STATUS_IDS:
                    return protocol.Error(
                        code="invalid", message=f"over {protocol.MAX_STATUS_IDS} ids"
                    )
                return protocol.GroupStatus(
                    statuses={g: self.book.status(g) for g in ids},
                    policy_version=head.version,
                    lineage=head.lineage,
                    node_id=self.node_id,
                )
            case protocol.PolicyQuery():
                return self.publisher.info(head.lineage, msg.manifest)
            case protocol.WeightChunkRequest():
                return self.publisher.chunk(msg)
            case protocol.MetricsRequest():
                return self.metrics.recent.answer(msg)
        return protocol.Error(code="unknown", message=f"unexpected {type(msg).__name__}")

    async def receive(self, msg: protocol.SubmitGroup) -> protocol.GroupAck | protocol.Error:
        """A group offered by a rollout node: queued, or why not (its ack's status)."""
        group, addressed = msg.group, msg.trainer_id
        if addressed and addressed != self.node_id:
            return protocol.Error(code="gone", message=f"this is {self.node_id}, not {addressed}")

        def ack(status: str, reason: str = "") -> protocol.GroupAck:
            self.counts[f"groups_{status}"] += 1
            if status == "stale":
                self.book.drop([group.group_id])
            return protocol.GroupAck(
                group_id=group.group_id,
                status=status,  # type: ignore[arg-type]
                policy_version=self.head.version,
                reason=reason,
            )

        if self.book.known(group.group_id):
            return ack("duplicate")
        if group.group_id in self.reward_check.in_check:  # sent again while it is checked
            self.counts["busy_replies"] += 1
            return protocol.Error(code="busy", message="this group's reward check is running")
        if group.policy != self.policy:  # (rollout nodes send a group to its policy's trainers)
            mine = f"policy {self.policy}" if self.policy else "the swarm's one policy"
            return ack(
                "rejected", f"a group of policy {group.policy!r}; this trainer trains {mine}"
            )
        refused = self._admit(group.node_id)
        if refused is not None:
            self.counts["groups_refused_quarantined"] += 1
            return ack("rejected", refused)
        # Dynamic sampling: a group whose rewards all agree needs no room in the queue
        # (unless a teacher scored it: its tokens teach still).
        left_out = (
            self.config.trainer.dynamic_sampling
            and rl.zero_variance([s.reward for s in group.samples])
            and not (group.env in self.teacher_coefs and group.samples[0].teacher_logprobs)
        )
        queued = len(self.book.queue) + len(self.reward_check.in_check)  # (each holds a place)
        if queued >= self.config.trainer.max_queued_groups and not left_out:
            self.counts["busy_replies"] += 1
            return protocol.Error(code="busy", message=f"{queued} groups queued")
        problem = protocol.check_group(group, self.vocab_size, MAX_SEQUENCE_TOKENS)
        if problem is not None:
            log.warning("rejected group %s from %s: %s", group.group_id, group.node_id, problem)
            return ack("rejected", problem)
        problem = await self.reward_check.problem(group, self.tokenizer)
        if problem is not None:
            # Remembered as dropped: a re-send (the ack was lost) is not held against the
            # node twice.
            self.book.drop([group.group_id])
            self.counts["groups_rejected_reward"] += 1
            self.hold_against(group.node_id, f"wrong reward: {problem}")
            return ack("rejected", f"wrong reward: {problem}")
        version = self.head.version
        if rl.is_stale(oldest_version(group), version, self.config.trainer.max_policy_lag):
            self.record_dropped([group.group_id])
            return ack("stale")
        if left_out:
            self.book.drop([group.group_id])
            self.filling.left_out += 1
            self.record_dropped([group.group_id], "zero_variance")
            return ack("zero_variance")
        self.book.accept(group)
        if len(self.book.queue) >= self.replay.fresh_needed(version, self.head.lineage):
            self.batch_ready.set()
        return ack("accepted")

    def _admit(self, node_id: str) -> str | None:
        """Why a group from `node_id` is refused for its node's quarantine (None: it is
        not). A quarantine that leaves this trainer nothing to train is said again, then
        lifted (node/verify.py `Quarantine.admit`)."""
        admission = self.quarantine.admit(node_id, time.monotonic())
        notices = {"quarantine_lifted": admission.lifted, "quarantine_reminder": admission.reminder}
        for event, line in notices.items():
            if line is not None:
                log.warning("%s", line)
                self.counts[f"{event}s"] += 1
                self.metrics.write({"event": event, "node_id": node_id, "message": line})
        return admission.refused

    def hold_against(self, node_id: str, reason: str) -> None:
        """A group from `node_id` failed a check: counted toward its quarantine."""
        log.warning("a group from %s failed a check: %s", node_id, reason)
        if self.quarantine.failed(node_id, reason):
            why = self.quarantine.reason(node_id)
            log.warning("node %s is %s: %s", node_id, why, self.quarantine.consequence())
            self.counts["nodes_quarantined"] += 1
            self.counts["replays_dropped_quarantine"] += self.replay.forget_node(node_id)
            self.metrics.write(
                {
                    "event": "quarantined",
                    "node_id": node_id,
                    "reason": why,
                    "message": self.quarantine.consequence(),
                }
            )

    def reject_for_logprobs(
        self, batch: list[protocol.TrajectoryGroup], result: StepResult
    ) -> None:
        """The groups the learner left out for their logprob gap or their teacher logprobs':
        dropped, held against their nodes."""
        bound = self.config.trainer.max_logprob_gap
        for group in batch:
            if group.group_id in result.rejected:
                self.book.drop([group.group_id])
                teacher_gap = result.teacher_gaps.get(group.group_id)
                if teacher_gap is not None and teacher_gap > bound:
                    self.counts["groups_rejected_teacher"] += 1
                    what = f"teacher logprob gap {teacher_gap:.3g}"
                else:
                    self.counts["groups_rejected_logprobs"] += 1
                    what = f"logprob gap {result.logprob_gaps[group.group_id]:.3g}"
                self.hold_against(group.node_id, f"{what} over trainer.max_logprob_gap={bound:g}")

    def record_dropped(self, group_ids: list[str], why: str = "stale") -> None:
        """A metrics row for groups dropped as `why` ("stale", or "zero_variance": left out
        by dynamic sampling), written before any rollout node hears of it (and deletes its
        copy): a crash right after cannot hide a drop."""
        self.metrics.write(
            {"event": why, "policy_version": self.head.version, f"{why}_group_ids": group_ids}
        )
