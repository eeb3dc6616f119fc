"""The trainer role: receive trajectory groups, train with the swarm, publish policy versions.

    rollout ──SubmitGroup──▶ Server ──Intake.receive: checks, dedupe by group id──▶ queue
            ◀──GroupAck──                                                        │
    learn loop: groups_per_step fresh groups ──▶ Step.run ──(thread)──▶ Learner.train_step
                ──▶ gradients averaged with the other trainers (hivemind) ──▶ version v+1
                ──▶ groups marked trained (GroupStatus, and in the DHT)
                ──▶ PolicySnapshot (served in chunks: PolicyQuery / WeightChunkRequest)
                ──▶ checkpoint every N versions ──▶ metrics/trainer.jsonl
        between steps: CatchUp.run (peers ahead: the swarm's state), Doubtful.settle
    heartbeat:  NodeRecord (Status.record: endpoint, lineage, version, queue, quarantined)
                ──▶ the DHT directory ──▶ the other trainers of its policy (Peers)

`setup()` wires the parts, each a module of its own: what the trainer takes in
(node/trainer_intake.py), where it starts (trainer_lineage.py), its versions
(trainer_versions.py), its view of the other trainers (trainer_peers.py), its record and
counts (trainer_status.py), catching up with the swarm (trainer_catch_up.py), doubtful
batches (trainer_doubtful.py), its steps (trainer_step.py); `run()` drives them.

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

from agentjet import protocol
from agentjet.config import Config, ModelConfig
from agentjet.devices import check_fits, learner_bytes, limit_memory, memory_share
from agentjet.identity import NodeKeys
from agentjet.lifeline import CLEANUP_AFTER_CHILD_DEATH_S, watch_children
from agentjet.metrics import MetricsWriter
from agentjet.roles import supervise, wait_for
from agentjet.transport import Server
from node.directory import Directory
from node.gpu_monitor import GpuMonitor
from node.groups import TRAINED_LOG, Filling, GroupBook, oldest_version, read_trained_log
from node.learner import Learner, teacher_coefs
from node.local_steps import with_local_steps
from node.members import MemberGate
from node.publisher import sealed_bind_endpoint
from node.replay import Replay
from node.swarm import SwarmOptimizer, attach_when_peered
from node.teacher import open_teacher_check
from node.trainer_catch_up import CatchUp
from node.trainer_doubtful import Doubtful
from node.trainer_intake import Head, Intake
from node.trainer_lineage import join_or_resume, load_params, record_lineage
from node.trainer_peers import Peers
from node.trainer_status import Status
from node.trainer_step import Step
from node.trainer_versions import Versions
from node.verify import Quarantine, RewardCheck
from node.weights import read_resume_state

log = logging.getLogger(__name__)


class Host(Protocol):
    """What a trainer's process (node/trainer_host.py `TrainerHost`) lends each of its
    trainers: its node's name and keys, the DHT, the device, and the shared base model."""

    keys: NodeKeys | None
    device: torch.device
    compute_dtype: torch.dtype
    version_dtype: torch.dtype
    tokenizer: Any
    gpu: GpuMonitor
    dht: Any  # hivemind.DHT (node/dht.py `start_dht`)
    maddrs: list[str]

    def node_id(self, policy: str) -> str: ...

    def model_for(self, model: ModelConfig) -> Any: ...


class Trainer:
    """The trainer of one policy: `setup()` wires its parts, `run()` drives them."""

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
        self.counts: Counter[str] = Counter()
        self.step_task: asyncio.Task[float] | None = None

    def setup(self, cleanup: ExitStack, host: Host) -> None:
        """Wire the trainer's parts: its model and optimizer over the swarm, where it
        starts from, its learner, its sockets and publisher, then the parts its loops drive."""
        cfg = self.config
        self.node_id = host.node_id(self.policy)
        keys = host.keys
        resume = self._open_model(host)
        self.dht = host.dht
        self.directory = Directory(self.dht, cfg.swarm, keys, self.policy)
        cleanup.callback(self.directory.withdraw, self.node_id)
        self.peers = Peers(
            config=cfg,
            policy=self.policy,
            node_id=self.node_id,
            peer_id=str(self.dht.peer_id),
            directory=self.directory,
            replay=self.replay,
        )
        self._open_swarm(cleanup, keys)
        self.head.lineage, resumed = join_or_resume(
            self.swarm,
            self.directory,
            cfg.swarm,
            resume,
            self.run_dir,
            self.peers.others_in,
            self.peers.others,
        )
        record_lineage(self.run_dir, self.head.lineage)
        self.head.version = self.swarm.epoch
        self.book.open_log(self.run_dir / TRAINED_LOG, resumed, self.head.lineage)
        if resumed < 0 and self.head.version > 0:  # the weights are a peer's
            self.book.adopt(
                read_trained_log(self.run_dir / TRAINED_LOG), self.head.lineage, self.head.version
            )
        cleanup.callback(self.book.close_log)
        self.learner = Learner(
            self.model,
            with_local_steps(
                self.swarm,
                [p for p in self.model.parameters() if p.requires_grad],
                cfg.swarm,
                cfg.trainer.lr,
                cfg.trainer.weight_decay,
                lock=self.swarm.step_lock,
            ),
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
        self.endpoint = cfg.swarm.announce_endpoint or self.server.endpoint
        self.publisher.announce(self.endpoint)
        self.batch_ready = asyncio.Event()  # set when the queue holds a step's fresh groups
        self.filling = Filling(cfg.trainer.fill_timeout_s if cfg.trainer.dynamic_sampling else 0)
        self._open_parts(host)
        self.metrics.write(self.status.started_row())
        log.info(
            "trainer %s ready: %s, policy version %d (lineage %s), run dir %s, swarm %s",
            self.node_id,
            self.endpoint,
            self.head.version,
            self.head.lineage.id,
            self.run_dir.resolve(),
            " ".join(host.maddrs),
        )

    def _open_model(self, host: Host) -> dict[str, Any] | None:
        """The model this trainer trains, on its device within its memory share, with the
        run dir's checkpointed parameters loaded; returns that checkpoint's resume state."""
        self.device = host.device
        self.compute_dtype = host.compute_dtype
        self.version_dtype = host.version_dtype
        self.model: Any = host.model_for(self.config.model)
        self.tokenizer = host.tokenizer
        self.vocab_size = int(self.model.config.vocab_size)
        share = memory_share(self.config.trainer.gpu_memory_share, shared=False)
        check_fits(
            "the learner", learner_bytes(self.model), self.device, share, "trainer.gpu_memory_share"
        )
        limit_memory(self.device, share)
        self.model.to(self.device)
        resume = read_resume_state(self.run_dir / "checkpoints")
        if resume is not None:
            load_params(self.model, resume["params"], self.run_dir)
        return resume

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
            other_trainers=lambda: len(self.peers.others),
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
            version_dtype=self.version_dtype,
            swarm=self.swarm,
            book=self.book,
            directory=self.directory,
            peer_id=str(self.dht.peer_id),
        )
        self.publisher = self.versions.open_publisher(sealed)

    def _open_parts(self, host: Host) -> None:
        """The parts the trainer's loops drive: its intake, its status, catching up with
        the swarm, settling doubtful batches, and its steps."""
        self.intake = Intake(
            config=self.config,
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
        self.status = Status(
            config=self.config,
            policy=self.policy,
            node_id=self.node_id,
            endpoint=self.endpoint,
            maddrs=host.maddrs,
            head=self.head,
            book=self.book,
            quarantine=self.quarantine,
            reward_check=self.reward_check,
            counts=self.counts,
            swarm=self.swarm,
            server=self.server,
            publisher=self.publisher,
            gpu=host.gpu,
        )
        self.catch_up = CatchUp(
            run_dir=self.run_dir,
            head=self.head,
            book=self.book,
            replay=self.replay,
            swarm=self.swarm,
            peers=self.peers,
            versions=self.versions,
            publisher=self.publisher,
            metrics=self.metrics,
            counts=self.counts,
        )
        self.doubtful = Doubtful(
            head=self.head,
            book=self.book,
            directory=self.directory,
            peers=self.peers,
            catch_up=self.catch_up.run,
            metrics=self.metrics,
            counts=self.counts,
            batch_ready=self.batch_ready,
        )
        self.step = Step(
            config=self.config,
            head=self.head,
            book=self.book,
            replay=self.replay,
            filling=self.filling,
            learner=self.learner,
            intake=self.intake,
            swarm=self.swarm,
            directory=self.directory,
            versions=self.versions,
            publisher=self.publisher,
            status=self.status,
            metrics=self.metrics,
            counts=self.counts,
            device=self.device,
            local_batch=self.local_batch,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Drive the parts until `stop` (or run.max_steps): serve requests, learn, beat
        the heartbeat, attach the averagers, watch hivemind's processes."""
        sealed: dict[str, Coroutine[Any, Any, None]] = {}
        if self.publisher.sealed is not None:
            sealed["trainer-serve-sealed"] = self.publisher.serve_sealed()
        await supervise(
            stop,
            {
                **sealed,
                "trainer-serve": self._serve(),
                "trainer-learn": self._learn(stop),
                "trainer-heartbeat": self.peers.heartbeat(self.status.record),
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

    def _final_checkpoint(self) -> None:
        if self.head.version > self.book.checkpointed_version and self.head.version > 0:
            if self.withheld:
                log.warning("version %d is withheld: no final checkpoint", self.head.version)
            else:
                self.versions.checkpoint()
        self.metrics.write(self.status.stopped_row())

    @property
    def withheld(self) -> bool:
        """The current version's weights may be this trainer's own, not the swarm's (a
        parameter round failed and no peer sent state): not checkpointed nor published."""
        return self.swarm.withheld

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
        """Between steps: sit out a cut, settle doubtful batches, wait for a step's groups,
        catch up with peers ahead; then take a batch and run its step."""
        cfg = self.config
        if cfg.swarm.initial_peers:
            # Step only once this trainer and the others know of each other: two trainers
            # that each step alone from one version would make it two weight sets.
            await self.peers.settled.wait()
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
            if not self.peers.connected.is_set():
                await self.catch_up.sit_out_isolation()
            if self.book.doubtful:
                await self.doubtful.settle()
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
            if self.withheld or max(self.peers.versions(), default=-1) > self.head.version:
                # Other trainers moved on (or this version is withheld): take the swarm's
                # state (and lineage) first, so the gradients are computed on the weights
                # the swarm holds. A group's own version is no reason: a forged one would
                # make this trainer download the whole state at every step (if the
                # directory lags a real step, the round at the old version fails and
                # hivemind's tracker says the swarm moved on).
                await self.catch_up.run()
            # A step whose time to fill has passed takes the varied groups it holds.
            groups_per_step = self.peers.step_share()
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
                self.step.run(batch, last, short, replays, shared), name="trainer-step"
            )
            last = await asyncio.shield(self.step_task)
            if len(self.book.queue) >= self.replay.fresh_needed(
                self.head.version, self.head.lineage
            ):
                self.batch_ready.set()  # (the step's groups can fill the next one's rest)
            else:
                self.batch_ready.clear()


def fewest_trainers(
    policies: list[str], records: list[protocol.NodeRecord], count: int = 1
) -> list[str]:
    """The `count` of `policies` the fewest trainers in `records` train (ties: in order)."""
    trainers = Counter(r.policy for r in records if r.role == "trainer")
    return sorted(policies, key=lambda name: trainers[name])[:count]
