"""The rollout role: ask for work, play whole episode groups, ship them until acknowledged.

    coordinator ──WorkGrants──▶ produce: env.run_group(engine, tasks, n)  (worker thread)
                                   │   └─▶ GroupReport ──▶ coordinator   (report task)
                                   ▼
                             unacked groups ──SubmitGroup──▶ trainer ──GroupAck──▶ forget
                                   ▲          (deliver task: re-sent until acked)
    trainer ──PolicyInfo / WeightChunks──▶ sync task: assemble, verify sha256 ──▶ loaded
                                           between batches, never mid-episode

Run with `agentjet node --role rollout --config FILE`. Every completion carries the
policy version that sampled it. When `rollout.max_unacked_groups` groups wait for
acknowledgement, the node stops asking for work (backpressure) instead of growing memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from agentjet import protocol, rl
from agentjet.config import AGENT_ENVS, SANDBOXED_ENVS, Config
from agentjet.episode import Episode, SamplingParams
from agentjet.metrics import MetricsWriter
from agentjet.roles import run_role, supervise
from agentjet.tasks import TaskSource, draw_tasks
from agentjet.timeline import Sequence
from agentjet.transport import Client, PeerUnavailable
from node.agents import make_agent_env
from node.model import resolve_model
from node.torch_engine import TorchEngine
from node.weights import WeightAssembly
from sandboxes.envs import Environment, make_env
from sandboxes.pool import SandboxPool, open_pool
from sandboxes.process import ProcessSandbox

log = logging.getLogger(__name__)

# How often the node asks the trainer for a newer policy version (acks also announce one).
POLICY_POLL_S = 1.0
# Back-off bounds when the coordinator or a trainer does not answer.
RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0
# When a trainer's queue is full, offer groups again after this long.
BUSY_RETRY_S = 1.0
# While the coordinator is away, each batch first asks it for this long, then goes local.
FALLBACK_PROBE_S = 1.0
LOCAL_GRANT_PREFIX = "local-"
# Shortest sleep of the delivery loop (timer granularity; avoids spinning).
MIN_WAIT_S = 0.05


@dataclass
class _Pending:
    group: protocol.TrajectoryGroup
    due_at: float = 0.0  # monotonic time of the next (re-)send
    awaiting_ack: bool = False  # sent, and neither acknowledged nor refused as busy


def _model_tokens(episode: Episode) -> int:
    """Tokens the model sampled in an episode (all its sequences)."""
    if episode.sequences:
        return sum(sum(seq.loss_mask) for seq in episode.sequences)
    return sum(episode.loss_mask)


def build_group(
    grant: protocol.WorkGrant, episodes: list[Episode], node_id: str, wall_s: float
) -> protocol.TrajectoryGroup:
    """One sample per episode, or, for episodes made of several sequences (forked agent
    conversations), one per sequence, each naming its episode."""
    advantages = rl.group_advantages([e.reward for e in episodes])
    forked = any(e.sequences for e in episodes)
    samples = []
    for index, (e, advantage) in enumerate(zip(episodes, advantages, strict=True)):
        sequences: list[Sequence | Episode] = [*e.sequences] or [e]
        for seq in sequences:
            samples.append(
                protocol.Sample(
                    prompt_ids=protocol.pack_ids(seq.prompt_ids),
                    completion_ids=protocol.pack_ids(seq.completion_ids),
                    logprobs=protocol.pack_floats(seq.logprobs),
                    loss_mask=protocol.pack_mask(seq.loss_mask),
                    reward=e.reward,
                    advantage=advantage,
                    policy_version=seq.policy_version,
                    turns=e.turns,
                    finish_reason=seq.finish_reason,
                    error=e.error,
                    faults=e.faults,
                    episode=index if forked else -1,
                )
            )
    return protocol.TrajectoryGroup(
        group_id=grant.grant_id,
        grant_id=grant.grant_id,
        node_id=node_id,
        task_id=grant.task.id,
        env=grant.task.env,
        samples=samples,
        created_at=time.time(),
        wall_s=wall_s,
    )


class Rollout:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.node_id = f"rollout-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.unacked: dict[str, _Pending] = {}
        self.reports: asyncio.Queue[protocol.GroupReport] = asyncio.Queue()
        # A complete, verified policy version waiting to be loaded between batches.
        self.ready_weights: tuple[int, str, dict[str, torch.Tensor]] | None = None
        self.counts: defaultdict[str, int] = defaultdict(int)

    def setup(self, cleanup: ExitStack) -> None:
        cfg = self.config
        torch.set_num_threads(cfg.rollout.torch_threads)
        path = resolve_model(cfg.model.name, cfg.model.cache_dir)
        self.engine = TorchEngine(path, dtype=cfg.model.dtype, seed=cfg.run.seed)
        self.pool: SandboxPool | None = None
        if any(env.name in SANDBOXED_ENVS for env in cfg.envs):
            self.pool = open_pool(cfg.sandbox, self.node_id)
            cleanup.callback(self.pool.close)
        self.envs: dict[str, Environment] = {}
        for env in cfg.envs:
            if env.name in AGENT_ENVS:
                factory = ProcessSandbox if self.pool is None else self.pool.lease
                agent_env = make_agent_env(env, cfg.rollout, factory)
                cleanup.callback(agent_env.close)
                self.envs[env.name] = agent_env
            else:
                self.envs[env.name] = make_env(env, self.pool)
        self.sources = [TaskSource.from_config(env) for env in cfg.envs]
        self.rng = random.Random(cfg.run.seed)
        self.coordinator_away = False
        s = cfg.rollout.sampling
        self.params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens
        )
        hello = protocol.Hello(node_id=self.node_id, role="rollout")
        self.coordinator = Client(
            cfg.coordinator.endpoint,
            protocol.coordinator_reply_decoder,
            hello,
            cfg.net.max_message_bytes,
            cfg.net.request_timeout_s,
        )
        cleanup.callback(self.coordinator.close)
        self.trainer = Client(
            cfg.net.trainer_endpoint,
            protocol.trainer_reply_decoder,
            hello,
            cfg.net.max_message_bytes,
            cfg.net.request_timeout_s,
        )
        cleanup.callback(self.trainer.close)
        self.metrics = MetricsWriter(Path(cfg.run.dir), "rollout")
        cleanup.callback(self.metrics.close)
        self.room = asyncio.Event()  # set while unacked groups are below the bound
        self.room.set()
        self.unsent = asyncio.Event()
        self.newer_policy = asyncio.Event()  # a trainer reported a version newer than ours
        self.busy_until = 0.0  # monotonic time before which the trainer said it is full
        log.info("rollout node %s ready (envs: %s)", self.node_id, ", ".join(self.envs))

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await supervise(
                stop,
                {
                    "rollout-produce": self._produce(),
                    "rollout-deliver": self._deliver(),
                    "rollout-report": self._report(),
                    "rollout-weights": self._sync_weights(),
                    "rollout-heartbeat": self._heartbeat(),
                },
            )
        finally:
            self.metrics.write(
                {"event": "stopped", "unacked_group_ids": list(self.unacked), **self.counts}
            )

    # ── producing groups ─────────────────────────────────────────────────────────

    async def _produce(self) -> None:
        cfg = self.config
        while True:
            await self.room.wait()
            grants = await self._request_work()
            self._load_ready_weights()
            by_env: defaultdict[tuple[str, int], list[protocol.WorkGrant]] = defaultdict(list)
            for grant in grants:
                by_env[(grant.task.env, grant.group_size)].append(grant)
            for (env_name, n), env_grants in by_env.items():
                env = self.envs.get(env_name)
                if env is None:
                    for grant in env_grants:
                        self._queue_report(grant, [], 0.0, f"no environment {env_name!r} here")
                    continue
                start = time.perf_counter()
                episodes = await asyncio.to_thread(
                    env.run_group, self.engine, [g.task for g in env_grants], n, self.params
                )
                wall_s = time.perf_counter() - start
                tokens = sum(_model_tokens(e) for eps in episodes for e in eps)
                created: list[str] = []
                for grant, eps in zip(env_grants, episodes, strict=True):
                    if not eps:  # the environment could not finish this task's episodes
                        self._queue_report(grant, [], wall_s / len(env_grants), "no episodes")
                        continue
                    group = build_group(grant, eps, self.node_id, wall_s / len(env_grants))
                    self.unacked[group.group_id] = _Pending(group)
                    created.append(group.group_id)
                    self._queue_report(grant, eps, wall_s / len(env_grants), "")
                self.counts["groups_created"] += len(created)
                self.counts["groups_failed"] += len(env_grants) - len(created)
                rewards = [e.reward for eps in episodes for e in eps] or [0.0]
                faults = Counter(f for eps in episodes for e in eps for f in e.faults)
                for fault, count in faults.items():
                    self.counts[f"sandbox_{fault}"] += count
                self.metrics.write(
                    {
                        "event": "batch",
                        "env": env_name,
                        "group_ids": created,
                        "policy_version": self.engine.policy_version,
                        "charts/reward_mean": sum(rewards) / len(rewards),
                        "perf/gen_tokens_per_s": tokens / wall_s,
                        "perf/samples_per_s": len(rewards) / wall_s,
                        "perf/batch_s": wall_s,
                        "unacked": len(self.unacked),
                        "sandbox/faults": dict(faults),
                        **self._pool_metrics(),
                        **self.counts,
                    }
                )
                self.unsent.set()
            if len(self.unacked) >= cfg.rollout.max_unacked_groups:
                self.room.clear()

    def _pool_metrics(self) -> dict[str, float]:
        if self.pool is None:
            return {}
        stats = self.pool.stats()
        return {
            "sandbox/acquired": stats.acquired,
            "sandbox/waited": stats.waited,
            "sandbox/wait_s": round(stats.wait_s, 3),
            "sandbox/timeouts": stats.timeouts,
            "sandbox/replaced": stats.replaced,
        }

    async def _request_work(self) -> list[protocol.WorkGrant]:
        """Grants from the coordinator; while it does not answer, tasks drawn locally."""
        request = protocol.WorkRequest(
            node_id=self.node_id,
            max_groups=self.config.rollout.groups_per_batch,
            policy_version=self.engine.policy_version,
        )
        delay = RETRY_MIN_S
        while True:
            try:
                reply = await self.coordinator.request(request, self._coordinator_timeout())
            except PeerUnavailable as e:
                if not self.coordinator_away:
                    log.warning("%s; drawing tasks locally until it is back", e)
                self.coordinator_away = True
                return self._local_grants()
            if self.coordinator_away:
                log.info("coordinator is back")
                self.coordinator_away = False
            if isinstance(reply, protocol.WorkGrants) and reply.grants:
                return reply.grants
            if isinstance(reply, protocol.Error):
                log.warning("coordinator refused work request: %s", reply.message)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)

    def _coordinator_timeout(self) -> float | None:
        """Once the coordinator has gone silent, ask it only briefly (the default otherwise)."""
        return FALLBACK_PROBE_S if self.coordinator_away else None

    def _local_grants(self) -> list[protocol.WorkGrant]:
        """The local fallback: uniform tasks from this node's own task sources.

        Their groups are trained like any other; the coordinator never hears of them (it
        has no grant to attach them to), so its scheduler learns nothing from them.
        """
        cfg = self.config
        weights = [e.weight for e in cfg.envs]
        tasks = draw_tasks(self.rng, self.sources, weights, cfg.rollout.groups_per_batch)
        self.counts["local_grants"] += len(tasks)
        return [
            protocol.WorkGrant(
                grant_id=f"{LOCAL_GRANT_PREFIX}{uuid.uuid4().hex}",
                task=task,
                group_size=cfg.rollout.group_size,
                lease_s=0.0,
            )
            for task in tasks
        ]

    def _queue_report(
        self, grant: protocol.WorkGrant, episodes: list[Episode], wall_s: float, error: str
    ) -> None:
        if grant.grant_id.startswith(LOCAL_GRANT_PREFIX):
            return
        errors = [e.error for e in episodes if e.error]
        self.reports.put_nowait(
            protocol.GroupReport(
                node_id=self.node_id,
                grant_id=grant.grant_id,
                rewards=[e.reward for e in episodes],
                completion_tokens=sum(len(e.completion_ids) for e in episodes),
                turns=sum(e.turns for e in episodes) / max(len(episodes), 1),
                wall_s=wall_s,
                failed=bool(error),
                error=error or (errors[0] if errors else ""),
            )
        )

    # ── delivery to the trainer ──────────────────────────────────────────────────

    async def _deliver(self) -> None:
        delay = RETRY_MIN_S
        while True:
            now = time.monotonic()
            due = [p for p in self.unacked.values() if max(p.due_at, self.busy_until) <= now]
            if not due:
                self.unsent.clear()
                next_due = min((p.due_at for p in self.unacked.values()), default=None)
                timeout = None
                if next_due is not None:
                    timeout = max(max(next_due, self.busy_until) - now, MIN_WAIT_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.unsent.wait(), timeout)
                continue
            for pending in due:
                if pending.awaiting_ack:
                    self.counts["groups_resent"] += 1
                pending.awaiting_ack = True
                pending.due_at = time.monotonic() + self.config.rollout.resend_after_s
                try:
                    reply = await self.trainer.request(protocol.SubmitGroup(group=pending.group))
                except PeerUnavailable as e:
                    log.warning("%s; %d groups wait for a trainer", e, len(self.unacked))
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RETRY_MAX_S)
                    break
                delay = RETRY_MIN_S
                if isinstance(reply, protocol.Error) and reply.code == "busy":
                    # The trainer's queue is full: keep every group, offer them again shortly.
                    pending.awaiting_ack = False
                    pending.due_at = time.monotonic()
                    self.busy_until = time.monotonic() + BUSY_RETRY_S
                    self.counts["trainer_busy"] += 1
                    break
                self._on_ack(pending.group.group_id, reply)

    def _on_ack(self, group_id: str, reply: protocol.TrainerReply) -> None:
        match reply:
            case protocol.GroupAck(status=status, reason=reason, policy_version=version):
                self.counts[f"groups_{status}"] += 1
                if version > self.engine.policy_version:
                    self.newer_policy.set()
                if status == "rejected":
                    log.error("trainer rejected group %s: %s", group_id, reason)
            case protocol.Error(message=message):
                self.counts["groups_rejected"] += 1
                log.error("trainer refused group %s: %s", group_id, message)
            case _:
                log.error("unexpected reply to SubmitGroup: %s", type(reply).__name__)
                return
        self.unacked.pop(group_id, None)
        if len(self.unacked) < self.config.rollout.max_unacked_groups:
            self.room.set()

    async def _report(self) -> None:
        while True:
            report = await self.reports.get()
            delay = RETRY_MIN_S
            while True:
                try:
                    reply = await self.coordinator.request(report, self._coordinator_timeout())
                    break
                except PeerUnavailable:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RETRY_MAX_S)
            if isinstance(reply, protocol.Error):
                log.warning("coordinator refused report %s: %s", report.grant_id, reply.message)

    async def _heartbeat(self) -> None:
        interval_s = self.config.coordinator.lease_s / 4  # several beats per lease
        beat = protocol.Heartbeat(node_id=self.node_id, role="rollout")
        while True:
            await asyncio.sleep(interval_s)
            beat.policy_version = self.engine.policy_version
            try:
                await self.coordinator.request(beat, self._coordinator_timeout())
            except PeerUnavailable:
                log.warning("coordinator missed a heartbeat")

    # ── policy versions ──────────────────────────────────────────────────────────

    async def _sync_weights(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.newer_policy.wait(), POLICY_POLL_S)
            self.newer_policy.clear()
            try:
                info = await self.trainer.request(protocol.PolicyQuery())
                if not isinstance(info, protocol.PolicyInfo):
                    continue
                newest = self.ready_weights[0] if self.ready_weights else self.engine.policy_version
                if info.version <= newest:
                    continue
                assembly = WeightAssembly(info.version, info.nbytes, info.sha256, info.num_chunks)
                for index in assembly.missing():
                    chunk = await self.trainer.request(
                        protocol.WeightChunkRequest(version=info.version, index=index)
                    )
                    if not isinstance(chunk, protocol.WeightChunk):
                        raise ValueError(f"chunk {index}: {chunk}")
                    assembly.add(index, chunk.data)
                state = await asyncio.to_thread(assembly.finish)
            except (PeerUnavailable, ValueError) as e:
                log.info("policy fetch interrupted (%s); will retry", e)
                continue
            self.ready_weights = (info.version, info.sha256, state)
            self.metrics.write({"event": "weights_fetched", "policy_version": info.version})

    def _load_ready_weights(self) -> None:
        if self.ready_weights is None:
            return
        version, sha256, state = self.ready_weights
        self.ready_weights = None
        start = time.perf_counter()
        self.engine.load_state_dict(state, version)
        self.metrics.write(
            {
                "event": "weights_loaded",
                "policy_version": version,
                "policy_sha256": sha256,
                "perf/load_s": time.perf_counter() - start,
            }
        )


def main(config: Config) -> int:
    return run_role(Rollout(config), "rollout")
