"""What a trainer says of itself: its directory record, its counters, the rows that open
and close its metrics, and its sample rate.

    each step ──measured──▶ samples/s over SAMPLE_RATE_WINDOW_S, the GPUs' last sample
    Status.record()     ──▶ NodeRecord (endpoint, lineage, version, queue, quarantined,
                            refusals, rounds) ──▶ the heartbeat (node/trainer_peers.py)
    Status.counts_row() ──▶ every step's row and the "stopped" row: the trainer's counts,
                            its reward checks', its swarm's and its sockets'
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentjet import protocol
from agentjet.config import Config
from agentjet.metrics import Rate
from agentjet.transport import Server
from node.gpu_monitor import GpuMonitor
from node.groups import GroupBook
from node.publisher import Publisher
from node.swarm import SwarmOptimizer
from node.trainer_intake import Head
from node.verify import Quarantine, RewardCheck

# The trainer's samples/s (progress output, its directory record) is over this many seconds.
SAMPLE_RATE_WINDOW_S = 60.0


@dataclass
class Status:
    """A trainer's record and counters, read from its parts (see the module docstring)."""

    config: Config
    policy: str
    node_id: str
    endpoint: str  # the one announced
    maddrs: list[str]
    head: Head
    book: GroupBook
    quarantine: Quarantine
    reward_check: RewardCheck
    counts: Counter[str]
    swarm: SwarmOptimizer
    server: Server
    publisher: Publisher
    gpu: GpuMonitor
    samples_per_s: float = 0.0  # over the last SAMPLE_RATE_WINDOW_S (progress, status)
    gpus: list[protocol.GpuStats] = field(default_factory=list)  # the last sample
    sample_rate: Rate = field(default_factory=lambda: Rate(SAMPLE_RATE_WINDOW_S))

    def measured(self, start: float, end: float, samples: float) -> None:
        """A step trained `samples` samples over [start, end] (perf_counter seconds)."""
        self.samples_per_s = self.sample_rate.add(start, end, samples)
        self.gpus = self.gpu.sample()

    def record(self) -> protocol.NodeRecord:
        """This trainer's record in the directory, as of now."""
        return protocol.NodeRecord(
            node_id=self.node_id,
            role="trainer",
            policy=self.policy,
            endpoint=self.endpoint,
            maddrs=self.maddrs,
            policy_version=self.head.version,
            queue=len(self.book.queue),
            capacity=self.config.trainer.max_queued_groups,
            samples_per_s=self.samples_per_s,
            time=time.time(),
            quarantined=self.quarantine.listed(),
            lineage=self.head.lineage,
            gpus=self.gpus,
            refused=self.server.refusals()
            | {kind: n for kind, n in self.swarm.refusals().items() if n},
            rounds=self.swarm.round_problem,
        )

    def counts_row(self) -> dict[str, int]:
        """Every count, under "counts/" (metrics rows)."""
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

    def started_row(self) -> dict[str, Any]:
        """The first row of the trainer's metrics: where it starts."""
        return {
            "event": "started",
            "node_id": self.node_id,
            "policy_version": self.head.version,
            "policy_sha256": self.publisher.published.sha256,
            "lineage": self.head.lineage.id,
            "lineage_ancestors": self.head.lineage.ancestors,
            "joined": bool(self.config.swarm.initial_peers),
        }

    def stopped_row(self) -> dict[str, Any]:
        """The last row: where it stopped, what it still held, whom it quarantined."""
        return {
            "event": "stopped",
            "policy_version": self.head.version,
            "queued_group_ids": self.book.held_ids(),
            "quarantined": list(self.quarantine.reasons),
            **self.counts_row(),
        }
