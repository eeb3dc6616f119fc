"""The dashboard's live mode: a swarm's nodes from its directory, their rows over its sockets.

    one client-mode DHT ──Directory.records(), every DIRECTORY_EVERY_S, on the bridge──▶ records
        (each record checked by `record_problem`: a bad one is counted and left out)
    trainer, coordinator (an endpoint) ──MetricsRequest(since) ◀▶ MetricsRows──▶ a mirror per node
    rollout node (no endpoint)         ──its record, as an "event": "heartbeat" row──▶ its mirror
    /api/metrics?role=<node>&offset=N ◀── the node's mirror (a RecentRows: rows numbered from 0)
    /api/scheduler                     ◀── StatusRequest to the coordinator the directory lists

Rollout nodes serve no socket, so what a live dashboard shows of one is what its record says
(version, queue, samples/s, GPUs); its batch rows and trajectories stay in its run dir. A
node missing from a read stays listed for FORGET_AFTER_S (a read under load can miss a live
record). The sockets are the swarm's, with its keys (CURVE); every request waits on the
event loop, the DHT reads on the bridge, so the page never waits on the swarm.

Run it:  agentjet dashboard --join MULTIADDR --keys FILE [--run-id ID] [--listen HOST:PORT]
Imports node/ (hivemind, torch) only to start the DHT: `agentjet_app/dashboard/server.py` and the
run-dir mode never load them.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import math
import re
import time
from collections.abc import Coroutine
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import SwarmConfig, is_endpoint
from agentjet.errors import ProtocolError
from agentjet.identity import NodeKeys
from agentjet.metrics import RecentRows
from agentjet.roles import run_role
from agentjet.transport import Client, PeerUnavailable, outsider_client
from agentjet_app.dashboard.reader import MAX_READ_BYTES, ROLE_PATTERN, decode_row, node_row
from agentjet_app.dashboard.server import serve
from agentjet_app.dashboard.source import (
    LIVE_TRAJECTORIES_NOTE,
    ApiError,
    ask_scheduler,
    finite,
    role_order,
)

log = logging.getLogger(__name__)

# How often the directory is read: records are refreshed every swarm.heartbeat_s (2 s by
# default) and the page polls every 2.5 s.
DIRECTORY_EVERY_S = 3.0
# How long one MetricsRequest may take: a live node answers in milliseconds.
PULL_TIMEOUT_S = 2.0
# Replies one node is asked for per directory read at most (each up to 1 MiB of rows): a
# node far ahead catches up over a few reads instead of holding up the others.
MAX_PULLS_PER_READ = 8
# A node whose record has not been read for this long leaves the page.
FORGET_AFTER_S = 60.0
# Nodes followed at most (each mirror holds up to RECENT_ROWS rows); more are counted.
MAX_NODES = 512
# Rows of a node's mirror the nodes table reads (its newest).
TAIL_ROWS = 200
# A row longer than this (in characters of JSON) from a node is dropped, not mirrored: a
# trainer's step row is ~3 KB, its `stopped` row lists queued group ids.
MAX_ROW_CHARS = 1 << 20
# What a node id may hold to be shown (protocol.MAX_NODE_ID_CHARS, printable).
NODE_ID_PATTERN = re.compile(r"[!-~]{1,256}")
# A trainer's policy ([[policies]]: agentjet/config_checks.py checks its names the same way).
POLICY_PATTERN = re.compile(r"([A-Za-z0-9][\w-]{0,63})?")


class RecordReader(Protocol):
    """The swarm's directory (node/directory.py `Directory`) as this module reads it."""

    bad_records: int

    def records(self) -> list[protocol.NodeRecord]: ...


def record_problem(record: protocol.NodeRecord) -> str | None:
    """Why a decoded record cannot be shown, or None."""
    if not NODE_ID_PATTERN.fullmatch(record.node_id):
        return "a node id that is not 1 to 256 printable characters"
    if record.endpoint and not is_endpoint(record.endpoint):
        return f"endpoint {record.endpoint[:80]!r} is not tcp://HOST:PORT or ipc://PATH"
    if not math.isfinite(record.time):
        return "a heartbeat time that is not a number"
    if not POLICY_PATTERN.fullmatch(record.policy):
        return "a policy name that is not a word of up to 64 characters"
    return None


def label(record: protocol.NodeRecord) -> str:
    """How the page names a node: its id, and a trainer's policy ([[policies]])."""
    return f"{record.node_id} ({record.policy})" if record.policy else record.node_id


def node_key(node_id: str) -> str:
    """The name the page asks for a node by: its id where that is a role name, else a
    cleaned prefix and a hash of the id (hostnames with dots, long ids)."""
    if ROLE_PATTERN.fullmatch(node_id):
        return node_id
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "-", node_id)[:48].strip("-_") or "node"
    return f"{cleaned}-{hashlib.sha256(node_id.encode()).hexdigest()[:8]}"


def gpu_keys(gpus: list[protocol.GpuStats]) -> dict[str, float]:
    """A record's GPUs as metrics-row keys, as the node's own rows name them."""
    from node.gpu_monitor import metrics

    return metrics(gpus)


def heartbeat_row(record: protocol.NodeRecord) -> dict[str, Any]:
    """A rollout or teacher node's record as a metrics row: all a live dashboard learns of
    it (a teacher node's `unacked`: its requests waiting)."""
    return {
        "time": record.time,
        "role": record.node_id,
        "event": "heartbeat",
        "policy_version": record.policy_version,
        "unacked": record.queue,
        "capacity": record.capacity,
        "perf/samples_per_s": record.samples_per_s,
        **gpu_keys(record.gpus),
    }


def rows_problem(reply: Any, since: int) -> str | None:
    """Why a node's answer to MetricsRequest(since) is not rows from `since` on, or None."""
    if isinstance(reply, protocol.Error):
        return f"refused the metrics request: {reply.message[:200]}"
    if not isinstance(reply, protocol.MetricsRows):
        return f"answered the metrics request with {type(reply).__name__}"
    if not since <= reply.next - len(reply.rows) <= reply.next <= reply.written:
        return f"sent rows numbered outside {since} to {reply.written} (next={reply.next})"
    return None


@dataclass
class LiveNode:
    """One node of the swarm as the dashboard follows it."""

    key: str  # what the page asks for it by
    record: protocol.NodeRecord  # the newest read
    mirror: RecentRows  # its rows, numbered as the dashboard received them
    seen_at: float  # when its record was last read
    client: Client | None = None  # its socket, where it serves one
    cursor: int = 0  # the node's own number of the next row to ask for
    error: str = ""  # why the last request failed, "" when it did not


class SwarmSource:
    """A live swarm (see the module docstring). `refresh()` reads the directory and pulls
    every node's new rows; `loops()` runs it every DIRECTORY_EVERY_S."""

    mode: Literal["run", "swarm"] = "swarm"

    def __init__(
        self, directory: RecordReader, run_id: str, keys: NodeKeys | None, name: str = "dashboard"
    ) -> None:
        self.directory = directory
        self.name = run_id
        self.keys = keys
        self.client_name = name  # its Hello's node id, with the pid
        self.nodes: dict[str, LiveNode] = {}
        self.left_out = 0  # records of the last read left out (`record_problem`)
        self.unfollowed = 0  # nodes past MAX_NODES
        self.read_error = ""  # why the last directory read failed, "" when it did not

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"dashboard-swarm": self._follow()}

    async def _follow(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(DIRECTORY_EVERY_S)

    async def refresh(self) -> None:
        try:
            records = await blocking(self.directory.records)
        except Exception as e:  # the DHT failed a read: shown on the page, read again soon
            self.read_error = f"{type(e).__name__}: {e}"[:300]
            log.warning("could not read the swarm's directory: %s", self.read_error)
        else:
            self.read_error = ""
            self.update(records, time.time())
        await asyncio.gather(*(self._pull(n) for n in list(self.nodes.values()) if n.client))

    def update(self, records: list[protocol.NodeRecord], now: float) -> None:
        """Take a directory read: new nodes, new records, rollout and teacher heartbeats as
        rows."""
        self.left_out = 0
        for record in records:
            problem = record_problem(record)
            key = node_key(record.node_id)
            node = self.nodes.get(key)
            if problem is None and node is not None and node.record.node_id != record.node_id:
                problem = f"its id shows as {key!r}, as another node's does"
            if problem is not None:
                self.left_out += 1
                log.debug("left out a directory record: %s", problem)
                continue
            if node is None:
                if len(self.nodes) >= MAX_NODES:
                    self.unfollowed += 1
                    continue
                node = self.nodes[key] = LiveNode(key, record, RecentRows(), now)
            self._connect(node, record)
            if record.role in ("rollout", "teacher") and (
                node.mirror.written == 0 or record.time > node.record.time
            ):
                node.mirror.add(json.dumps(finite(heartbeat_row(record))))
            node.record, node.seen_at = record, now
        for key, node in list(self.nodes.items()):
            if now - node.seen_at > FORGET_AFTER_S:
                if node.client is not None:
                    node.client.close()
                del self.nodes[key]

    def _connect(self, node: LiveNode, record: protocol.NodeRecord) -> None:
        """A client of the node's socket, new when its endpoint changed."""
        if node.client is not None and node.client.endpoint == record.endpoint:
            return
        if node.client is not None:
            node.client.close()
            node.client, node.cursor = None, 0
        if record.role in ("trainer", "coordinator") and record.endpoint:
            node.client = outsider_client(
                record.endpoint, record.role, self.keys, PULL_TIMEOUT_S, self.client_name
            )

    async def _pull(self, node: LiveNode) -> None:
        """The node's rows since the last pull into its mirror (a few replies at most)."""
        assert node.client is not None
        for _ in range(MAX_PULLS_PER_READ):
            try:
                reply = await node.client.request(protocol.MetricsRequest(since=node.cursor))
            except (PeerUnavailable, ProtocolError) as e:  # a node gone or another version
                node.error = str(e)[:300]
                return
            node.error = rows_problem(reply, node.cursor) or ""
            if node.error:
                return
            for text in reply.rows:
                if len(text) <= MAX_ROW_CHARS:
                    node.mirror.add(text)
            node.cursor = reply.next
            if reply.next == reply.written:
                return

    # ── DataSource ────────────────────────────────────────────────────────────────────

    def roles(self) -> dict[str, Any]:
        roles = [
            {
                "role": n.key,
                "kind": n.record.role,
                "label": label(n.record),
                "rows": n.mirror.written,
                "bytes": None,
            }
            for n in self._ordered()
        ]
        return {"roles": roles, "problems": self._problems()}

    def metrics(self, role: str, offset: int) -> dict[str, Any]:
        node = self.nodes.get(role)
        if node is None:
            raise ApiError(404, f"no node {role!r} in the swarm's directory")
        reply = node.mirror.answer(protocol.MetricsRequest(since=offset), MAX_READ_BYTES)
        if isinstance(reply, protocol.Error):
            raise ApiError(400, f"node {role}: {reply.message}")
        rows = [decode_row(text.encode()) for text in reply.rows]
        return {
            "role": role,
            "offset": offset,
            "next_offset": reply.next,
            "size": reply.written,
            "more": reply.next < reply.written,
            "skipped": reply.dropped + sum(row is None for row in rows),
            "rows": [row for row in rows if row is not None],
        }

    def node_rows(self) -> list[dict[str, Any]]:
        return [self._node_row(n) for n in self._ordered()]

    def _node_row(self, node: LiveNode) -> dict[str, Any]:
        newest = itertools.islice(reversed(node.mirror.rows), TAIL_ROWS)
        rows = [row for text in newest if (row := decode_row(text.encode())) is not None]
        shown = node_row(node.key, rows[::-1])
        record = node.record
        shown |= {
            "kind": record.role,
            "label": label(record),
            "endpoint": record.endpoint,
            "time": record.time,  # its heartbeat: newer than its rows
            "source": "metrics" if node.client is not None else "directory",
            "error": node.error,
            "quarantined": sorted(set(record.quarantined) | set(shown["quarantined"])),
            "memory": shown["memory"] | gpu_keys(record.gpus),
        }
        if record.role != "coordinator":  # the coordinator's record carries no work figures
            shown |= {
                "policy_version": record.policy_version,
                "queue": record.queue,
                "capacity": record.capacity,
                "samples_per_s": record.samples_per_s,
            }
        return dict(finite(shown))

    async def scheduler(self) -> dict[str, Any]:
        listed = [n for n in self.nodes.values() if n.record.role == "coordinator" and n.client]
        if not listed:
            message = "no coordinator in the swarm's directory (is --run-id right?)"
            return {"endpoint": "", "running": False, "message": message, "status": None}
        newest = max(listed, key=lambda n: n.record.time)
        assert newest.client is not None
        return await ask_scheduler(newest.client, "the coordinator does not answer")

    def trajectories(self, env: str, limit: int) -> dict[str, Any]:
        return {
            "groups": [],
            "envs": [],
            "indexed": 0,
            "skipped": 0,
            "note": LIVE_TRAJECTORIES_NOTE,
        }

    def trajectory(self, group_id: str) -> dict[str, Any]:
        raise ApiError(404, LIVE_TRAJECTORIES_NOTE)

    def close(self) -> None:
        for node in self.nodes.values():
            if node.client is not None:
                node.client.close()

    def _ordered(self) -> list[LiveNode]:
        return sorted(self.nodes.values(), key=lambda n: role_order(n.record.role, n.key))

    def _problems(self) -> list[str]:
        problems = []
        if self.read_error:
            problems.append(f"the swarm's directory could not be read: {self.read_error}")
        if self.left_out:
            problems.append(
                f"{self.left_out} records of the last directory read were left out (a node id, "
                "endpoint or time that is no such thing)"
            )
        if self.directory.bad_records:
            problems.append(
                f"{self.directory.bad_records} undecodable directory records were skipped"
            )
        if self.unfollowed:
            problems.append(f"{self.unfollowed} nodes past the first {MAX_NODES} are not shown")
        return problems


def open_swarm_source(
    config: SwarmConfig, keys: NodeKeys | None, cleanup: ExitStack
) -> SwarmSource:
    """Join the swarm as a DHT client (one, for the dashboard's life) and follow it."""
    from node.dht import start_dht
    from node.directory import Directory

    dht = start_dht(config, keys, client_mode=True)
    cleanup.callback(dht.shutdown)
    source = SwarmSource(Directory(dht, config, keys), config.run_id, keys)
    cleanup.callback(source.close)
    return source


class LiveDashboard:
    """`agentjet dashboard --join`: a role (setup joins the swarm, run serves the page), so
    it gets a role's lifeline, signals and ordered cleanup (its DHT daemons end with it)."""

    def __init__(
        self, config: SwarmConfig, keys: NodeKeys | None, host: str, port: int, token: str
    ) -> None:
        self.config = config
        self.keys = keys
        self.host, self.port, self.token = host, port, token

    def setup(self, cleanup: ExitStack) -> None:
        self.source = open_swarm_source(self.config, self.keys, cleanup)

    async def run(self, stop: asyncio.Event) -> None:
        await serve(self.source, self.host, self.port, self.token, stop)


def run_live_dashboard(
    config: SwarmConfig, keys: NodeKeys | None, host: str, port: int, token: str
) -> int:
    return run_role(LiveDashboard(config, keys, host, port, token), "dashboard")
