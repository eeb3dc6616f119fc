"""The trainer role: receive trajectory groups, train with the swarm, publish policy versions.

    rollout ──SubmitGroup──▶ Server ──check, dedupe by group id──▶ queue ──GroupAck──▶ rollout
                                                                      │
    learner task:  groups_per_step fresh groups ──(thread)──▶ Learner.train_step
                   ──▶ gradients averaged with the other trainers (hivemind) ──▶ version v+1
                   ──▶ groups marked trained (GroupStatus, and in the DHT)
                   ──▶ PolicySnapshot (served in chunks: PolicyQuery / WeightChunkRequest)
                   ──▶ checkpoint every N versions ──▶ metrics/trainer.jsonl
    heartbeat:     NodeRecord (endpoint, lineage, version, queue, quarantined) ──▶ the DHT directory

Run with `agentjet node --role trainer [--policy NAME] [--join MULTIADDR]`: its process
(node/trainer_host.py) runs one Trainer per policy it serves. A trainer that joins a running
swarm loads the swarm's weights, optimizer state and version before its first step; one
started on a run dir with checkpoints (and no peer to load from) resumes from the newest,
in a new policy lineage (protocol.Lineage): versions it had published past that checkpoint
are gone, and rollout nodes move to the new lineage's weights. Where each group is lives in
one `GroupBook` (node/groups.py): gradients thrown away (a failed round with peers, or this
trainer fell out of sync) put their groups back in the queue; a round that failed on this
side only leaves its batch in doubt until a peer's mark settles it. Rollout nodes hold
every group until it is trained, and hear "trained" only once the step is durable (a
checkpoint here, or a live peer of the lineage past it), so a trainer that dies loses
nothing. Groups staler than `trainer.max_policy_lag`, or sampled by a lineage these weights
do not descend from, are dropped (acked "stale", counted), not trained.
Groups that fail a check of node/verify.py (a wrong reward on arrival, sampler logprobs
far from the learner's in its forward pass) are never trained: "rejected" or "dropped",
counted, and held against their sending node, which is quarantined after
`trainer.quarantine_after` failures. Blocking torch and DHT work crosses the one bridge
(agentjet/bridge.py `blocking`); the event loop keeps answering peers meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Coroutine
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from agentjet import protocol, rl
from agentjet.bridge import blocking
from agentjet.config import Config
from agentjet.devices import (
    check_fits,
    learner_bytes,
    limit_memory,
    memory_share,
    peak_memory,
)
from agentjet.errors import ModelError
from agentjet.lifeline import CLEANUP_AFTER_CHILD_DEATH_S, watch_children
from agentjet.metrics import MetricsWriter, Rate
from agentjet.roles import supervise, wait_for
from agentjet.tasks import TaskSource
from agentjet.transport import Server
from node import memory
from node.gpu_monitor import metrics as gpu_metrics
from node.groups import Filling, GroupBook, StepGroups, doubt_wait_s, oldest_version
from node.learner import Learner, StepResult, teacher_coefs
from node.lora import merged_weights
from node.members import MemberGate
from node.publisher import Publisher, sealed_bind_endpoint
from node.replay import Replay
from node.rounds import step_share
from node.swarm import Directory, Mark, SwarmOptimizer, attach_when_peered, node_of
from node.teacher import open_teacher_check
from node.verify import (
    Quarantine,
    find_task,
    picked_for_reward_check,
    reward_checkers,
    reward_problem,
)
from node.weights import (
    RESUME_STATE,
    PolicySnapshot,
    prune_checkpoints,
    read_resume_state,
    save_checkpoint,
    snapshot,
)

if TYPE_CHECKING:
    from node.trainer_host import TrainerHost

log = logging.getLogger(__name__)

# Trained groups rollout nodes must keep (spooled) until a checkpoint holds their steps:
# past this many the trainer checkpoints early, whatever trainer.checkpoint_every says.
MAX_UNDURABLE_GROUPS = 512
# Longest prompt+completion accepted from the wire, in tokens (bounds learner memory).
MAX_SEQUENCE_TOKENS = 8192
# Under the run dir: one line per policy lineage this trainer published under (its lives).
LINEAGES_LOG = "lineages.log"
# The trainer's samples/s (progress output, its directory record) is over this many seconds.
SAMPLE_RATE_WINDOW_S = 60.0


class Trainer:
    def __init__(self, config: Config, policy: str = "") -> None:
        """`policy`: the [[policies]] entry this trainer trains ("" without them);
        `config`: that policy's view of the config (agentjet/config.py `policy_view`). Its
        process (node/trainer_host.py) makes the view, names the trainer and lends it what
        the policies it serves share: node keys, the DHT, the base model."""
        self.policy = policy
        self.config = config
        self.run_dir = Path(config.run.dir)
        self.node_id = ""  # set by the host at setup
        self.book = GroupBook()
        self.replay = Replay(config.trainer)
        self.lineage = protocol.Lineage()
        self.quarantine = Quarantine(config.trainer.quarantine_after)
        self.reward_check_secret = os.urandom(16)
        # What this trainer re-checks rewards with, and where it rebuilds their tasks
        # (node/verify.py).
        self.reward_checkers = reward_checkers(config.envs)
        self.task_sources = [
            TaskSource.from_config(env) for env in config.envs if env.name in self.reward_checkers
        ]
        self.samples_per_s = 0.0  # over the last SAMPLE_RATE_WINDOW_S (progress, status)
        self.sample_rate = Rate(SAMPLE_RATE_WINDOW_S)
        # Other live trainers' records, from the last directory read.
        self.other_trainers: dict[str, protocol.NodeRecord] = {}
        self.counts: Counter[str] = Counter()
        self.lag_histogram: Counter[int] = Counter()
        self.version = 0
        self.step_task: asyncio.Task[float] | None = None

    def setup(self, cleanup: ExitStack, host: TrainerHost) -> None:
        cfg = self.config
        self.node_id = host.node_id(self.policy)
        keys = host.keys
        self.device = host.device
        self.compute_dtype = host.compute_dtype
        self.model: Any = host.model_for(cfg.model)
        self.tokenizer = host.tokenizer
        self.vocab_size = int(self.model.config.vocab_size)
        share = memory_share(cfg.trainer.gpu_memory_share, shared=False)
        check_fits(
            "the learner", learner_bytes(self.model), self.device, share, "trainer.gpu_memory_share"
        )
        limit_memory(self.device, share)
        self.model.to(self.device)
        self.gpu = host.gpu
        self.gpus: list[protocol.GpuStats] = []  # the last sample
        resume = read_resume_state(self.run_dir / "checkpoints")
        if resume is not None:
            self._load_params(resume["params"])
        self.dht = host.dht
        self.directory = Directory(self.dht, cfg.swarm, keys, self.policy)
        cleanup.callback(self.directory.withdraw, self.node_id)
        gate = None
        if keys is not None:
            # Only members average with this trainer or download its state (the host made
            # this node one before any optimizer starts).
            gate = MemberGate(self.dht, cfg.swarm.run_id, keys.membership.root_public)
        self.local_batch = local_batch = (
            cfg.trainer.informative_samples_per_step
            or cfg.trainer.groups_per_step * cfg.rollout.group_size
        )
        # Each policy averages in its own hivemind run, with its own trainers only (hivemind
        # refuses "." in its keys' prefixes).
        run_id = f"{cfg.swarm.run_id}_policy_{self.policy}" if self.policy else cfg.swarm.run_id
        self.swarm = SwarmOptimizer(
            msgspec.structs.replace(cfg.swarm, run_id=run_id),
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.trainer.lr,
            weight_decay=cfg.trainer.weight_decay,
            target_batch_size=cfg.swarm.target_batch_size or local_batch,
            dht=self.dht,
            other_trainers=lambda: len(self.other_trainers),
            gate=gate,
            directory=self.directory,
            attach_at_start=cfg.swarm.averagers == "at_start",
        )
        cleanup.callback(self.swarm.shutdown)
        loaded = False
        records: list[protocol.NodeRecord] = []
        if cfg.swarm.initial_peers:
            mine = int(resume["policy_version"]) if resume is not None else 0
            records = self._wait_for_newer_checkpoint(mine)
            self.other_trainers = self._other_trainers_in(records)
            # A peer at this checkpoint's very version counts too: resumed on its own, this
            # trainer would name the weights it then makes in lock step with that peer a
            # lineage of its own, and groups trained under either name would be sent again
            # when that name's trainer dies (the fault suite saw both).
            behind = resume is None or max(self._other_versions(), default=-1) >= mine
            if behind and self.swarm.peered():  # (else alone: nobody to load from)
                log.info("joined the swarm; loading its state from peers")
                loaded = self.swarm.load_state_from_peers(
                    wait_s=cfg.swarm.state_wait_s,  # while another trainer is listed:
                    while_true=lambda: bool(self._other_trainers_in(self.directory.records())),
                )
        resumed = -1
        if loaded:
            self.lineage = self._swarm_lineage()
        else:
            parent, start = protocol.Lineage(), 0  # the base weights
            if resume is not None:
                resumed = start = int(resume["policy_version"])
                self.swarm.restore(resumed, resume["optimizer"])
                parent = msgspec.convert(resume.get("lineage", {}), protocol.Lineage)
            used = self._used_lineages()

            def taken(lineage_id: str) -> bool:
                return lineage_id in used or any(
                    r.lineage.id == lineage_id and r.policy_version > start for r in records
                )

            self.lineage = protocol.open_lineage(parent, start, taken)
            if resume is not None:
                log.info(
                    "resumed from checkpoint: policy version %d, lineage %s",
                    resumed,
                    self.lineage.id,
                )
        self._record_lineage()
        self.version = self.swarm.epoch
        self.book.open_log(self.run_dir / "trained_groups.log", resumed, self.lineage)
        cleanup.callback(self.book.close_log)
        self.learner = Learner(
            self.model,
            self.swarm,
            cfg.trainer,
            temperature=cfg.rollout.sampling.temperature,
            pad_token_id=int(self.tokenizer.pad_token_id or 0),
            compute_dtype=self.compute_dtype,
            teacher_coefs=teacher_coefs(cfg.envs),
            teacher_check=open_teacher_check(
                cfg, self.tokenizer, self.device, self.reward_check_secret
            ),
        )
        self.server = Server(
            cfg.net.trainer_endpoint,
            protocol.trainer_request_decoder,
            cfg.net.max_message_bytes,
            keys,
        )
        cleanup.callback(self.server.close)
        sealed = None
        if keys is not None:  # versions are sealed: their chunks need no CURVE
            sealed = Server(
                sealed_bind_endpoint(self.server.endpoint, cfg.net.sealed_port),
                protocol.trainer_request_decoder,
                cfg.net.max_message_bytes,
            )
            cleanup.callback(sealed.close)
        self.publisher = Publisher(self._snapshot(sealed is not None), cfg.swarm.run_id, sealed)
        self.metrics = MetricsWriter(self.run_dir, "trainer", cfg.log)
        cleanup.callback(self.metrics.close)
        cleanup.callback(self._final_checkpoint)
        self.batch_ready = asyncio.Event()
        self.filling = Filling(cfg.trainer.fill_timeout_s if cfg.trainer.dynamic_sampling else 0)
        self.directory_settled = asyncio.Event()
        self.connected = asyncio.Event()  # the directory lists some other node
        self.connected.set()
        self.endpoint = cfg.swarm.announce_endpoint or self.server.endpoint
        self.publisher.announce(self.endpoint)
        self.maddrs = host.maddrs
        self.metrics.write(
            {
                "event": "started",
                "node_id": self.node_id,
                "policy_version": self.version,
                "policy_sha256": self.publisher.published.sha256,
                "lineage": self.lineage.id,
                "lineage_ancestors": self.lineage.ancestors,
                "joined": bool(cfg.swarm.initial_peers),
            }
        )
        log.info(
            "trainer %s ready: %s, policy version %d (lineage %s), run dir %s, swarm %s",
            self.node_id,
            self.endpoint,
            self.version,
            self.lineage.id,
            self.run_dir.resolve(),
            " ".join(self.maddrs),
        )

    async def run(self, stop: asyncio.Event) -> None:
        sealed: dict[str, Coroutine[Any, Any, None]] = {}
        if self.publisher.sealed is not None:
            sealed["trainer-serve-sealed"] = self.publisher.serve_sealed()
        await supervise(
            stop,
            {
                **sealed,
                "trainer-serve": self._serve(),
                "trainer-learn": self._learn(stop),
                "trainer-heartbeat": self._heartbeat(),
                "trainer-averagers": attach_when_peered(self.swarm, self.config.swarm.heartbeat_s),
                # A step would wait forever on a dead hivemind process (the OOM killer's
                # pick is the largest): the trainer stops, with one line that says so.
                "trainer-children": watch_children(
                    self.swarm.processes(),
                    "trainer",
                    exit_after_s=CLEANUP_AFTER_CHILD_DEATH_S,  # cleanup may hang on the dead
                ),
            },
        )
        # A stop never cuts a step in two: the step in flight, shielded from the learn
        # loop's cancellation, ends (its row, its groups trained, its version published)
        # before cleanup, which would otherwise cancel it after its weights had stepped.
        if self.step_task is not None and not self.step_task.done():
            # A step waiting for its peers, a round or a state download gives that up (its
            # groups are not trained); one computing or applying its gradients ends.
            log.info("stopping: the step in flight ends first")
            self.swarm.stop()
            await asyncio.wait([self.step_task])
            self.step_task.result()  # its error, as the learn loop would have raised it

    async def _heartbeat(self) -> None:
        cfg = self.config
        reads = 0
        unseen_since: float | None = None  # since when no read has held this trainer's record
        while True:
            record = protocol.NodeRecord(
                node_id=self.node_id,
                role="trainer",
                policy=self.policy,
                endpoint=self.endpoint,
                maddrs=self.maddrs,
                policy_version=self.version,
                queue=len(self.book.queue),
                capacity=cfg.trainer.max_queued_groups,
                samples_per_s=self.samples_per_s,
                time=time.time(),
                quarantined=self.quarantine.listed(),
                lineage=self.lineage,
                gpus=self.gpus,
                refused=self.server.refusals()
                | {kind: n for kind, n in self.swarm.refusals().items() if n},
                rounds=self.swarm.round_problem,
            )
            if not await blocking(self.directory.publish, record):
                log.warning("could not store this trainer's record in the DHT")
            records = await blocking(self.directory.records_seen_by, self.node_id)
            if not any(r.node_id == self.node_id for r in records):
                # A read to distrust (a DHT lookup that missed), unless it stays so for a
                # record's whole life: through a cut link, reads time out or find nothing,
                # and others no longer see this trainer either.
                unseen_since = unseen_since or time.monotonic()
                if time.monotonic() - unseen_since >= cfg.swarm.record_ttl_s:
                    self._set_connected(False)
            else:
                unseen_since = None
                self.other_trainers = self._other_trainers_in(records)
                self._step_share()  # (what a step waits for follows the live trainers)
                # Another node's record: not one of this process's other policies, whose
                # records its own DHT peer holds even when cut off from the swarm.
                me = node_of(self.node_id)
                self._set_connected(any(node_of(r.node_id) != me for r in records))
                reads += 1
                if reads == 2:
                    # Our record was up for a heartbeat before this read: every trainer
                    # that started before us is listed, and has had time to list us.
                    self.directory_settled.set()
            await asyncio.sleep(cfg.swarm.heartbeat_s)

    def _final_checkpoint(self) -> None:
        if self.version > self.book.checkpointed_version and self.version > 0:
            if self.withheld:
                log.warning("version %d is withheld: no final checkpoint", self.version)
            else:
                self._checkpoint()
        self.metrics.write(
            {
                "event": "stopped",
                "policy_version": self.version,
                "queued_group_ids": self.book.held_ids(),
                "quarantined": list(self.quarantine.reasons),
                **self._counts(),
            }
        )

    # ── serving ──────────────────────────────────────────────────────────────────

    async def _serve(self) -> None:
        while True:
            envelope, msg = await self.server.recv()
            await self.server.reply(envelope, self._answer(msg))

    def _answer(self, msg: protocol.TrainerRequest) -> protocol.TrainerReply:
        match msg:
            case protocol.Hello():
                return protocol.answer_hello(msg, self.config.swarm.run_id, self.version)
            case protocol.SubmitGroup(group=group, trainer_id=addressed):
                if addressed and addressed != self.node_id:
                    return protocol.Error(
                        code="gone", message=f"this is {self.node_id}, not {addressed}"
                    )
                return self._receive(group)
            case protocol.GroupStatusQuery(group_ids=ids):
                if len(ids) > protocol.MAX_STATUS_IDS:
                    return protocol.Error(
                        code="invalid", message=f"over {protocol.MAX_STATUS_IDS} ids"
                    )
                return protocol.GroupStatus(
                    statuses={g: self.book.status(g) for g in ids},
                    policy_version=self.version,
                    lineage=self.lineage,
                    node_id=self.node_id,
                )
            case protocol.PolicyQuery():
                return self.publisher.info(self.lineage, msg.manifest)
            case protocol.WeightChunkRequest():
                return self.publisher.chunk(msg)
            case protocol.MetricsRequest():
                return self.metrics.recent.answer(msg)
        return protocol.Error(code="unknown", message=f"unexpected {type(msg).__name__}")

    def _receive(self, group: protocol.TrajectoryGroup) -> protocol.GroupAck | protocol.Error:
        def ack(status: str, reason: str = "") -> protocol.GroupAck:
            self.counts[f"groups_{status}"] += 1
            if status == "stale":
                self.book.drop([group.group_id])
            return protocol.GroupAck(
                group_id=group.group_id,
                status=status,  # type: ignore[arg-type]
                policy_version=self.version,
                reason=reason,
            )

        if self.book.known(group.group_id):
            return ack("duplicate")
        if group.policy != self.policy:  # (rollout nodes send a group to its policy's trainers)
            mine = f"policy {self.policy}" if self.policy else "the swarm's one policy"
            return ack(
                "rejected", f"a group of policy {group.policy!r}; this trainer trains {mine}"
            )
        admission = self.quarantine.admit(group.node_id, time.monotonic())
        # A quarantine that leaves this trainer nothing to train: said again, then lifted.
        notices = {"quarantine_lifted": admission.lifted, "quarantine_reminder": admission.reminder}
        for event, line in notices.items():
            if line is not None:
                log.warning("%s", line)
                self.counts[f"{event}s"] += 1
                self.metrics.write({"event": event, "node_id": group.node_id, "message": line})
        if admission.refused is not None:
            self.counts["groups_refused_quarantined"] += 1
            return ack("rejected", admission.refused)
        # Dynamic sampling: a group whose rewards all agree needs no room in the queue
        # (unless a teacher scored it: its tokens teach still).
        left_out = (
            self.config.trainer.dynamic_sampling
            and rl.zero_variance([s.reward for s in group.samples])
            and not (group.env in self.learner.teacher_coefs and group.samples[0].teacher_logprobs)
        )
        queued = len(self.book.queue)
        if queued >= self.config.trainer.max_queued_groups and not left_out:
            self.counts["busy_replies"] += 1
            return protocol.Error(code="busy", message=f"{queued} groups queued")
        problem = protocol.check_group(group, self.vocab_size, MAX_SEQUENCE_TOKENS)
        if problem is not None:
            log.warning("rejected group %s from %s: %s", group.group_id, group.node_id, problem)
            return ack("rejected", problem)
        problem = self._check_rewards(group)
        if problem is not None:
            # Remembered as dropped: a re-send (the ack was lost) is not held against the
            # node twice.
            self.book.drop([group.group_id])
            self.counts["groups_rejected_reward"] += 1
            self._failed_check(group.node_id, f"wrong reward: {problem}")
            return ack("rejected", f"wrong reward: {problem}")
        oldest = oldest_version(group)
        if rl.is_stale(oldest, self.version, self.config.trainer.max_policy_lag):
            self._record_dropped([group.group_id])
            return ack("stale")
        if left_out:
            self.book.drop([group.group_id])
            self.filling.left_out += 1
            self._record_dropped([group.group_id], "zero_variance")
            return ack("zero_variance")
        self.book.accept(group)
        if len(self.book.queue) >= self.replay.fresh_needed(self.version, self.lineage):
            self.batch_ready.set()
        return ack("accepted")

    def _swarm_lineage(self) -> protocol.Lineage:
        """The lineage of the swarm's weights just downloaded: the newest trainer's (this
        trainer's own when none is listed)."""
        records = list(self.other_trainers.values())
        if not records:
            return self.lineage
        return max(records, key=lambda r: r.policy_version).lineage

    def _wait_for_newer_checkpoint(self, mine: int) -> list[protocol.NodeRecord]:
        """The directory's records, once a trainer that saved a checkpoint newer than
        version `mine` is live again (or after swarm.rejoin_wait_s): its steps were
        reported trained, and training on from older weights would lose them."""
        cfg = self.config.swarm
        own = str(self.dht.peer_id)
        newer = max(
            (m.version for peer, m in self.directory.checkpoints().items() if peer != own),
            default=-1,
        )
        records = self.directory.records()
        if newer <= mine or not cfg.rejoin_wait_s:
            return records
        log.warning(
            "another trainer saved version %d, newer than this trainer's %d: waiting up to "
            "%.0f s for it to be live (swarm.rejoin_wait_s)",
            newer,
            mine,
            cfg.rejoin_wait_s,
        )
        deadline = time.monotonic() + cfg.rejoin_wait_s
        while time.monotonic() < deadline:
            if any(r.policy_version >= newer for r in self._other_trainers_in(records).values()):
                return records
            time.sleep(cfg.heartbeat_s)
            records = self.directory.records()
        log.warning("no trainer holding version %d came back; going on from %d", newer, mine)
        return records

    def _used_lineages(self) -> set[str]:
        """The lineages this trainer (any earlier life, same run dir) has published under."""
        path = self.run_dir / LINEAGES_LOG
        return set(path.read_text().split("\n")[:-1]) if path.exists() else set()

    def _record_lineage(self) -> None:
        """Note the current lineage as used, before any version of it is published."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / LINEAGES_LOG, "a") as f:
            f.write(self.lineage.id + "\n")

    def _check_rewards(self, group: protocol.TrajectoryGroup) -> str | None:
        """Why the group's rewards are wrong, when it is picked for a re-check and its task
        can be rebuilt here; else None."""
        fraction = self.config.trainer.reward_check_fraction
        check = self.reward_checkers.get(group.env)
        if check is None or not picked_for_reward_check(
            group.group_id, fraction, self.reward_check_secret
        ):
            return None
        task = find_task(group, self.task_sources)
        if task is None:
            self.counts["groups_reward_unchecked"] += 1
            return None
        return reward_problem(group, task, self.tokenizer, check)

    def _failed_check(self, node_id: str, reason: str) -> None:
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

    # ── learning ─────────────────────────────────────────────────────────────────

    async def _learn(self, stop: asyncio.Event) -> None:
        cfg = self.config
        if cfg.swarm.initial_peers:
            # Step only once this trainer and the others know of each other: two trainers
            # that each step alone from one version would make it two weight sets.
            await self.directory_settled.wait()
        last = time.perf_counter()
        while True:
            if cfg.run.max_steps and self.version >= cfg.run.max_steps:
                # Checked before the first step too: a run resumed at or past the bound
                # trains nothing more.
                log.info(
                    "reached max_steps=%d at policy version %d", cfg.run.max_steps, self.version
                )
                stop.set()
                return
            if not self.connected.is_set():
                await self._sit_out_isolation()
            if self.book.doubtful:
                await self._settle_doubtful()
                with suppress(TimeoutError):  # look at the doubtful batches again soon
                    await wait_for(self.batch_ready.wait(), cfg.swarm.heartbeat_s)
                if not self.batch_ready.is_set():
                    continue
            full = await self.filling.wait(self.batch_ready)
            if not full and not self.book.queue:
                log.warning(self.filling.empty_handed(time.monotonic()))
                self.counts["fill_timeouts_empty"] += 1
                self.filling.restart()
                continue
            if self.withheld or max(self._other_versions(), default=-1) > self.version:
                # Other trainers moved on (or this version is withheld): take the swarm's
                # state (and lineage) first, so the gradients are computed on the weights
                # the swarm holds. A group's own version is no reason: a forged one would
                # make this trainer download the whole state at every step (if the
                # directory lags a real step, the round at the old version fails and
                # hivemind's tracker says the swarm moved on).
                await self._catch_up()
            # A step whose time to fill has passed takes the varied groups it holds.
            groups_per_step = self._step_share()
            batch, stale = self.book.take(
                groups_per_step,
                self.version,
                cfg.trainer.max_policy_lag,
                self.lineage,
                short=not full,
                least=self.replay.fresh_needed(self.version, self.lineage),
            )
            if stale:
                # Too old, or sampled by weights these do not descend from (a lineage that
                # died with its trainer): no importance ratio across lineages.
                foreign = [
                    g for g in stale if not self.lineage.trains(g.lineage, oldest_version(g))
                ]
                self.counts["groups_dropped_lineage"] += len(foreign)
                self.counts["groups_dropped_stale"] += len(stale) - len(foreign)
                self._record_dropped([g.group_id for g in stale])
            if not batch:
                self.batch_ready.clear()
                continue
            replays = self.replay.take(len(batch), self.version, self.lineage)
            # A stop must not cut a step in two (weights stepped, version or row not
            # recorded): the step runs shielded and `run` waits for it before cleanup.
            short = len(batch) + len(replays) < groups_per_step
            shared = groups_per_step < cfg.trainer.groups_per_step
            self.step_task = asyncio.create_task(
                self._step(batch, last, short, replays, shared), name="trainer-step"
            )
            last = await asyncio.shield(self.step_task)
            if len(self.book.queue) >= self.replay.fresh_needed(self.version, self.lineage):
                self.batch_ready.set()  # (the step's groups can fill the next one's rest)
            else:
                self.batch_ready.clear()

    def _step_share(self) -> int:
        """This trainer's groups for the next step: with the global batch one trainer's
        (swarm.target_batch_size = 0), its share of trainer.groups_per_step among the live
        trainers (node/rounds.py `step_share`)."""
        groups_per_step = self.config.trainer.groups_per_step
        if not self.config.swarm.target_batch_size:
            groups_per_step = step_share(groups_per_step, 1 + len(self.other_trainers))
        self.replay.groups_per_step = groups_per_step
        return groups_per_step

    def _other_trainers_in(
        self, records: list[protocol.NodeRecord]
    ) -> dict[str, protocol.NodeRecord]:
        """Other trainers' records, by node id. A record naming this trainer's own peer id
        is its previous life's (restarted on the same identity before that record
        expired): dead, and never to be dialed."""
        own = f"/p2p/{self.dht.peer_id}"
        return {
            r.node_id: r
            for r in records
            if r.role == "trainer"
            and r.policy == self.policy
            and r.node_id != self.node_id
            and not any(m.endswith(own) for m in r.maddrs)
        }

    @property
    def withheld(self) -> bool:
        """The current version's weights may be this trainer's own, not the swarm's (a
        parameter round failed and no peer sent state): not checkpointed nor published."""
        return self.swarm.withheld

    def _other_versions(self) -> list[int]:
        return [r.policy_version for r in self.other_trainers.values()]

    def _set_connected(self, connected: bool) -> None:
        if not self.config.swarm.initial_peers or connected == self.connected.is_set():
            return
        if connected:
            log.info("the swarm is reachable again")
            self.connected.set()
        else:
            log.warning("cut off from the swarm (no other node's record): pausing training")
            self.connected.clear()

    async def _sit_out_isolation(self) -> None:
        """Train nothing while cut off: alone, this trainer would make its own versions.
        Back in touch, it drops what it held (rollout nodes have sent those groups to the
        trainers they could still reach, when its record expired) and catches up."""
        await self.connected.wait()
        dropped = self.book.forget_held()
        self.counts["groups_dropped_isolated"] += dropped
        log.info("dropped %d groups held while cut off; catching up", dropped)
        await self._catch_up()

    async def _catch_up(self) -> None:
        """Take the swarm's current state (weights, optimizer state, version)."""
        downloaded = await blocking(self.swarm.load_state_from_peers)
        if not downloaded:
            return
        if self.swarm.epoch != self.version:
            log.info(
                "caught up with the swarm: policy version %d -> %d", self.version, self.swarm.epoch
            )
            self.counts["catch_ups"] += 1
        self.version = self.swarm.epoch
        lineage = self._swarm_lineage()
        if lineage.id != self.lineage.id:
            # This trainer's own steps since it forked are in no weights that go on: their
            # groups become unknown, so rollout nodes offer them again.
            forgotten = self.book.abandon_undurable()
            log.warning(
                "took the swarm's weights (lineage %s); %d groups of this trainer's own "
                "lineage %s go back to rollout nodes",
                lineage.id,
                forgotten,
                self.lineage.id,
            )
            self.lineage = lineage
            self._record_lineage()
            self.replay.clear()  # no importance ratio across lineages
        if self.withheld:
            log.info("version %d is a peer's withheld one: withheld here too", self.version)
        else:
            await self._publish()
        self.metrics.write(
            {
                "event": "caught_up",
                "policy_version": self.version,
                "version_withheld": self.withheld,
                "lineage": self.lineage.id,
                "lineage_ancestors": self.lineage.ancestors,
                "policy_sha256": self.publisher.published.sha256,
            }
        )

    async def _publish(self) -> None:
        """Serve the current weights as the current version."""
        self.publisher.retire()  # (its memory is free for the next version)
        self.publisher.publish(await blocking(self._snapshot, self.publisher.sealed is not None))

    def _snapshot(self, seal: bool) -> PolicySnapshot:
        """The current version as rollout nodes load it: in the compute dtype (the engine's),
        sealed with the swarm's keys, made after a step (which handed back the memory it
        freed, else it and the new version would peak together) or a state download; what
        making it freed is handed back after."""
        chunk_bytes = self.config.net.weight_chunk_bytes
        made = snapshot(self.model, self.version, chunk_bytes, self.compute_dtype, seal)
        memory.trim()
        return made

    async def _settle_doubtful(self) -> None:
        """Look up the marks of the doubtful batches; mark trained the groups of those a
        peer stepped with, queue again those no peer took (`groups.settle`)."""
        ids = [batch.batch_id for batch in self.book.doubtful]
        # The other trainers' versions as read before the marks: a trainer listed past a
        # batch's round had stored its marks of that step by then.
        others = self._other_versions()
        try:
            marked = await blocking(self.directory.marked_batches, ids)
        except Exception as e:  # a DHT error: look again at the next turn
            log.info("could not read the marks of doubtful batches: %r", e)
            return
        if any(b.batch_id in marked and self.version <= b.epoch for b in self.book.doubtful):
            await self._catch_up()  # the peer's weights hold them: take those first
        trained, again = self.book.settle(marked, self.version, others)
        for batch in trained:
            # This trainer's weights (version `self.version`) hold the peer's step.
            self.book.trained(batch.groups, self.version, self.lineage.id)
            self.counts["groups_trained_by_peer"] += len(batch.groups)
            log.info(
                "batch %s: a peer stepped with it; %d groups are trained",
                batch.batch_id,
                len(batch.groups),
            )
            self.metrics.write(
                {
                    "event": "trained_by_peer",
                    "batch_id": batch.batch_id,
                    "policy_version": self.version,
                    "lineage": self.lineage.id,
                    "trained_group_ids": [g.group_id for g in batch.groups],
                }
            )
        for batch in again:
            log.info("batch %s: no peer took it; its groups go back", batch.batch_id)
            self.counts["groups_requeued"] += len(batch.groups)
            self.batch_ready.set()

    def _record_dropped(self, group_ids: list[str], why: str = "stale") -> None:
        """A metrics row for groups dropped as `why` ("stale", or "zero_variance": left out
        by dynamic sampling), written before any rollout node hears of it (and deletes its
        copy): a crash right after cannot hide a drop."""
        self.metrics.write(
            {"event": why, "policy_version": self.version, f"{why}_group_ids": group_ids}
        )

    async def _step(
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
        cfg = self.config
        lags = [rl.policy_lag(s.policy_version, self.version) for g in batch for s in g.samples]
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
        self._reject_for_logprobs(batch, result)
        outcome = result.outcome
        self.replay.drop(result.replays_dropped)
        self.counts["replays_dropped_logprobs"] += len(result.replays_dropped)
        replayed = [g.group_id for g in replays if g.group_id not in result.replays_dropped]
        if outcome.discarded:  # their gradients went nowhere: no use
            replayed = []
        replay_stats = self.replay.used(replayed, self.version)
        self.counts["groups_replayed"] += replay_stats.groups
        groups = self.book.stepped(
            [g for g in batch if g.group_id not in result.rejected],
            applied=outcome.applied,
            discarded=outcome.discarded,
            in_doubt=outcome.in_doubt,
            version=self.version,
            deadline=time.monotonic() + doubt_wait_s(cfg.swarm),
        )
        await self._after_step(groups, outcome.epoch, outcome.peer_batches)
        changed = outcome.epoch != self.version
        self.version = outcome.epoch
        if changed:
            if self.withheld:
                log.warning(
                    "version %d may differ from the swarm's: withheld until it takes theirs",
                    self.version,
                )
                self.counts["versions_withheld"] += 1
            else:
                await self._publish()
        now = time.perf_counter()
        self.samples_per_s = self.sample_rate.add(last, now, result.metrics["charts/samples"])
        self.gpus = self.gpu.sample()
        self.metrics.write(
            result.row()
            | {
                "event": "step",
                "lineage": self.lineage.id,
                "trained_group_ids": [g.group_id for g in groups.trained],
                "trained_group_versions": [oldest_version(g) for g in groups.trained],
                # trained again (node/replay.py): already trained, never acknowledged again
                "replayed_group_ids": replayed,
                **replay_stats.row(),
                "replay_buffer_groups": len(self.replay),
                "policy_sha256": self.publisher.published.sha256,
                "charts/staleness_mean": sum(lags) / len(lags),
                "charts/staleness_max": max(lags),
                "perf/s_per_version": now - last,
                "short_step": short,
                # zero-variance groups dynamic sampling left out while this step filled
                "groups_left_out": left_out,
                "perf/samples_per_s": self.samples_per_s,
                "queue": len(self.book.queue),
                **gpu_metrics(self.gpus),
                **peak_memory(self.device),
                **self._counts(),
            }
        )
        due = self.version % cfg.trainer.checkpoint_every == 0
        undurable = len(self.book.undurable) >= MAX_UNDURABLE_GROUPS
        if changed and not self.withheld and (due or undurable):
            await blocking(self._checkpoint)
        return now

    async def _after_step(
        self, groups: StepGroups, version: int, peer_batches: tuple[str, ...]
    ) -> None:
        """Record what a step did to its groups: trained ones in the book and the DHT."""
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
            self.book.trained(groups.trained, version, self.lineage.id)
            self.counts["groups_trained"] += len(groups.trained)
            ids = [g.group_id for g in groups.trained]
            mark = Mark(self.lineage.id, version)
            await blocking(self.directory.mark_trained, ids, mark, peer_batches)

    def _reject_for_logprobs(
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
                self._failed_check(group.node_id, f"{what} over trainer.max_logprob_gap={bound:g}")

    def _checkpoint(self) -> None:
        """Save the policy (an HF folder) and what resuming needs, then mark its steps'
        groups durable. Runs between steps (a worker thread, or shutdown)."""
        root = self.run_dir / "checkpoints"
        directory = root / f"v{self.version:06d}"
        lora = self.config.model.lora_rank > 0
        save_checkpoint(
            self.model.get_base_model() if lora else self.model,
            self.tokenizer,
            directory,
            self.version,
            {"model": self.config.model.name, "time": time.time(), "lineage": self.lineage.id},
            state_dict=merged_weights(self.model, self.config.model) if lora else None,
            resume_state={
                "params": {
                    n: p.detach().to("cpu", copy=True)
                    for n, p in self.model.named_parameters()
                    if p.requires_grad
                },
                "optimizer": self.swarm.optimizer_state(),
                "lineage": msgspec.to_builtins(self.lineage),
            },
        )
        latest = root / "latest.tmp"  # a crash leaves the old name or the new one
        latest.write_text(directory.name + "\n")
        os.replace(latest, root / "latest")
        for older in root.glob(f"v*/{RESUME_STATE}"):
            if older.parent != directory:
                older.unlink()
        prune_checkpoints(root, self.config.trainer.keep_checkpoints)
        self.book.checkpointed(self.version)
        self.directory.record_checkpoint(str(self.dht.peer_id), Mark(self.lineage.id, self.version))
        log.info("checkpoint %s", directory)

    def _load_params(self, params: dict[str, torch.Tensor]) -> None:
        """A checkpoint's trainable parameters into the model (before the optimizer exists)."""
        own = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if own.keys() != params.keys() or any(own[n].shape != t.shape for n, t in params.items()):
            raise ModelError(
                f"the checkpoint in {self.run_dir / 'checkpoints'} was made with another model "
                "or LoRA config; use a new run dir, or the config it was made with"
            )
        with torch.no_grad():
            for name, tensor in params.items():
                own[name].copy_(tensor)

    def _counts(self) -> dict[str, int]:
        return {
            **{f"counts/{k}": v for k, v in self.counts.items()},
            **{f"counts/swarm_{k}": v for k, v in self.swarm.counts().items()},
            "counts/rejected_messages": self.server.rejected,
            "counts/sealed_chunks_served": self.publisher.sealed_served,
            "counts/sealed_requests_refused": self.publisher.sealed_refused,
            "counts/denied_handshakes": self.server.denied,
            **{f"counts/refused_{kind}": n for kind, n in self.server.refused.items()},
        }


def fewest_trainers(
    policies: list[str], records: list[protocol.NodeRecord], count: int = 1
) -> list[str]:
    """The `count` of `policies` the fewest trainers in `records` train (ties: in order)."""
    trainers = Counter(r.policy for r in records if r.role == "trainer")
    return sorted(policies, key=lambda name: trainers[name])[:count]
