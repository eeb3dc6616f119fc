"""Where the dashboard's figures come from: one interface, a run dir or a live swarm.

    DashboardApp (server.py) ──▶ DataSource
                                   ├── RunDirSource: <run dir>/metrics/*.jsonl, trajectories.jsonl
                                   │                 (reader.py); the scheduler asked of the run's
                                   │                 coordinator, if it still runs (config.toml)
                                   └── SwarmSource (swarm.py): the swarm's directory and each
                                                     node's rows over its socket (live mode)

Both answer with the same JSON shapes, so the page is one app:

    roles()               {"roles": [{"role", "kind", "label", "rows", "bytes"}], "problems"}
    metrics(role, offset) {"role", "offset", "next_offset", "size", "more", "skipped", "rows"}
                          (offset: a byte offset in a run dir, a row number in a swarm)
    node_rows()           [reader.node_row(...) with "kind", "label", "source", ...]
    scheduler()           {"endpoint", "running", "message", "status": CoordinatorStatus | null}
    trajectories(...)     {"groups", "envs", "indexed", "skipped", "note"}

A role is a name the page asks for: a metrics file's stem in a run dir, a node in a
swarm; its kind (coordinator, trainer, rollout) says which charts its rows feed.
"""

from __future__ import annotations

import contextlib
import math
import os
import tomllib
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from agentjet import protocol
from agentjet.config import config_from_dict
from agentjet.errors import AgentjetError, ProtocolError
from agentjet.identity import read_node_keys
from agentjet.keys import DEFAULT_KEYS_FILE
from agentjet.transport import Client, PeerUnavailable, outsider_client
from agentjet_app.dashboard.reader import (
    ROLE_PATTERN,
    BadOffset,
    TrajectoryIndex,
    node_row,
    read_rows,
    tail_rows,
)

# Roles listed first, in this order; any other follows by name.
ROLE_ORDER = ("coordinator", "trainer", "rollout", "teacher")
# How long /api/scheduler waits for the coordinator: a running one answers in milliseconds,
# and the page asks again at its next poll.
SCHEDULER_TIMEOUT_S = 2.0
# Where the live swarm keeps trajectories: said by the viewer and /api/trajectories.
LIVE_TRAJECTORIES_NOTE = (
    "In a live swarm, trajectories stay on each rollout node, in trajectories.jsonl of its "
    "run dir: run agentjet dashboard --run-dir <that run dir> on its machine to read them."
)


class ApiError(Exception):
    """A request the dashboard answers with an HTTP error and a JSON body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class DataSource(Protocol):
    name: str  # the run dir's name, or the swarm's run id
    mode: Literal["run", "swarm"]

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """Background loops the server runs (and re-raises the failure of) while it serves."""
        ...

    def roles(self) -> dict[str, Any]: ...

    def metrics(self, role: str, offset: int) -> dict[str, Any]: ...

    def node_rows(self) -> list[dict[str, Any]]: ...

    async def scheduler(self) -> dict[str, Any]: ...

    def trajectories(self, env: str, limit: int) -> dict[str, Any]: ...

    def trajectory(self, group_id: str) -> dict[str, Any]: ...


def role_kind(role: str) -> str:
    """Which role a metrics file or node is: "trainer" for trainer.jsonl or trainer-b."""
    return next((k for k in ROLE_ORDER if role == k or role.startswith(k + "-")), role)


def role_order(kind: str, name: str) -> tuple[int, str]:
    order = {role: i for i, role in enumerate(ROLE_ORDER)}
    return order.get(kind, len(order)), name


def finite(value: Any) -> Any:
    """`value` (builtins) with every NaN or infinity made None: browsers' JSON has none."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


async def ask_scheduler(client: Client, not_running: str) -> dict[str, Any]:
    """/api/scheduler: the coordinator's status, or why there is none (`not_running` when
    it does not answer in time)."""
    reply: dict[str, Any] = {"endpoint": client.endpoint, "running": False, "status": None}
    try:
        status = await client.request(protocol.StatusRequest())
    except PeerUnavailable:
        timeout = f"{client.timeout_s:g}"
        return reply | {
            "message": f"{not_running}: no answer from {client.endpoint} in {timeout} s"
        }
    except ProtocolError as e:
        return reply | {"message": f"the coordinator at {client.endpoint} refused: {e}"}
    if not isinstance(status, protocol.CoordinatorStatus):
        return reply | {"message": f"{client.endpoint} answered with {type(status).__name__}"}
    return reply | {"running": True, "message": "", "status": finite(msgspec.to_builtins(status))}


class RunDirSource:
    """A run dir, running or finished, read only."""

    mode: Literal["run", "swarm"] = "run"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.name = run_dir.resolve().name
        self.metrics_dir = run_dir / "metrics"
        self.trajectory_index = TrajectoryIndex(run_dir / "trajectories.jsonl")
        self._coordinator: Client | None = None

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {}

    def roles(self) -> dict[str, Any]:
        roles = [
            {"role": role, "kind": role_kind(role), "label": role, "rows": None, "bytes": size}
            for role, size in self._metric_files()
        ]
        return {"roles": roles, "problems": []}

    def _path(self, role: str) -> Path:
        """metrics/<role>.jsonl; for "trainer-NAME" without one, the trainer of policy NAME
        ([[policies]]: its metrics are under policies/NAME/metrics)."""
        path = self.metrics_dir / f"{role}.jsonl"
        policy = role.removeprefix("trainer-")
        if not path.exists() and policy != role:
            return self.run_dir / "policies" / policy / "metrics" / "trainer.jsonl"
        return path

    def metrics(self, role: str, offset: int) -> dict[str, Any]:
        path = self._path(role)
        try:
            rows = read_rows(path, offset)
        except BadOffset as e:
            raise ApiError(400, f"metrics/{role}.jsonl: {e}") from None
        except OSError:
            raise ApiError(404, f"no metrics for role {role!r} in this run") from None
        return {
            "role": role,
            "offset": offset,
            "next_offset": rows.next_offset,
            "size": rows.size,
            "more": rows.more,
            "skipped": rows.skipped,
            "rows": rows.rows,
        }

    def node_rows(self) -> list[dict[str, Any]]:
        nodes = []
        for role, _ in self._metric_files():
            try:
                rows = tail_rows(self._path(role))
            except OSError:  # removed since it was listed
                continue
            shown = {"kind": role_kind(role), "label": role, "source": "metrics", "error": ""}
            nodes.append(node_row(role, rows) | shown)
        return nodes

    async def scheduler(self) -> dict[str, Any]:
        try:
            client = self._coordinator or self._open_coordinator()
        except AgentjetError as e:
            return {"endpoint": "", "running": False, "message": str(e), "status": None}
        self._coordinator = client
        return await ask_scheduler(client, "the coordinator is not running (the run has ended)")

    def _open_coordinator(self) -> Client:
        """A client of the coordinator the run dir's config.toml names, with its keys."""
        path = self.run_dir / "config.toml"
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise AgentjetError(
                "this run dir has no config.toml (`agentjet local` writes one): the "
                "coordinator's address is unknown"
            ) from None
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise AgentjetError(f"cannot read {path}: {e}") from None
        section = {key: data.get(key, {}) for key in ("coordinator", "net")}
        config = config_from_dict(section)
        keys = None
        if not config.net.insecure:
            given = Path(config.net.keys) if config.net.keys else None
            # A relative net.keys is relative to where the run was started; the run dir's
            # own copy (`agentjet local` makes one) serves from anywhere.
            found = [p for p in (given, self.run_dir / DEFAULT_KEYS_FILE) if p and p.is_file()]
            if not found:
                raise AgentjetError(
                    f"the run's keys ({config.net.keys or DEFAULT_KEYS_FILE}) are not "
                    "readable here: asking the coordinator needs them"
                )
            keys = read_node_keys(found[0], f"dashboard-{os.getpid()}")
        return outsider_client(
            config.coordinator.endpoint, "coordinator", keys, SCHEDULER_TIMEOUT_S, "dashboard"
        )

    def trajectories(self, env: str, limit: int) -> dict[str, Any]:
        index = self._refreshed_trajectories()
        return {
            "groups": index.newest(limit, env),
            "envs": index.envs(),
            "indexed": len(index.groups),
            "skipped": index.skipped,
            "note": "",
        }

    def trajectory(self, group_id: str) -> dict[str, Any]:
        index = self._refreshed_trajectories()
        try:
            group = index.read(group_id)
        except OSError:
            group = None
        if group is None:
            raise ApiError(404, f"no group {group_id!r} among this run's recent trajectories")
        return group

    def close(self) -> None:
        if self._coordinator is not None:
            self._coordinator.close()

    def _refreshed_trajectories(self) -> TrajectoryIndex:
        try:
            self.trajectory_index.refresh()
        except OSError as e:  # not a file, not readable: the list stays as it was
            raise ApiError(404, f"cannot read trajectories.jsonl: {e.strerror}") from None
        return self.trajectory_index

    def _metric_files(self) -> list[tuple[str, int]]:
        """(role, bytes) of each metrics/<role>.jsonl, the known roles first."""
        try:
            paths = [p for p in self.metrics_dir.glob("*.jsonl") if p.is_file()]
        except OSError:
            return []
        found = {p.stem: p.stat().st_size for p in paths if ROLE_PATTERN.fullmatch(p.stem)}
        with contextlib.suppress(OSError):  # [[policies]]: each policy's trainer
            for path in (self.run_dir / "policies").glob("*/metrics/trainer.jsonl"):
                role = f"trainer-{path.parent.parent.name}"
                if ROLE_PATTERN.fullmatch(role) and role not in found and path.is_file():
                    found[role] = path.stat().st_size
        return sorted(found.items(), key=lambda item: role_order(role_kind(item[0]), item[0]))
