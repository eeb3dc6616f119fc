"""`agentjet status`: what a coordinator hands out and has learned (--coordinator), or the
swarm's nodes from its directory (--join), as tables a user reads or as JSON.

    --coordinator ──StatusRequest──▶ coordinator ──CoordinatorStatus──▶ format_status
    --join ──▶ the DHT's directory (node/directory.py) ──NodeRecords──▶ format_swarm
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

from agentjet.config import is_endpoint
from agentjet.errors import AgentjetError
from agentjet.identity import NodeKeys, node_keys

if TYPE_CHECKING:
    from agentjet.protocol import CoordinatorStatus, GpuStats, NodeRecord, SchedulerRow

# `agentjet status` gives up on a coordinator that has not answered within this long.
STATUS_TIMEOUT_S = 5.0


def show_status(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    from agentjet.config import NetConfig

    net = NetConfig(keys=str(args.keys or ""), insecure=args.insecure)
    keys = node_keys(net, f"status-{os.getpid()}")
    if args.join:
        return _swarm_status(args, keys)
    status = asyncio.run(_fetch_status(args.coordinator, args.timeout_s, keys))
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(status)).decode())
    else:
        print(format_status(status))
    return 0


def _swarm_status(args: argparse.Namespace, keys: NodeKeys | None) -> int:
    import msgspec

    from agentjet.config import SwarmConfig

    if args.timeout_s <= 0:
        raise AgentjetError(f"--timeout-s must be > 0, got {args.timeout_s}")
    config = SwarmConfig(
        run_id=args.run_id,
        initial_peers=[args.join],
        startup_timeout_s=args.timeout_s,
        startup_attempts=1,
    )
    from node.directory import read_directory

    records = read_directory(config, keys)
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(records)).decode())
    else:
        print(format_swarm(records, now=time.time()))
    return 0


def format_swarm(records: list[NodeRecord], now: float) -> str:
    """The swarm's nodes by role: address, policy version, queue, throughput, last heartbeat,
    each GPU the node uses (one line each); then each teacher node's teachers (its queue:
    requests waiting, its samples/s: samples scored), the nodes each trainer has quarantined,
    why a trainer's gradient rounds keep failing, and what each trainer refused (non-members'
    calls, bad certificates) by kind."""
    if not records:
        return "no live nodes in the swarm's directory (is --run-id right?)"
    order = {"coordinator": 0, "trainer": 1, "rollout": 2, "teacher": 3}
    header = ("role", "node", "address", "version", "queue", "samples/s", "heartbeat", "gpus")
    rows = [
        row
        for r in sorted(records, key=lambda r: (order.get(r.role, 3), r.node_id))
        for row in _node_rows(r, now)
    ]
    counts = ", ".join(
        f"{n} {role}"
        for role in order
        if (n := sum(r.role == role for r in records)) or role != "teacher"
    )
    by_id = sorted(records, key=lambda r: r.node_id)
    teachers = [f"teachers on {r.node_id}: {', '.join(r.teachers)}" for r in by_id if r.teachers]
    quarantines = [
        f"quarantined by {r.node_id}: {', '.join(r.quarantined)}" for r in by_id if r.quarantined
    ]
    rounds = [f"rounds of {r.node_id}: {r.rounds}" for r in by_id if r.rounds]
    refusals = [
        f"refused by {r.node_id}: "
        + ", ".join(f"{kind.replace('_', ' ')} {n}" for kind, n in sorted(r.refused.items()))
        for r in by_id
        if r.refused
    ]
    table = _aligned([header, *rows], left=(0, len(header) - 1))
    return "\n".join([f"swarm: {counts}", *table, *teachers, *quarantines, *rounds, *refusals])


def _node_rows(r: NodeRecord, now: float) -> list[tuple[str, ...]]:
    """A node's line of the swarm's table, and one more (blank but for the gpus column) per
    GPU past its first."""
    working = r.role != "coordinator"
    gpus = [_gpu_cell(gpu) for gpu in r.gpus] or ["-"]
    first = (
        r.role,
        r.node_id,
        r.endpoint or (r.maddrs[0] if r.maddrs else "-"),
        _version_cell(r),
        f"{r.queue}/{r.capacity}" if working else "-",
        f"{r.samples_per_s:.2f}" if working else "-",
        f"{max(now - r.time, 0):.1f} s ago",
        gpus[0],
    )
    return [first, *(("",) * (len(first) - 1) + (gpu,) for gpu in gpus[1:])]


def _version_cell(r: NodeRecord) -> str:
    """The policy version a node trains or samples with; with [[policies]], `NAME:VERSION`
    (a trainer's policy, each policy a rollout node holds)."""
    if r.role == "trainer":
        return f"{r.policy}:{r.policy_version}" if r.policy else str(r.policy_version)
    if r.role == "rollout":
        held = " ".join(f"{name}:{v}" for name, v in sorted(r.policy_versions.items()))
        return held or str(r.policy_version)
    return "-"


def _gpu_cell(gpu: GpuStats) -> str:
    """One GPU as `0: 87% 30.1/80.0 GiB 312 W 64C` (power and temperature where reported)."""
    used, total = gpu.mem_used_mb / 1024, gpu.mem_total_mb / 1024
    cell = f"{gpu.index}: {gpu.util_pct:.0f}% {used:.1f}/{total:.1f} GiB"
    if gpu.power_w is not None:
        cell += f" {gpu.power_w:.0f} W"
    if gpu.temp_c is not None:
        cell += f" {gpu.temp_c:.0f}C"
    return cell


async def _fetch_status(
    endpoint: str, timeout_s: float, keys: NodeKeys | None
) -> CoordinatorStatus:
    from agentjet import protocol
    from agentjet.transport import PeerUnavailable, outsider_client

    if not is_endpoint(endpoint):
        raise AgentjetError(f"--coordinator {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    if timeout_s <= 0:
        raise AgentjetError(f"--timeout-s must be > 0, got {timeout_s}")
    client = outsider_client(endpoint, "coordinator", keys, timeout_s, "status")
    try:
        reply = await client.request(protocol.StatusRequest())
    except PeerUnavailable:
        raise AgentjetError(
            f"no answer from {endpoint} within {timeout_s:g} s; is the coordinator running "
            "there, and are these its swarm's keys?"
        ) from None
    finally:
        client.close()
    if not isinstance(reply, protocol.CoordinatorStatus):
        raise AgentjetError(f"{endpoint} answered the status request with {reply}")
    return reply


def format_status(status: CoordinatorStatus) -> str:
    """The status as a user reads it: counters, nodes, then the scheduler's table."""
    nodes = ", ".join(f"{node} ({age:.1f} s ago)" for node, age in sorted(status.nodes.items()))
    lines = [
        f"scheduler {status.scheduler or '?'}: {status.grants_issued} grants issued, "
        f"{status.grants_completed} completed, {status.grants_expired} expired, "
        f"{status.leases_open} leases open, {status.regrants_queued} queued for re-grant, "
        f"{status.rejected_messages} messages rejected, "
        f"{status.denied_handshakes} connections without the swarm's keys refused",
        f"nodes: {nodes or 'none'}",
    ]
    if status.refused:
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(status.refused.items()))
        lines.insert(1, f"requests refused as no member's: {kinds}")
    share = f"last {status.recent_grants}"
    for level, title, extra in (
        ("env", "environment (observed)", ("target", "failed", "keep")),
        ("cell", "top cells (predicted)", ("score",)),
        ("task", "top tasks (predicted)", ()),
    ):
        rows = [row for row in status.table if row.level == level]
        if rows:
            header = (title, "visits", "reward", "variance", "P(mixed)", *extra, share)
            body = [_row_cells(row, extra) for row in rows]
            lines += ["", *_aligned([header, *body])]
    return "\n".join(lines)


def _row_cells(row: SchedulerRow, extra: tuple[str, ...]) -> tuple[str, ...]:
    def num(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    extras = {
        "target": num(row.target_share, 2),
        "failed": num(row.failure_rate, 2),
        "score": num(row.score),
        "keep": num(row.keep, 2),
    }
    return (
        row.name,
        str(row.visits),
        num(row.mean_reward),
        num(row.variance),
        num(row.mixed, 2),
        *(extras[name] for name in extra),
        f"{row.grant_share:.0%}",
    )


def _aligned(rows: list[tuple[str, ...]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Columns padded to their widest cell: the `left` columns (names) left-aligned, the
    others (numbers) right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i in left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
