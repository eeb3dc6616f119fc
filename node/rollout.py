"""The rollout role: ask for work, play whole episode groups, hold them until trained.

    coordinator ──WorkGrants──▶ produce: await env.run_group(engine, tasks, n)  (on the loop)
                                   │   └─▶ GroupReport ──▶ coordinator   (report task)
                                   ▼
                             Ledger ──SubmitGroup──▶ least backlogged trainer ──GroupAck──▶ held
                                   ◀──GroupStatus: trained──  (deliver task)
    newest trainer ──PolicyInfo / WeightChunks──▶ sync task: check each chunk, assemble ──▶ loaded
                                                  between batches, never mid-episode
    swarm directory (DHT) ◀──▶ discover task: own record out; trainers and coordinator in

The parts `setup()` wires and `run()` drives: produce, node/rollout_produce.py; work
requests, reports and heartbeats, node/rollout_work.py; deliver and backpressure,
node/rollout_delivery.py, over the Ledger of node/delivery.py; sync, node/policy_sync.py;
the trainers and coordinator the discover task finds, node/rollout_peers.py, and the groups
of trainers found gone, node/rollout_gone.py.

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
import logging
import os
import random
import socket
import time
import uuid
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import msgspec
import torch

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import AGENT_ENVS, Config, policy_names, policy_view
from agentjet.identity import node_keys
from agentjet.metrics import MetricsWriter
from agentjet.roles import run_role, supervise
from node.agents import AgentEnv, make_agent_env
from node.delivery import Ledger
from node.dht import start_dht, visible_maddrs
from node.directory import Directory
from node.engine import open_engine
from node.gpu_monitor import GpuMonitor
from node.held_out import HeldOut
from node.model import resolve_model
from node.policy_sync import PolicySync
from node.relay import RelayPeer, RelayServer, open_relay, relay_peers
from node.rollout_delivery import Backpressure, Delivery
from node.rollout_gone import GoneTrainers, through_batches
from node.rollout_peers import Peers
from node.rollout_produce import Producer
from node.rollout_work import Work
from node.spool import Spool
from node.teacher import open_teachers
from node.trajectory_log import TrajectoryLog
from sandboxes.envs import Environment, make_env
from sandboxes.pool import SandboxPool, open_pool
from sandboxes.process import ProcessSandbox

log = logging.getLogger(__name__)


class Rollout:
    """The role: `setup()` wires the parts, `run()` runs their tasks until `stop`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.node_id = f"rollout-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.ledger = Ledger(rng=random.Random(config.run.seed))
        # Each policy's versions on the engine ("": the swarm's one policy).
        self.policies: dict[str, PolicySync] = {}
        self.counts: defaultdict[str, int] = defaultdict(int)  # every part's counters
        self.directory: Directory | None = None
        self.relay: RelayServer | None = None  # serves what this node holds to its peers

    def setup(self, cleanup: ExitStack) -> None:
        cfg = self.config
        self.keys = node_keys(cfg.net, self.node_id)
        if self.keys is not None:  # a node's own key file names it
            self.node_id = self.keys.name
        self.hello = protocol.Hello(node_id=self.node_id, role="rollout")
        self.peers = Peers(cfg, self.hello, self.keys, self.policies)
        bound = cfg.rollout.max_unacked_groups
        self.backpressure = Backpressure(self.ledger, policy_names(cfg), bound)
        self.delivery = Delivery(self.ledger, self.peers, self.backpressure, self.counts)
        cleanup.callback(self.delivery.rejected_log.flush)
        self.metrics = MetricsWriter(Path(cfg.run.dir), "rollout", cfg.log)
        cleanup.callback(self.metrics.close)
        torch.set_num_threads(cfg.rollout.torch_threads)
        views = {name: policy_view(cfg, name) for name in policy_names(cfg)}
        self._open_engine(views, cleanup)
        self._open_envs(cleanup)
        self.work = Work(self.node_id, cfg, self.engine, self.peers, self.backpressure, self.counts)
        held_out = {name: HeldOut(view) for name, view in views.items()}
        trajectories = TrajectoryLog(
            cfg.run.dir,
            cfg.rollout.trajectory_share,
            int(cfg.rollout.trajectory_log_mb * (1 << 20)),
            cfg.run.seed,
        )
        self.teachers = open_teachers(
            cfg,
            self.engine.tokenizer,
            self.engine.device,
            self.hello,
            self.keys,
            self.engine.vocab_size,
        )
        cleanup.callback(self.peers.close_clients)
        self.producer = Producer(
            node_id=self.node_id,
            config=cfg,
            engine=self.engine,
            policies=self.policies,
            envs=self.envs,
            held_out=held_out,
            work=self.work,
            backpressure=self.backpressure,
            ledger=self.ledger,
            unsent=self.delivery.unsent,
            teachers=self.teachers,
            trajectories=trajectories,
            metrics=self.metrics,
            gpu=self.gpu,
            pool=self.pool,
            counts=self.counts,
        )
        if cfg.swarm.initial_peers:
            self._join(cleanup)
        else:
            self.peers.connect_coordinator(cfg.coordinator.endpoint)
            for name, view in views.items():
                self.peers.add_static_trainer(name, view.net.trainer_endpoint)
        self.gone = GoneTrainers(
            self.peers,
            self.ledger,
            self.directory,
            cfg.swarm.rejoin_wait_s,
            self.metrics,
            self.counts,
            self.delivery.unsent,
        )
        self._restore_spool(cleanup)
        log.info("rollout node %s ready (envs: %s)", self.node_id, ", ".join(self.envs))

    def _open_engine(self, views: dict[str, Config], cleanup: ExitStack) -> None:
        """The engine, each policy's versions on it, and the monitor of its GPU."""
        cfg = self.config
        path = resolve_model(cfg.model.name, cfg.model.cache_dir)
        loras = [view.model for view in views.values()] if cfg.policies else []
        self.engine = open_engine(cfg.model, cfg.rollout, path, cfg.run.seed, loras)
        cleanup.callback(self.engine.close)
        metrics = self.metrics
        for name, view in views.items():
            sync = PolicySync(name, self.engine, view.model, cfg.net, lambda: metrics)
            self.policies[name] = sync
            cleanup.callback(sync.interrupted_log.flush)
        self.gpu = GpuMonitor.for_devices([self.engine.device])  # NVML; nothing on CPUs
        cleanup.callback(self.gpu.close)

    def _open_envs(self, cleanup: ExitStack) -> None:
        """The config's environments, and the sandbox pool of the sandboxed ones."""
        cfg = self.config
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

    def _join(self, cleanup: ExitStack) -> None:
        """The swarm's DHT: its directory, this node's relay, the first read of it."""
        cfg = self.config
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
                trained |= self.directory.trained(ids, self.peers.live(policy))
        for group, holder in groups:
            if group.group_id in trained:
                spool.remove(group.group_id)
            else:
                # A trainer the directory lists may have it queued: offered to it only. One
                # it does not list is gone (its record expired), and with it its queue.
                live = holder if holder in self.peers.trainers else None
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

    async def run(self, stop: asyncio.Event) -> None:
        peers, relay = self.peers, self.relay

        def relaying() -> tuple[RelayServer | None, list[RelayPeer]]:
            return relay, peers.relays

        try:
            await supervise(
                stop,
                {
                    "rollout-produce": self.producer.run(),
                    "rollout-deliver": self.delivery.run(),
                    "rollout-report": self.work.report(),
                    **{
                        f"rollout-weights{'-' if name else ''}{name}": sync.run(
                            peers.trainers, peers.clients, relaying, peers.heartbeats
                        )
                        for name, sync in self.policies.items()
                    },
                    "rollout-heartbeat": self.work.heartbeat(),
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
                samples_per_s=self.producer.samples_per_s,
                time=time.time(),
                lineage=next(iter(self.policies.values())).lineage,
                gpus=self.producer.gpus,
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
            self.peers.apply_trainers(records, now=time.monotonic())
            self.peers.apply_coordinator(records)
            if (self.peers.trainers and self.peers.coordinator) or time.monotonic() > deadline:
                break
            time.sleep(self.config.swarm.heartbeat_s / 4)
        log.info(
            "swarm directory: %d trainers, coordinator %s",
            len(self.peers.trainers),
            "found" if self.peers.coordinator else "not found (drawing tasks locally)",
        )

    async def _apply_records(self, records: list[protocol.NodeRecord]) -> None:
        if not any(r.node_id == self.node_id for r in records):
            return  # our own record is missing: this read is not to be trusted
        self.peers.relays = relay_peers(records, self.node_id)
        self.teachers.update(records)
        await self.peers.drop_silent(self.peers.apply_trainers(records, now=time.monotonic()))
        await self.gone.settle()
        self.peers.apply_coordinator(records)


def main(config: Config) -> int:
    return run_role(Rollout(config), "rollout")
