"""The rollout role: ask for work, play whole episode groups, hold them until trained.

    coordinator ──WorkGrants──▶ produce: await env.run_group(engine, tasks, n)  (on the loop)
                                   │   └─▶ GroupReport ──▶ coordinator   (report task)
                                   ▼
                             Ledger ──SubmitGroup──▶ least backlogged trainer ──GroupAck──▶ held
                                   ◀──GroupStatus: trained──  (deliver task, node/delivery.py)
    newest trainer ──PolicyInfo / WeightChunks──▶ sync task: check each chunk, assemble ──▶ loaded
                                                  between batches, never mid-episode
    swarm directory (DHT) ◀──▶ discover task: own record out; trainers and coordinator in

One event loop (uvloop) runs every task above, the environments' episodes and the agent
environments' OpenAI endpoints included; blocking work (the engine's compute, sandbox
programs, DHT calls, weight assembly) crosses the one bridge to threads (agentjet/bridge.py).

Run with `agentjet node --role rollout [--join MULTIADDR]`. With `--join`, the node finds
trainers and the coordinator in the swarm's DHT directory; without, it uses the endpoints
in its config (one trainer; `agentjet local`). Every completion carries the policy version
that sampled it. When `rollout.max_unacked_groups` groups wait for a trainer to accept
them, or its on-disk spool reaches `rollout.spool_max_bytes`, the node stops asking for
work (backpressure) instead of growing memory or disk. Every group is spooled to disk until
trained (node/spool.py): a node restarted on the same run dir offers its groups again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import socket
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import msgspec
import torch

from agentjet import protocol, rl
from agentjet.bridge import blocking
from agentjet.config import AGENT_ENVS, Config, is_endpoint, policy_names, policy_view
from agentjet.devices import peak_memory
from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.identity import node_keys
from agentjet.logs import RepeatedLog
from agentjet.metrics import MetricsWriter
from agentjet.roles import run_role, supervise, wait_for
from agentjet.tasks import TaskSource, draw_tasks
from agentjet.timeline import Sequence
from agentjet.transport import Client, PeerUnavailable
from node.agents import AgentEnv, make_agent_env
from node.delivery import Ledger, Pending, TrainerPeer
from node.engine import open_engine
from node.gpu_monitor import GpuMonitor
from node.gpu_monitor import metrics as gpu_metrics
from node.held_out import HeldOut
from node.model import resolve_model
from node.policy_sync import PolicySync, PolicyView
from node.relay import RelayPeer, RelayServer, open_relay, relay_peers
from node.spool import Spool, SpoolFull
from node.swarm import Directory, start_dht, visible_maddrs
from node.teacher import open_teachers
from node.trainer_link import answers, probe, trainer_client
from node.trajectory_log import TrajectoryLog
from sandboxes.envs import Environment, PromptEnv, make_env
from sandboxes.envs.prompt import rewards_metrics
from sandboxes.pool import SandboxPool, open_pool
from sandboxes.process import ProcessSandbox

log = logging.getLogger(__name__)

# How often the node asks trainers which of the groups they hold are trained.
STATUS_POLL_S = 1.0
# Back-off bounds when the coordinator does not answer.
RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0
# The trainer of a config without --join (there is no directory to name it); with
# [[policies]], "trainer/NAME" is the trainer of policy NAME.
STATIC_TRAINER = "trainer"
# While the coordinator is away, each batch first asks it for this long, then goes local.
FALLBACK_PROBE_S = 1.0
LOCAL_GRANT_PREFIX = "local-"
# Shortest sleep of the delivery loop (timer granularity; avoids spinning).
MIN_WAIT_S = 0.05


def _model_tokens(episode: Episode) -> int:
    """Tokens the model sampled in an episode (all its sequences)."""
    if episode.sequences:
        return sum(sum(seq.loss_mask) for seq in episode.sequences)
    return sum(episode.loss_mask)


def build_group(
    grant: protocol.WorkGrant,
    episodes: list[Episode],
    node_id: str,
    wall_s: float,
    lineage: str = "",
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
        lineage=lineage,
        policy=grant.policy,
    )


def build_groups(
    grant: protocol.WorkGrant,
    episodes: list[Episode],
    node_id: str,
    wall_s: float,
    lineages: Mapping[str, str],
) -> list[protocol.TrajectoryGroup]:
    """The groups of a grant's episodes: one per policy whose calls they hold (agents may
    call several policies by the `model` field; node/agents.py). The grant's own policy's
    group has the grant's id, another's `<grant id>-<policy>`. Each holds that policy's
    sequences of the episodes it took part in, with the episode's reward or the one the
    agent gave that policy (`Episode.policy_rewards`); `lineages`: each policy's lineage id
    on this node."""
    called = {seq.policy for e in episodes for seq in e.sequences}
    if called <= {grant.policy}:  # (also: environments without agents)
        return [build_group(grant, episodes, node_id, wall_s, lineages.get(grant.policy, ""))]
    groups = []
    for policy in [grant.policy, *sorted(called - {grant.policy})]:
        own = [
            dataclasses.replace(
                e,
                sequences=[q for q in e.sequences if q.policy == policy],
                reward=e.policy_rewards.get(policy, e.reward),
            )
            for e in episodes
        ]
        own = [e for e in own if e.sequences]
        if not own:
            continue  # (the agents called only other policies)
        group = build_group(
            msgspec.structs.replace(grant, policy=policy),
            own,
            node_id,
            wall_s * len(own) / len(episodes),
            lineages.get(policy, ""),
        )
        if policy != grant.policy:
            group.group_id = f"{grant.grant_id}-{policy}"
        groups.append(group)
    return groups


def through_batches(trained: dict[str, str | None]) -> dict[str, str]:
    """Of `Directory.trained`'s answer: the groups known trained only from a peer's mark
    of a batch that held them, each with that batch (for the metrics)."""
    return {g: b for g, b in sorted(trained.items()) if b}


class Rollout:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.node_id = f"rollout-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.ledger = Ledger(rng=random.Random(config.run.seed))
        self.trainers: dict[str, TrainerPeer] = {}
        self.clients: dict[str, Client] = {}
        # Clients of trainers gone or moved: a request may still be in flight on them, so
        # they are closed at shutdown, not when the trainer leaves.
        self.retired: list[Client] = []
        self.coordinator: Client | None = None
        self.missing_since: dict[str, float] = {}  # trainer id -> when its record vanished
        # Each listed trainer's newest record time (its heartbeat, on its clock): one that
        # failed a policy fetch is asked again after a newer one only (PolicySync).
        self.heartbeats: dict[str, float] = {}
        # Trainers found gone, with the endpoint and heartbeat of their last record: that
        # record, read until it expires (record_ttl_s) or by a read that lags, lists them
        # no more; a newer heartbeat or another endpoint does (restarted, moved).
        self.gone: dict[str, tuple[str, float]] = {}
        # Gone trainers whose groups are not settled yet (no trainer live to read their
        # marks against, or marks undecided), with when each was found gone.
        # (With [[policies]], each with its policy: its groups' marks are read against the
        # live trainers of that policy only, whose weights alone can hold their steps.)
        self.departed: dict[str, tuple[float, str]] = {}
        # Each policy's versions on the engine ("": the swarm's one policy).
        self.policies: dict[str, PolicySync] = {}
        self.static_trainers: set[str] = set()  # the trainers of a config without --join
        self.samples_per_s = 0.0
        self.reports: asyncio.Queue[protocol.GroupReport] = asyncio.Queue()
        self.counts: defaultdict[str, int] = defaultdict(int)
        # A trainer that quarantined this node rejects every group it sends: a line, then counts.
        self.rejected_log = RepeatedLog(
            log,
            "trainer rejected group {detail}",
            "trainers rejected {count} more groups in the last {seconds:.0f} s; the last: {detail}",
            level=logging.ERROR,
        )

    def setup(self, cleanup: ExitStack) -> None:
        cfg = self.config
        cleanup.callback(self.rejected_log.flush)
        self.room = asyncio.Event()  # set while unacked groups are below the bound
        self.room.set()
        self.unsent = asyncio.Event()
        self.keys = node_keys(cfg.net, self.node_id)
        if self.keys is not None:  # a node's own key file names it
            self.node_id = self.keys.name
        torch.set_num_threads(cfg.rollout.torch_threads)
        s = cfg.rollout.sampling
        path = resolve_model(cfg.model.name, cfg.model.cache_dir)
        views = {name: policy_view(cfg, name) for name in policy_names(cfg)}
        loras = [view.model for view in views.values()] if cfg.policies else []
        self.engine = open_engine(cfg.model, cfg.rollout, path, cfg.run.seed, loras)
        for name, view in views.items():
            self.policies[name] = PolicySync(
                name, self.engine, view.model, cfg.net, lambda: self.metrics
            )
            cleanup.callback(self.policies[name].interrupted_log.flush)
        self.gpu = GpuMonitor.for_devices([self.engine.device])  # NVML; nothing on CPUs
        cleanup.callback(self.gpu.close)
        self.gpus: list[protocol.GpuStats] = []  # the last sample
        self.pool: SandboxPool | None = None
        if any(env.sandboxed() for env in cfg.envs):
            self.pool = open_pool(cfg.sandbox, self.node_id)
            cleanup.callback(self.pool.close)
        self.envs: dict[str, Environment] = {}
        self.agent_envs: list[AgentEnv] = []
        names = [p.name for p in cfg.policies]  # the policies agents may call by name
        for env in cfg.envs:
            if env.name in AGENT_ENVS:
                factory = ProcessSandbox if self.pool is None else self.pool.lease
                agent_env = make_agent_env(env, cfg.rollout, factory, names)
                self.agent_envs.append(agent_env)  # closed by `run`, on its loop
                self.envs[env.name] = agent_env
            else:
                self.envs[env.name] = make_env(env, self.pool)
        self.sources = [TaskSource.from_config(env) for env in cfg.envs]
        for source in self.sources:
            if source.skipped:
                self.counts[f"tasks_skipped/{source.env}"] = source.skipped
        self.held_out = {name: HeldOut(view) for name, view in views.items()}
        self.trajectories = TrajectoryLog(
            cfg.run.dir,
            cfg.rollout.trajectory_share,
            int(cfg.rollout.trajectory_log_mb * (1 << 20)),
            cfg.run.seed,
        )
        self.rng = random.Random(cfg.run.seed)
        self.coordinator_away = False
        self.params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens
        )
        self.hello = protocol.Hello(node_id=self.node_id, role="rollout")
        self.teachers = open_teachers(
            cfg,
            self.engine.tokenizer,
            self.engine.device,
            self.hello,
            self.keys,
            self.engine.vocab_size,
        )
        cleanup.callback(self._close_clients)
        self.directory: Directory | None = None
        self.relay: RelayServer | None = None  # serves what this node holds to its peers
        self.relays: list[RelayPeer] = []  # the other rollout nodes' relays
        if cfg.swarm.initial_peers:
            dht = start_dht(cfg.swarm, self.keys)
            cleanup.callback(dht.shutdown)
            self.directory = Directory(dht, cfg.swarm, self.keys)
            cleanup.callback(self.directory.withdraw, self.node_id)
            self.maddrs = visible_maddrs(dht)
            # a peer asking for a newer version than this node holds: fetch it now
            newer = self.policies[policy_names(cfg)[0]].newer.set
            self.relay = open_relay(cfg.net, self.maddrs, cfg.swarm.run_id, newer)
            if self.relay is not None:
                cleanup.callback(self.relay.close)
            self._discover_once()
        else:
            self._connect_coordinator(cfg.coordinator.endpoint)
            for name, view in views.items():
                node_id = f"{STATIC_TRAINER}/{name}" if name else STATIC_TRAINER
                self.static_trainers.add(node_id)
                peer = TrainerPeer(node_id, view.net.trainer_endpoint, policy=name)
                self._add_trainer(peer)
        self.metrics = MetricsWriter(Path(cfg.run.dir), "rollout", cfg.log)
        cleanup.callback(self.metrics.close)
        self._restore_spool(cleanup)
        log.info("rollout node %s ready (envs: %s)", self.node_id, ", ".join(self.envs))

    def _restore_spool(self, cleanup: ExitStack) -> None:
        """Open the spool and hold again every group an earlier run of this node left there
        (minus those the swarm's directory says are trained)."""
        cfg = self.config.rollout
        directory = Path(cfg.spool_dir or Path(self.config.run.dir) / "spool")
        spool = Spool(directory, cfg.spool_max_bytes)
        cleanup.callback(spool.close)
        self.ledger.spool = spool
        groups = spool.load()
        trained: dict[str, str | None] = {}
        if groups and self.directory is not None:
            for policy in {g.policy for g, _ in groups}:
                ids = [g.group_id for g, _ in groups if g.policy == policy]
                trained |= self.directory.trained(ids, self._live(policy))
        for group, holder in groups:
            if group.group_id in trained:
                spool.remove(group.group_id)
            else:
                # A trainer the directory lists may have it queued: offered to it only. One
                # it does not list is gone (its record expired), and with it its queue.
                live = holder if holder in self.trainers else None
                # Offered under this node's name: trainers serve a node only as the one its
                # certificate names, and a node holding the root file names itself anew at
                # each start (the spool is this node's own: one node owns it at a time).
                group = msgspec.structs.replace(group, node_id=self.node_id)
                self.ledger.add(group, write=False, holder=live)
        self.counts["groups_restored"] = len(groups) - len(trained)
        self.counts["groups_restored_trained"] = len(trained)
        self.counts["spool_corrupt"] = spool.corrupt
        if groups or spool.corrupt:
            log.info(
                "spool %s: %d groups to offer again, %d already trained, %d corrupt files",
                spool.directory,
                len(groups) - len(trained),
                len(trained),
                spool.corrupt,
            )
        self.metrics.write(
            {
                "event": "restored",
                "group_ids": list(self.ledger.pending),
                "trained_group_ids": sorted(trained),  # per the DHT's marks: not offered
                "trained_through_batches": through_batches(trained),
                **self.counts,
            }
        )

    def _has_room(self) -> bool:
        """Backpressure: room for another batch while few groups wait for a trainer and the
        spool is under its cap; with [[policies]], while some policy has room."""
        return bool(self._with_room())

    def _with_room(self) -> list[str]:
        """The policies with room for another batch: fewer than rollout.max_unacked_groups of
        their groups wait for a trainer (per policy: one whose trainers are all down or
        done must not stop the others), and the spool under its cap."""
        spool = self.ledger.spool
        if spool is not None and spool.full():
            return []
        bound = self.config.rollout.max_unacked_groups
        return [name for name in self.policies if self.ledger.unplaced(name) < bound]

    def _connect_coordinator(self, endpoint: str) -> None:
        if self.coordinator is not None:
            self.retired.append(self.coordinator)
        self.coordinator = Client(
            endpoint,
            protocol.coordinator_reply_decoder,
            self.hello,
            self.config.net.max_message_bytes,
            self.config.net.request_timeout_s,
            self.keys,
        )

    def _add_trainer(self, trainer: TrainerPeer) -> None:
        self.trainers[trainer.node_id] = trainer
        self.clients[trainer.node_id] = trainer_client(
            trainer.endpoint, self.hello, self.config, self.keys, self.config.net.request_timeout_s
        )

    def _close_clients(self) -> None:
        for client in [*self.clients.values(), *self.retired, self.coordinator]:
            if client is not None:
                client.close()

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await supervise(
                stop,
                {
                    "rollout-produce": self._produce(),
                    "rollout-deliver": self._deliver(),
                    "rollout-report": self._report(),
                    **{
                        f"rollout-weights{'-' if name else ''}{name}": sync.run(
                            self.trainers,
                            self.clients,
                            lambda: (self.relay, self.relays),
                            self.heartbeats,
                        )
                        for name, sync in self.policies.items()
                    },
                    "rollout-heartbeat": self._heartbeat(),
                    **({"rollout-discover": self._discover()} if self.directory else {}),
                    **({"rollout-relay": self.relay.serve()} if self.relay else {}),
                },
            )
        finally:
            self.metrics.write(
                {"event": "stopped", "unacked_group_ids": list(self.ledger.pending), **self.counts}
            )
            # Their endpoints run on this loop: stopped here, before it ends.
            await asyncio.gather(*(env.close() for env in self.agent_envs))

    # ── producing groups ─────────────────────────────────────────────────────────

    async def _produce(self) -> None:
        while True:
            await self.room.wait()
            grants = await self._request_work()
            for policy_sync in self.policies.values():
                await policy_sync.load()
            for name, held_out in self.held_out.items():
                view = self._generator(name)
                if held_out.due(view.policy_version):
                    row = await held_out.run(self.envs, view)
                    self.metrics.write({**row, **({"policy": name} if name else {})})
            by_env: defaultdict[tuple[str, int, str], list[protocol.WorkGrant]] = defaultdict(list)
            for grant in grants:
                by_env[(grant.task.env, grant.group_size, grant.policy)].append(grant)
            for (env_name, n, policy), env_grants in by_env.items():
                env = self.envs.get(env_name)
                sync = self.policies.get(policy)
                if env is None or sync is None:
                    what = f"environment {env_name!r}" if env is None else f"policy {policy!r}"
                    for grant in env_grants:
                        self._queue_report(grant, [], 0.0, f"no {what} here")
                    continue
                generator = self._generator(policy)
                start = time.perf_counter()
                episodes = await env.run_group(
                    generator, [g.task for g in env_grants], n, self.params
                )
                wall_s = time.perf_counter() - start
                tokens = sum(_model_tokens(e) for eps in episodes for e in eps)
                created: list[str] = []
                played = []
                lineages = {name: p.lineage.id for name, p in self.policies.items()}
                share_s = wall_s / len(env_grants)
                for grant, eps in zip(env_grants, episodes, strict=True):
                    if not eps:  # the environment could not finish this task's episodes
                        self._queue_report(grant, [], share_s, "no episodes")
                        continue
                    for group in build_groups(grant, eps, self.node_id, share_s, lineages):
                        played.append((grant, eps, group))
                teacher_kls: list[float] = []
                if env_name in self.teachers.envs and played:  # on-policy distillation
                    scored = await self.teachers.score_all([group for _, _, group in played])
                    played = [
                        (g, e, group) for (g, e, _), (group, _) in zip(played, scored, strict=True)
                    ]
                    teacher_kls = [kl for _, kl in scored]
                    self.counts["groups_held_for_teacher"] = self.teachers.held
                for i, (grant, eps, group) in enumerate(played):
                    try:
                        self.ledger.add(group)
                    except SpoolFull as e:  # the batch ran past the cap: keep it in memory
                        log.error("%s; group %s is held in memory only", e, group.group_id)
                        self.ledger.add(group, write=False)
                        self.counts["groups_unspooled"] += 1
                    created.append(group.group_id)
                    self.trajectories.maybe_record(group, self.engine.tokenizer)
                    if i + 1 == len(played) or played[i + 1][0] is not grant:
                        # its groups (one per policy its agents called) are all spooled
                        self._queue_report(grant, eps, share_s, "")
                self.counts["groups_created"] += len(created)
                self.counts["groups_failed"] += sum(1 for eps in episodes if not eps)
                rewards = [e.reward for eps in episodes for e in eps] or [0.0]
                self.samples_per_s = len(rewards) / wall_s
                faults = Counter(f for eps in episodes for e in eps for f in e.faults)
                for fault, count in faults.items():
                    self.counts[f"sandbox_{fault}"] += count
                self.gpus = self.gpu.sample()
                self.metrics.write(
                    {
                        "event": "batch",
                        "env": env_name,
                        **({"policy": policy} if policy else {}),
                        "group_ids": created,
                        # with [[policies]]: whose each group is (agents may call several)
                        **(
                            {"group_policies": {g.group_id: g.policy for _, _, g in played}}
                            if self.config.policies
                            else {}
                        ),
                        "policy_version": generator.policy_version,
                        "lineage": sync.lineage.id,
                        "charts/reward_mean": sum(rewards) / len(rewards),
                        "perf/gen_tokens_per_s": tokens / wall_s,
                        "perf/samples_per_s": len(rewards) / wall_s,
                        "perf/batch_s": wall_s,
                        "unacked": len(self.ledger),
                        "unplaced": self.ledger.unplaced(),
                        "spool_bytes": self.ledger.spool.nbytes if self.ledger.spool else 0,
                        "sandbox/faults": dict(faults),
                        **self._pool_metrics(),
                        **gpu_metrics(self.gpus),
                        **peak_memory(self.engine.device),
                        **rewards_metrics([e for eps in episodes for e in eps]),
                        **(env.metrics() if isinstance(env, PromptEnv | AgentEnv) else {}),
                        **(
                            {"distill/kl_to_teacher": sum(teacher_kls) / len(teacher_kls)}
                            if teacher_kls
                            else {}
                        ),
                        **self.counts,
                    }
                )
                self.unsent.set()
            if not self._has_room():
                self.room.clear()
                spool = self.ledger.spool
                if spool is not None and spool.full():
                    log.warning(
                        "spool %s is full (%.1f MiB): generating no more until trainers train "
                        "held groups",
                        spool.directory,
                        spool.nbytes / 2**20,
                    )

    def _generator(self, policy: str) -> Generator:
        """What an environment samples `policy` with: the engine itself for the swarm's one
        policy, else a view of it that samples with that policy's adapters."""
        return PolicyView(self.engine, policy) if policy else self.engine

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
            policies=self._with_room() if self.config.policies else [],
        )
        delay = RETRY_MIN_S
        while True:
            try:
                if self.coordinator is None:
                    raise PeerUnavailable("no coordinator in the swarm's directory")
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
        has no grant to attach them to), so its scheduler learns nothing from them. With
        [[policies]], each task goes to one of the policies that train its environment, by
        their weights.
        """
        cfg = self.config
        weights = [e.weight for e in cfg.envs]
        tasks = draw_tasks(self.rng, self.sources, weights, cfg.rollout.groups_per_batch)
        self.counts["local_grants"] += len(tasks)
        room = self._with_room()
        return [
            protocol.WorkGrant(
                grant_id=f"{LOCAL_GRANT_PREFIX}{uuid.uuid4().hex}",
                task=task,
                policy=self._local_policy(task.env, room),
                group_size=cfg.rollout.group_size,
                lease_s=0.0,
            )
            for task in tasks
        ]

    def _local_policy(self, env: str, room: list[str]) -> str:
        """A policy with room that trains `env`, by weight ("": none, or no [[policies]])."""
        training = [
            p for p in self.config.policies if (not p.envs or env in p.envs) and p.name in room
        ]
        if not training:
            return ""
        return self.rng.choices([p.name for p in training], [p.weight for p in training])[0]

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

    # ── delivery to trainers ─────────────────────────────────────────────────────

    async def _deliver(self) -> None:
        """Offer groups to trainers, and ask the trainers holding groups which are trained."""
        last_poll = 0.0
        while True:
            self.unsent.clear()
            for pending in self.ledger.to_offer():
                trainer = self.ledger.pick(pending, self.trainers, time.monotonic())
                if trainer is not None:
                    await self._offer(pending, trainer)
            if time.monotonic() - last_poll >= STATUS_POLL_S:
                await self._poll_statuses()
                last_poll = time.monotonic()
            if self._has_room():
                self.room.set()
            with contextlib.suppress(TimeoutError):
                await wait_for(self.unsent.wait(), STATUS_POLL_S)

    async def _offer(self, pending: Pending, trainer: TrainerPeer) -> None:
        group_id = pending.group.group_id
        if pending.state == "unsure":
            self.counts["groups_resent"] += 1
        # A trainer from the directory is asked by its node id (a trainer restarted on its
        # endpoint is another); the one trainer of a config without --join is unnamed.
        addressed = "" if trainer.node_id in self.static_trainers else trainer.node_id
        self.ledger.offering(pending, trainer)
        try:
            reply = await self.clients[trainer.node_id].request(
                protocol.SubmitGroup(group=pending.group, trainer_id=addressed)
            )
        except PeerUnavailable as e:
            self.ledger.unanswered(pending, trainer, time.monotonic())
            log.warning("%s; %d groups wait for a trainer", e, self.ledger.unplaced())
            return
        finally:
            if trainer.node_id not in self.trainers:
                # Found gone while this request was in flight, after its other groups were
                # settled: this one may sit in its queue too (it stays held by it), so it is
                # settled the same way. Left alone it waited for that trainer forever, and a
                # few such groups stopped this node (backpressure) in the fault suite.
                self.departed.setdefault(trainer.node_id, (time.monotonic(), trainer.policy))
        outcome = self.ledger.offered(pending, trainer, reply, time.monotonic())
        self.counts[f"groups_{outcome}"] += 1
        match reply:
            case protocol.GroupAck(policy_version=version):
                self._saw_version(trainer, version)
                if reply.status == "rejected":
                    self.rejected_log.note(f"{group_id}: {reply.reason}")
            case protocol.Error(code="busy"):
                pass
            case protocol.Error(code="gone", message=message):
                log.info("trainer %s was restarted (%s): its groups wait", trainer.node_id, message)
            case protocol.Error(message=message):
                log.error("trainer refused group %s: %s", group_id, message)
            case _:
                log.error("unexpected reply to SubmitGroup: %s", type(reply).__name__)

    async def _poll_statuses(self) -> None:
        for trainer_id, trainer in list(self.trainers.items()):
            held = [p.group.group_id for p in self.ledger.held_by(trainer_id) if p.state == "held"]
            if not held or trainer.blocked_until > time.monotonic():
                continue
            client = self.clients.get(trainer_id)
            if client is None:
                continue  # found gone while an earlier trainer was asked
            try:
                reply = await client.request(
                    protocol.GroupStatusQuery(group_ids=held[: protocol.MAX_STATUS_IDS])
                )
            except PeerUnavailable:
                trainer.block(time.monotonic(), backoff=True)
                continue
            if not isinstance(reply, protocol.GroupStatus):
                log.warning("trainer %s answered GroupStatusQuery with %s", trainer_id, reply)
                continue
            self._saw_version(trainer, reply.policy_version)
            for what, count in self.ledger.statuses(trainer_id, reply.statuses).items():
                self.counts[f"groups_{what}"] += count

    def _saw_version(self, trainer: TrainerPeer, version: int) -> None:
        trainer.policy_version = max(trainer.policy_version, version)
        sync = self.policies.get(trainer.policy)
        if sync is not None:
            sync.saw(version)

    # ── the swarm's directory ────────────────────────────────────────────────────

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(self.config.swarm.heartbeat_s)
            records = await blocking(self._publish_and_read)
            await self._apply_records(records)

    def _publish_and_read(self) -> list[protocol.NodeRecord]:
        assert self.directory is not None
        self.directory.publish(
            protocol.NodeRecord(
                node_id=self.node_id,
                role="rollout",
                endpoint=self.relay.endpoint if self.relay else "",
                maddrs=self.maddrs,
                policy_version=self.engine.policy_version,
                queue=len(self.ledger),
                capacity=self.config.rollout.max_unacked_groups,
                samples_per_s=self.samples_per_s,
                time=time.time(),
                lineage=next(iter(self.policies.values())).lineage,
                gpus=self.gpus,
                policy_versions={n: p.version for n, p in self.policies.items() if n},
            )
        )
        if self.keys is not None:  # this node's DHT peer refuses revoked nodes too
            self.directory.sync_revocations(self.keys.membership)
        return self.directory.records_seen_by(self.node_id)

    def _discover_once(self) -> None:
        """At start: wait briefly for the directory to name a trainer and a coordinator."""
        deadline = time.monotonic() + 3 * self.config.swarm.heartbeat_s
        while True:
            records = self._publish_and_read()
            self.teachers.update(records)
            self._apply_trainers(records, now=time.monotonic())
            self._apply_coordinator(records)
            if (self.trainers and self.coordinator) or time.monotonic() > deadline:
                break
            time.sleep(self.config.swarm.heartbeat_s / 4)
        log.info(
            "swarm directory: %d trainers, coordinator %s",
            len(self.trainers),
            "found" if self.coordinator else "not found (drawing tasks locally)",
        )

    async def _apply_records(self, records: list[protocol.NodeRecord]) -> None:
        if not any(r.node_id == self.node_id for r in records):
            return  # our own record is missing: this read is not to be trusted
        self.relays = relay_peers(records, self.node_id)
        self.teachers.update(records)
        for trainer_id in self._apply_trainers(records, now=time.monotonic()):
            trainer = self.trainers[trainer_id]
            if await answers(trainer.endpoint, trainer_id, self.hello, self.config, self.keys):
                # A directory read can miss a live peer's record (a partial DHT lookup under
                # load): re-sending its groups would train them twice.
                self.missing_since.pop(trainer_id, None)
                log.info("trainer %s is missing from the directory but answers", trainer_id)
                continue
            self._drop_trainer(trainer_id)
        await self._settle_departed()
        self._apply_coordinator(records)

    def _drop_trainer(self, trainer_id: str) -> None:
        """Trainer `trainer_id` is gone: nothing is offered to or fetched from it (a fetch
        in flight ends) until a record of it newer than its last, or at another endpoint."""
        trainer = self.trainers.pop(trainer_id)
        self.missing_since.pop(trainer_id, None)
        self.retired.append(self.clients.pop(trainer_id))
        self.departed[trainer_id] = (time.monotonic(), trainer.policy)
        self.gone[trainer_id] = (trainer.endpoint, self.heartbeats.pop(trainer_id, 0.0))
        for sync in self.policies.values():
            sync.forget(trainer_id)

    def _live(self, policy: str) -> list[tuple[protocol.Lineage, int]]:
        """Each live trainer's of `policy` lineage and version: what the DHT's marks of that
        policy's groups are read against."""
        return [(t.lineage, t.policy_version) for t in self.trainers.values() if t.policy == policy]

    async def _settle_departed(self) -> None:
        """The groups of gone trainers: trained if a durable mark says so (a live trainer's
        weights hold their step), else offered to the live trainers. With no trainer live
        nothing can be told: they wait, held by the gone trainer, until one is. A group whose
        mark a live trainer of the mark's lineage is still behind waits too, for up to
        swarm.rejoin_wait_s: the listed trainer may be dead and the one that holds the step
        restarting (both trainers killed at once), and sending it again would train it twice."""
        if not self.departed or not self.trainers:
            return
        assert self.directory is not None
        # Marks are read against the trainers that answer now, as they answer: a record can
        # outlive its trainer by record_ttl_s, and when both trainers were killed at once the
        # other's record said it held the step it had died with (the fault suite lost 2
        # groups so). A trainer restarted on the same endpoint answers with its new lineage.
        config, keys = self.config, self.keys
        trainers = list(self.trainers.values())
        answered = await asyncio.gather(
            *(probe(t.endpoint, self.hello, config, keys) for t in trainers)
        )
        live_by_policy: dict[str, list[tuple[protocol.Lineage, int]]] = defaultdict(list)
        for trainer, status in zip(trainers, answered, strict=True):
            if status is not None:
                live_by_policy[trainer.policy].append((status.lineage, status.policy_version))
        for trainer_id, (since, policy) in list(self.departed.items()):
            live = live_by_policy.get(policy)
            if not live:
                continue  # no trainer of its policy answers: nothing can be told yet
            ids = [p.group.group_id for p in self.ledger.held_by(trainer_id)]
            trained = await blocking(self.directory.trained, ids, live) if ids else {}
            waiting: set[str] = set()
            if time.monotonic() - since < self.config.swarm.rejoin_wait_s:
                rest = [g for g in ids if g not in trained]
                waiting = await blocking(self.directory.undecided, rest, live)
            counts = self.ledger.trainer_gone(trainer_id, set(trained), waiting)
            if not waiting:
                del self.departed[trainer_id]
            if not (counts["trained"] or counts["resent"]):
                continue
            self.metrics.write(
                {
                    "event": "trainer_gone",
                    "node_id": trainer_id,
                    "trained_group_ids": sorted(trained),
                    "trained_through_batches": through_batches(trained),
                    "resent": counts["resent"],
                    "waiting": counts["waiting"],
                }
            )
            self.counts["groups_trained"] += counts["trained"]
            self.counts["groups_resent_elsewhere"] += counts["resent"]
            log.warning(
                "trainer %s is gone: %d of its groups were trained (durably), %d go to other "
                "trainers, %d wait for its peers' marks to be read",
                trainer_id,
                counts["trained"],
                counts["resent"],
                counts["waiting"],
            )
            self.unsent.set()

    def _apply_trainers(self, records: list[protocol.NodeRecord], now: float) -> list[str]:
        """Add and update trainers from their records; returns the ids of those whose records
        are missing from two reads in a row (gone, unless they still answer)."""
        seen = set()
        for r in records:
            if r.role != "trainer" or r.protocol_version != protocol.PROTOCOL_VERSION:
                continue
            if not is_endpoint(r.endpoint) or r.policy not in self.policies:
                continue  # (a trainer of a policy this node's config does not hold)
            if self._last_of_gone(r):
                continue
            seen.add(r.node_id)
            trainer = self.trainers.get(r.node_id)
            if trainer is None or trainer.endpoint != r.endpoint or trainer.policy != r.policy:
                if trainer is not None:
                    self.retired.append(self.clients.pop(r.node_id))
                policy = f" (policy {r.policy})" if r.policy else ""
                log.info("trainer %s at %s joined%s", r.node_id, r.endpoint, policy)
                trainer = TrainerPeer(r.node_id, r.endpoint, policy=r.policy)
                self._add_trainer(trainer)
                self.heartbeats[r.node_id] = r.time  # (at another endpoint: another clock)
            self.heartbeats[r.node_id] = max(self.heartbeats.get(r.node_id, r.time), r.time)
            trainer.queue, trainer.capacity = max(r.queue, 0), max(r.capacity, 1)
            if trainer.lineage != r.lineage:
                trainer.lineage, trainer.policy_version = r.lineage, r.policy_version
            self._saw_version(trainer, r.policy_version)
        gone = []
        for trainer_id in list(self.trainers):
            if trainer_id in seen:
                self.missing_since.pop(trainer_id, None)
            elif (
                now - self.missing_since.setdefault(trainer_id, now)
                >= self.config.swarm.heartbeat_s
            ):
                # Missing from two reads in a row: its record expired (record_ttl_s silent),
                # or the reads missed it.
                gone.append(trainer_id)
        return gone

    def _last_of_gone(self, record: protocol.NodeRecord) -> bool:
        """Whether `record` is (or predates) the last record of a trainer found gone: no newer
        heartbeat, the same endpoint. Else a gone trainer is back, and listed again."""
        gone = self.gone.get(record.node_id)
        if gone is None:
            return False
        endpoint, heard = gone
        if record.endpoint == endpoint and record.time <= heard:
            return True
        del self.gone[record.node_id]
        return False

    def _apply_coordinator(self, records: list[protocol.NodeRecord]) -> None:
        coordinators = [r for r in records if r.role == "coordinator" and is_endpoint(r.endpoint)]
        if not coordinators:
            return
        newest = max(coordinators, key=lambda r: r.time)
        if self.coordinator is None or self.coordinator.endpoint != newest.endpoint:
            log.info("coordinator at %s", newest.endpoint)
            self._connect_coordinator(newest.endpoint)

    async def _report(self) -> None:
        while True:
            report = await self.reports.get()
            delay = RETRY_MIN_S
            while True:
                try:
                    if self.coordinator is None:
                        raise PeerUnavailable("no coordinator yet")
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
            if self.coordinator is None:
                continue
            try:
                await self.coordinator.request(beat, self._coordinator_timeout())
            except PeerUnavailable:
                log.warning("coordinator missed a heartbeat")


def main(config: Config) -> int:
    return run_role(Rollout(config), "rollout")
