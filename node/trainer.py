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
(agentjet/bridge.py `blocking`), and a reward re-check's user function is awaited too (each
group is answered from a task of its own, its check bounded by
`trainer.reward_check_timeout_s`): the event loop keeps answering peers meanwhile.
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
from typing import Any, Protocol

import msgspec
import torch

from agentjet import protocol, rl
from agentjet.bridge import blocking
from agentjet.config import Config, ModelConfig
from agentjet.devices import (
    check_fits,
    learner_bytes,
    limit_memory,
    memory_share,
    peak_memory,
)
from agentjet.identity import NodeKeys
from agentjet.lifeline import CLEANUP_AFTER_CHILD_DEATH_S, watch_children
from agentjet.metrics import MetricsWriter, Rate
from agentjet.roles import supervise, wait_for
from agentjet.transport import Server
from node import memory
from node.dht import node_of
from node.directory import Directory, Mark
from node.gpu_monitor import GpuMonitor
from node.gpu_monitor import metrics as gpu_metrics
from node.groups import Filling, GroupBook, StepGroups, doubt_wait_s, oldest_version
from node.learner import Learner, StepResult, teacher_coefs
from node.members import MemberGate
from node.publisher import sealed_bind_endpoint
from node.replay import Replay, ReplayStats
from node.rounds import StepOutcome, step_share
from node.swarm import SwarmOptimizer, attach_when_peered
from node.teacher import open_teacher_check
from node.trainer_intake import Head, Intake
from node.trainer_lineage import join_or_resume, load_params, record_lineage, swarm_lineage
from node.trainer_versions import Versions
from node.verify import Quarantine, RewardCheck
from node.weights import read_resume_state

log = logging.getLogger(__name__)

# Trained groups rollout nodes must keep (spooled) until a checkpoint holds their steps:
# past this many the trainer checkpoints early, whatever trainer.checkpoint_every says.
MAX_UNDURABLE_GROUPS = 512
# The trainer's samples/s (progress output, its directory record) is over this many seconds.
SAMPLE_RATE_WINDOW_S = 60.0


class Host(Protocol):
    """What a trainer's process (node/trainer_host.py `TrainerHost`) lends each of its
    trainers: its node's name and keys, the DHT, the device, and the shared base model."""

    keys: NodeKeys | None
    device: torch.device
    compute_dtype: torch.dtype
    tokenizer: Any
    gpu: GpuMonitor
    dht: Any  # hivemind.DHT (node/dht.py `start_dht`)
    maddrs: list[str]

    def node_id(self, policy: str) -> str: ...

    def model_for(self, model: ModelConfig) -> Any: ...


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
        # The current version and its lineage, shared with the trainer's parts.
        self.head = Head()
        self.quarantine = Quarantine(config.trainer.quarantine_after)
        self.reward_check_secret = os.urandom(16)
        # Rewards re-checked on arrival (node/verify.py).
        self.reward_check = RewardCheck(config.envs, config.trainer, self.reward_check_secret)
        self.samples_per_s = 0.0  # over the last SAMPLE_RATE_WINDOW_S (progress, status)
        self.sample_rate = Rate(SAMPLE_RATE_WINDOW_S)
        # Other live trainers' records, from the last directory read.
        self.other_trainers: dict[str, protocol.NodeRecord] = {}
        self.counts: Counter[str] = Counter()
        self.lag_histogram: Counter[int] = Counter()
        self.step_task: asyncio.Task[float] | None = None

    def setup(self, cleanup: ExitStack, host: Host) -> None:
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
            load_params(self.model, resume["params"], self.run_dir)
        self.dht = host.dht
        self.directory = Directory(self.dht, cfg.swarm, keys, self.policy)
        cleanup.callback(self.directory.withdraw, self.node_id)
        self._open_swarm(cleanup, keys)
        self.head.lineage, resumed = join_or_resume(
            self.swarm,
            self.directory,
            cfg.swarm,
            resume,
            self.run_dir,
            self._other_trainers_in,
            self.other_trainers,
        )
        record_lineage(self.run_dir, self.head.lineage)
        self.head.version = self.swarm.epoch
        self.book.open_log(self.run_dir / "trained_groups.log", resumed, self.head.lineage)
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
        self._open_serving(cleanup, keys)
        self.metrics = MetricsWriter(self.run_dir, "trainer", cfg.log)
        cleanup.callback(self.metrics.close)
        cleanup.callback(self._final_checkpoint)
        self.batch_ready = asyncio.Event()
        self.filling = Filling(cfg.trainer.fill_timeout_s if cfg.trainer.dynamic_sampling else 0)
        self.directory_settled = asyncio.Event()
        self.connected = asyncio.Event()  # the directory lists some other node
        self.connected.set()
        self.intake = Intake(
            config=cfg,
            policy=self.policy,
            node_id=self.node_id,
            head=self.head,
            book=self.book,
            replay=self.replay,
            quarantine=self.quarantine,
            reward_check=self.reward_check,
            filling=self.filling,
            batch_ready=self.batch_ready,
            publisher=self.publisher,
            metrics=self.metrics,
            counts=self.counts,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            teacher_coefs=self.learner.teacher_coefs,
        )
        self.endpoint = cfg.swarm.announce_endpoint or self.server.endpoint
        self.publisher.announce(self.endpoint)
        self.maddrs = host.maddrs
        self.metrics.write(
            {
                "event": "started",
                "node_id": self.node_id,
                "policy_version": self.head.version,
                "policy_sha256": self.publisher.published.sha256,
                "lineage": self.head.lineage.id,
                "lineage_ancestors": self.head.lineage.ancestors,
                "joined": bool(cfg.swarm.initial_peers),
            }
        )
        log.info(
            "trainer %s ready: %s, policy version %d (lineage %s), run dir %s, swarm %s",
            self.node_id,
            self.endpoint,
            self.head.version,
            self.head.lineage.id,
            self.run_dir.resolve(),
            " ".join(self.maddrs),
        )

    def _open_swarm(self, cleanup: ExitStack, keys: NodeKeys | None) -> None:
        """This trainer's optimizer over the swarm (node/swarm.py), in its policy's own
        hivemind run; with keys, its averagers answer members only."""
        cfg = self.config
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

    def _open_serving(self, cleanup: ExitStack, keys: NodeKeys | None) -> None:
        """The trainer's endpoint (CURVE with keys), the sealed chunks' one, and the
        publisher of its versions, serving the current one."""
        cfg = self.config
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
        self.versions = Versions(
            config=cfg,
            run_dir=self.run_dir,
            head=self.head,
            model=self.model,
            tokenizer=self.tokenizer,
            compute_dtype=self.compute_dtype,
            swarm=self.swarm,
            book=self.book,
            directory=self.directory,
            peer_id=str(self.dht.peer_id),
        )
        self.publisher = self.versions.open_publisher(sealed)

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
                policy_version=self.head.version,
                queue=len(self.book.queue),
                capacity=cfg.trainer.max_queued_groups,
                samples_per_s=self.samples_per_s,
                time=time.time(),
                quarantined=self.quarantine.listed(),
                lineage=self.head.lineage,
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
        if self.head.version > self.book.checkpointed_version and self.head.version > 0:
            if self.withheld:
                log.warning("version %d is withheld: no final checkpoint", self.head.version)
            else:
                self.versions.checkpoint()
        self.metrics.write(
            {
                "event": "stopped",
                "policy_version": self.head.version,
                "queued_group_ids": self.book.held_ids(),
                "quarantined": list(self.quarantine.reasons),
                **self._counts(),
            }
        )

    # ── serving ──────────────────────────────────────────────────────────────────

    async def _serve(self) -> None:
        async def answer_group(envelope: list[bytes], msg: protocol.SubmitGroup) -> None:
            await self.server.reply(envelope, await self.intake.receive(msg))

        # A group is answered from a task of its own: its answer may wait for its reward
        # re-check (a user's function, up to trainer.reward_check_timeout_s), and the loop
        # serves every other request meanwhile.
        async with asyncio.TaskGroup() as groups:
            while True:
                envelope, msg = await self.server.recv()
                if isinstance(msg, protocol.SubmitGroup):
                    groups.create_task(answer_group(envelope, msg))
                else:
                    await self.server.reply(envelope, self.intake.answer(msg))

    # ── learning ─────────────────────────────────────────────────────────────────

    async def _learn(self, stop: asyncio.Event) -> None:
        cfg = self.config
        if cfg.swarm.initial_peers:
            # Step only once this trainer and the others know of each other: two trainers
            # that each step alone from one version would make it two weight sets.
            await self.directory_settled.wait()
        last = time.perf_counter()
        while True:
            if cfg.run.max_steps and self.head.version >= cfg.run.max_steps:
                # Checked before the first step too: a run resumed at or past the bound
                # trains nothing more.
                log.info(
                    "reached max_steps=%d at policy version %d",
                    cfg.run.max_steps,
                    self.head.version,
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
            if self.withheld or max(self._other_versions(), default=-1) > self.head.version:
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
                self.head.version,
                cfg.trainer.max_policy_lag,
                self.head.lineage,
                short=not full,
                least=self.replay.fresh_needed(self.head.version, self.head.lineage),
            )
            if stale:
                # Too old, or sampled by weights these do not descend from (a lineage that
                # died with its trainer): no importance ratio across lineages.
                foreign = [
                    g for g in stale if not self.head.lineage.trains(g.lineage, oldest_version(g))
                ]
                self.counts["groups_dropped_lineage"] += len(foreign)
                self.counts["groups_dropped_stale"] += len(stale) - len(foreign)
                self.intake.record_dropped([g.group_id for g in stale])
            if not batch:
                self.batch_ready.clear()
                continue
            replays = self.replay.take(len(batch), self.head.version, self.head.lineage)
            # A stop must not cut a step in two (weights stepped, version or row not
            # recorded): the step runs shielded and `run` waits for it before cleanup.
            short = len(batch) + len(replays) < groups_per_step
            shared = groups_per_step < cfg.trainer.groups_per_step
            self.step_task = asyncio.create_task(
                self._step(batch, last, short, replays, shared), name="trainer-step"
            )
            last = await asyncio.shield(self.step_task)
            if len(self.book.queue) >= self.replay.fresh_needed(
                self.head.version, self.head.lineage
            ):
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
        if self.swarm.epoch != self.head.version:
            log.info(
                "caught up with the swarm: policy version %d -> %d",
                self.head.version,
                self.swarm.epoch,
            )
            self.counts["catch_ups"] += 1
        self.head.version = self.swarm.epoch
        lineage = swarm_lineage(self.other_trainers.values(), self.head.lineage)
        if lineage.id != self.head.lineage.id:
            # This trainer's own steps since it forked are in no weights that go on: their
            # groups become unknown, so rollout nodes offer them again.
            forgotten = self.book.abandon_undurable()
            log.warning(
                "took the swarm's weights (lineage %s); %d groups of this trainer's own "
                "lineage %s go back to rollout nodes",
                lineage.id,
                forgotten,
                self.head.lineage.id,
            )
            self.head.lineage = lineage
            record_lineage(self.run_dir, self.head.lineage)
            self.replay.clear()  # no importance ratio across lineages
        if self.withheld:
            log.info("version %d is a peer's withheld one: withheld here too", self.head.version)
        else:
            await self.versions.publish()
        self.metrics.write(
            {
                "event": "caught_up",
                "policy_version": self.head.version,
                "version_withheld": self.withheld,
                "lineage": self.head.lineage.id,
                "lineage_ancestors": self.head.lineage.ancestors,
                "policy_sha256": self.publisher.published.sha256,
            }
        )

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
        if any(b.batch_id in marked and self.head.version <= b.epoch for b in self.book.doubtful):
            await self._catch_up()  # the peer's weights hold them: take those first
        trained, again = self.book.settle(marked, self.head.version, others)
        for batch in trained:
            # This trainer's weights (version `self.head.version`) hold the peer's step.
            self.book.trained(batch.groups, self.head.version, self.head.lineage.id)
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
                    "policy_version": self.head.version,
                    "lineage": self.head.lineage.id,
                    "trained_group_ids": [g.group_id for g in batch.groups],
                }
            )
        for batch in again:
            log.info("batch %s: no peer took it; its groups go back", batch.batch_id)
            self.counts["groups_requeued"] += len(batch.groups)
            self.batch_ready.set()

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
            deadline=time.monotonic() + doubt_wait_s(cfg.swarm),
        )
        changed = await self._after_step(groups, outcome)
        now = time.perf_counter()
        self.samples_per_s = self.sample_rate.add(last, now, result.metrics["charts/samples"])
        self.gpus = self.gpu.sample()
        self.metrics.write(
            result.row()
            | {
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
        due = self.head.version % cfg.trainer.checkpoint_every == 0
        undurable = len(self.book.undurable) >= MAX_UNDURABLE_GROUPS
        if changed and not self.withheld and (due or undurable):
            await blocking(self.versions.checkpoint)
        return now

    async def _after_step(self, groups: StepGroups, outcome: StepOutcome) -> bool:
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
        if changed and self.withheld:
            log.warning(
                "version %d may differ from the swarm's: withheld until it takes theirs",
                self.head.version,
            )
            self.counts["versions_withheld"] += 1
        elif changed:
            await self.versions.publish()
        return changed

    def _counts(self) -> dict[str, int]:
        return {
            **{f"counts/{k}": v for k, v in self.counts.items()},
            **{f"counts/{k}": v for k, v in self.reward_check.metrics().items()},
            **{f"counts/swarm_{k}": v for k, v in self.swarm.counts().items()},
            "counts/rejected_messages": self.server.rejected,
            "counts/sealed_chunks_served": self.publisher.sealed_served,
            "counts/sealed_requests_refused": self.publisher.sealed_refused,
            "counts/denied_handshakes": self.server.denied,
            **{f"counts/refused_{kind}": n for kind, n in self.server.refused.items()},
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


def fewest_trainers(
    policies: list[str], records: list[protocol.NodeRecord], count: int = 1
) -> list[str]:
    """The `count` of `policies` the fewest trainers in `records` train (ties: in order)."""
    trainers = Counter(r.policy for r in records if r.role == "trainer")
    return sorted(policies, key=lambda name: trainers[name])[:count]
