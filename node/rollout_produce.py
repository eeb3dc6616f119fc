"""The produce loop: play each batch of grants, build their groups, hold them until trained.

In node/rollout.py's drawing this is the produce task, between the coordinator's
WorkGrants (node/rollout_work.py) and the Ledger (node/delivery.py). Its stages, per batch:
held-out evaluation when a version is due; per environment and policy, `env.run_group`;
`build_groups`; teachers' scores (on-policy distillation); the groups spooled and held;
the batch's metrics row. An engine that failed (node/engine_base.py `failure`: vLLM's engine
core died), met by a decode, a weight load, or an agent's call through the OpenAI endpoint,
ends the loop after that batch: counted in `engine_faults`, and the node stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

import msgspec

from agentjet import protocol, rl
from agentjet.config import Config
from agentjet.devices import peak_memory
from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.errors import EngineError
from agentjet.metrics import MetricsWriter
from agentjet.timeline import Sequence
from node.agents import AgentEnv
from node.delivery import Ledger
from node.engine import Engine
from node.gpu_monitor import GpuMonitor
from node.gpu_monitor import metrics as gpu_metrics
from node.held_out import HeldOut
from node.policy_sync import PolicySync, PolicyView
from node.rollout_delivery import Backpressure
from node.rollout_work import Work
from node.spool import SpoolFull
from node.teacher import LocalTeachers, TeacherNodes
from node.trajectory_log import TrajectoryLog
from sandboxes.envs import Environment, PromptEnv, ReasoningGymEnv
from sandboxes.envs.prompt import rewards_metrics
from sandboxes.pool import SandboxPool

log = logging.getLogger(__name__)

# A grant, its episodes, and one of their groups (one per policy the agents called).
Played = tuple[protocol.WorkGrant, list[Episode], protocol.TrajectoryGroup]


def model_tokens(episode: Episode) -> int:
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


def played_groups(
    grants: list[protocol.WorkGrant],
    episodes: list[list[Episode]],
    node_id: str,
    share_s: float,
    lineages: Mapping[str, str],
) -> list[Played]:
    """Each grant's groups, in grant order (a grant whose episodes the environment could not
    finish has none); `share_s`: each grant's share of the batch's wall time."""
    return [
        (grant, eps, group)
        for grant, eps in zip(grants, episodes, strict=True)
        if eps
        for group in build_groups(grant, eps, node_id, share_s, lineages)
    ]


def batches_by_env(
    grants: list[protocol.WorkGrant],
) -> dict[tuple[str, int, str], list[protocol.WorkGrant]]:
    """The grants played as one batch: those of one environment, group size and policy."""
    by_env: defaultdict[tuple[str, int, str], list[protocol.WorkGrant]] = defaultdict(list)
    for grant in grants:
        by_env[(grant.task.env, grant.group_size, grant.policy)].append(grant)
    return by_env


def generator_for(engine: Engine, policy: str) -> Generator:
    """What an environment samples `policy` with: the engine itself for the swarm's one
    policy, else a view of it that samples with that policy's adapters."""
    return PolicyView(engine, policy) if policy else engine


def pool_metrics(pool: SandboxPool | None) -> dict[str, float]:
    if pool is None:
        return {}
    stats = pool.stats()
    return {
        "sandbox/acquired": stats.acquired,
        "sandbox/waited": stats.waited,
        "sandbox/wait_s": round(stats.wait_s, 3),
        "sandbox/timeouts": stats.timeouts,
        "sandbox/replaced": stats.replaced,
    }


@dataclasses.dataclass
class Batch:
    """One environment's batch of one policy, played and held."""

    env: str
    policy: str
    episodes: list[list[Episode]]  # per grant (empty: the environment could not finish it)
    wall_s: float
    played: list[Played]
    created: list[str]  # the ids of the groups held
    teacher_kls: list[float]  # per group, when teachers scored them

    @property
    def all_episodes(self) -> list[Episode]:
        return [e for eps in self.episodes for e in eps]

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.all_episodes] or [0.0]

    @property
    def faults(self) -> Counter[str]:
        return Counter(f for e in self.all_episodes for f in e.faults)


class Producer:
    """Plays the grants `work` brings, while `backpressure` leaves room, and holds their
    groups in `ledger` (setting `unsent` for the deliver task). `samples_per_s` and `gpus`
    are what the node's directory record says of its load."""

    def __init__(
        self,
        *,
        node_id: str,
        config: Config,
        engine: Engine,
        policies: Mapping[str, PolicySync],
        envs: Mapping[str, Environment],
        held_out: Mapping[str, HeldOut],
        work: Work,
        backpressure: Backpressure,
        ledger: Ledger,
        unsent: asyncio.Event,
        teachers: LocalTeachers | TeacherNodes,
        trajectories: TrajectoryLog,
        metrics: MetricsWriter,
        gpu: GpuMonitor,
        pool: SandboxPool | None,
        counts: defaultdict[str, int],
    ) -> None:
        self.node_id = node_id
        self.config = config
        self.engine = engine
        self.policies = policies
        self.envs = envs
        self.held_out = held_out
        self.work = work
        self.backpressure = backpressure
        self.ledger = ledger
        self.unsent = unsent
        self.teachers = teachers
        self.trajectories = trajectories
        self.metrics = metrics
        self.gpu = gpu
        self.pool = pool
        self.counts = counts
        s = config.rollout.sampling
        self.params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens
        )
        self.samples_per_s = 0.0
        self.gpus: list[protocol.GpuStats] = []  # the last sample

    async def run(self) -> None:
        try:
            while True:
                await self.backpressure.room.wait()
                grants = await self.work.request()
                for policy_sync in self.policies.values():
                    await policy_sync.load()
                await self.evaluate_held_out()
                for (env_name, n, policy), env_grants in batches_by_env(grants).items():
                    await self.play(env_name, n, policy, env_grants)
                self.backpressure.close_if_full()
        except EngineError:  # the node stops with it; its cleanup keeps the groups held
            self.counts["engine_faults"] += 1
            raise

    async def evaluate_held_out(self) -> None:
        """Each policy's held-out sets, when the version it samples with is due."""
        for name, held_out in self.held_out.items():
            view = generator_for(self.engine, name)
            if held_out.due(view.policy_version):
                row = await held_out.run(self.envs, view)
                self.metrics.write({**row, **({"policy": name} if name else {})})

    async def play(
        self, env_name: str, n: int, policy: str, grants: list[protocol.WorkGrant]
    ) -> None:
        """One batch: `n` episodes of each grant's task by `policy` in `env_name`, their
        groups held, the grants reported, one metrics row."""
        env = self.envs.get(env_name)
        sync = self.policies.get(policy)
        if env is None or sync is None:
            what = f"environment {env_name!r}" if env is None else f"policy {policy!r}"
            for grant in grants:
                self.work.queue_report(grant, [], 0.0, f"no {what} here")
            return
        generator = generator_for(self.engine, policy)
        start = time.perf_counter()
        episodes = await env.run_group(generator, [g.task for g in grants], n, self.params)
        if self.engine.failure is not None:  # met by an agent, through the endpoint (a 503)
            raise self.engine.failure
        wall_s = time.perf_counter() - start
        lineages = {name: p.lineage.id for name, p in self.policies.items()}
        share_s = wall_s / len(grants)
        for grant, eps in zip(grants, episodes, strict=True):
            if not eps:  # the environment could not finish this task's episodes
                self.work.queue_report(grant, [], share_s, "no episodes")
        played = played_groups(grants, episodes, self.node_id, share_s, lineages)
        teacher_kls: list[float] = []
        if env_name in self.teachers.envs and played:  # on-policy distillation
            played, teacher_kls = await self._score(played)
        created = self._hold(played, share_s)
        batch = Batch(env_name, policy, episodes, wall_s, played, created, teacher_kls)
        self._count(batch)
        self.gpus = self.gpu.sample()
        self.metrics.write(self._row(batch, env, generator.policy_version, sync.lineage.id))
        self.unsent.set()

    async def _score(self, played: list[Played]) -> tuple[list[Played], list[float]]:
        """The groups with their teachers' scores, and each one's KL to its teacher."""
        scored = await self.teachers.score_all([group for _, _, group in played])
        played = [(g, e, group) for (g, e, _), (group, _) in zip(played, scored, strict=True)]
        self.counts["groups_held_for_teacher"] = self.teachers.held
        return played, [kl for _, kl in scored]

    def _hold(self, played: list[Played], share_s: float) -> list[str]:
        """Spool and hold each group (in memory only when the batch ran past the spool's cap);
        report each grant once its groups (one per policy its agents called) are held."""
        created: list[str] = []
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
                self.work.queue_report(grant, eps, share_s, "")
        return created

    def _count(self, batch: Batch) -> None:
        self.counts["groups_created"] += len(batch.created)
        self.counts["groups_failed"] += sum(1 for eps in batch.episodes if not eps)
        self.samples_per_s = len(batch.rewards) / batch.wall_s
        for fault, count in batch.faults.items():
            self.counts[f"sandbox_{fault}"] += count

    def _row(self, batch: Batch, env: Environment, version: int, lineage: str) -> dict[str, Any]:
        """The batch's metrics row (`version`, `lineage`: what sampled it)."""
        rewards, wall_s, kls = batch.rewards, batch.wall_s, batch.teacher_kls
        tokens = sum(model_tokens(e) for e in batch.all_episodes)
        return {
            "event": "batch",
            "env": batch.env,
            **({"policy": batch.policy} if batch.policy else {}),
            "group_ids": batch.created,
            # with [[policies]]: whose each group is (agents may call several)
            **(
                {"group_policies": {g.group_id: g.policy for _, _, g in batch.played}}
                if self.config.policies
                else {}
            ),
            "policy_version": version,
            "lineage": lineage,
            "charts/reward_mean": sum(rewards) / len(rewards),
            "perf/gen_tokens_per_s": tokens / wall_s,
            "perf/samples_per_s": len(rewards) / wall_s,
            "perf/batch_s": wall_s,
            "unacked": len(self.ledger),
            "unplaced": self.ledger.unplaced(),
            "spool_bytes": self.ledger.spool.nbytes if self.ledger.spool else 0,
            "sandbox/faults": dict(batch.faults),
            **pool_metrics(self.pool),
            **gpu_metrics(self.gpus),
            **peak_memory(self.engine.device),
            **rewards_metrics(batch.all_episodes),
            **(env.metrics() if isinstance(env, PromptEnv | ReasoningGymEnv | AgentEnv) else {}),
            **({"distill/kl_to_teacher": sum(kls) / len(kls)} if kls else {}),
            **self.counts,
        }
