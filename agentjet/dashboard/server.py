"""The dashboard's web server: a run dir, read only, as JSON and one page.

    browser ──GET /, /static/*──────────▶ index.html, app.js, style.css (nothing external)
            ──GET /api/* every 2.5 s────▶ DashboardApp ──reader.py──▶ <run dir> (read only)

    /api/roles                          the roles with a metrics file, and each file's size
    /api/metrics?role=R&offset=N        complete rows of metrics/R.jsonl after byte N, and
                                        the next offset (bounded: `more` says to ask again)
    /api/nodes                          one row per role: version, queue, samples/s, time,
                                        memory and GPU figures
    /api/trajectories?env=E&limit=N     the newest groups of trajectories.jsonl, newest first
    /api/trajectories/<group_id>        one group, as the rollout node wrote it

Run it:  agentjet dashboard --run-dir runs/<run> [--listen HOST:PORT] [--token TOKEN]
(`agentjet local` starts one by itself and prints its URL.)

Every input is checked: a bad query is a 400 with a JSON error, an unknown name a 404,
any other method a 405; nothing a request says can make it read outside the run dir.
Access: on loopback anyone on this machine may look; any other address needs a token
(refused at start without one), and with a token every /api request must carry it as
`?token=` or `Authorization: Bearer`. The page and its scripts are this package's static
files, not the run's data, and load without it; the page sends /api the token it was
opened with.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import re
import signal
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from agentjet.dashboard import dashboard_url
from agentjet.dashboard.reader import (
    ENV_PATTERN,
    GROUP_ID_PATTERN,
    ROLE_PATTERN,
    BadOffset,
    TrajectoryIndex,
    node_row,
    read_rows,
    tail_rows,
)
from agentjet.errors import AgentjetError

# The largest `limit` of /api/trajectories (the viewer asks for 100).
MAX_LIST_LIMIT = 500
# Groups listed when the request names no limit.
DEFAULT_LIST_LIMIT = 100
# Requests in progress at shutdown get this long (they are small reads).
SHUTDOWN_GRACE_S = 2.0
# Roles listed first, in this order; any other metrics file follows by name.
ROLE_ORDER = ("coordinator", "trainer", "rollout")
STATIC_FILES = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "style.css": "text/css",
}
# The page may load nothing but its own files, and run no inline script.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the page's URL may carry ?token=
}
_dumps = functools.partial(json.dumps, allow_nan=False, separators=(",", ":"))


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> web.Response:
        return web.json_response(
            {"error": self.message, "status": self.status}, status=self.status, dumps=_dumps
        )


def _json(body: dict[str, Any]) -> web.Response:
    return web.json_response(body, dumps=_dumps, headers={"Cache-Control": "no-store"})


class DashboardApp:
    """The handlers over one run dir. `token`: "" lets every request in."""

    def __init__(self, run_dir: Path, token: str = "") -> None:
        self.run_dir = run_dir
        self.metrics_dir = run_dir / "metrics"
        self.token = token
        self.trajectories = TrajectoryIndex(run_dir / "trajectories.jsonl")
        static = resources.files("agentjet.dashboard") / "static"
        self.static = {name: (static / name).read_bytes() for name in STATIC_FILES}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=1 << 16)
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/roles", self._roles)
        app.router.add_get("/api/metrics", self._metrics)
        app.router.add_get("/api/nodes", self._nodes)
        app.router.add_get("/api/trajectories", self._trajectory_list)
        app.router.add_get("/api/trajectories/{group_id}", self._trajectory)
        return app

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The token for /api, JSON for every error, the security headers on every reply."""
        try:
            if request.path.startswith("/api/"):
                self._authorize(request)
            response = await handler(request)
        except ApiError as e:
            response = e.response()
        except web.HTTPException as e:  # aiohttp's own: no such route, wrong method
            response = ApiError(e.status, e.reason).response()
        response.headers.update(SECURITY_HEADERS)
        return response

    def _authorize(self, request: web.Request) -> None:
        if not self.token:
            return
        given = request.query.get("token", "")
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            given = header.removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise ApiError(401, "this dashboard needs its token: ?token= or Authorization: Bearer")

    # ── the page ──────────────────────────────────────────────────────────────────────

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.static["index.html"], content_type="text/html")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise ApiError(404, f"no static file {name!r}")
        return web.Response(body=self.static[name], content_type=STATIC_FILES[name])

    # ── /api ──────────────────────────────────────────────────────────────────────────

    async def _roles(self, request: web.Request) -> web.Response:
        _allow(request)
        roles = [{"role": role, "bytes": size} for role, size in self._metric_files()]
        return _json({"run": self.run_dir.resolve().name, "roles": roles})

    async def _metrics(self, request: web.Request) -> web.Response:
        _allow(request, "role", "offset")
        role = _name(request, "role", ROLE_PATTERN, required=True)
        offset = _integer(request, "offset", default=0, low=0, high=1 << 62)
        path = self.metrics_dir / f"{role}.jsonl"
        try:
            rows = read_rows(path, offset)
        except BadOffset as e:
            raise ApiError(400, f"metrics/{role}.jsonl: {e}") from None
        except OSError:
            raise ApiError(404, f"no metrics for role {role!r} in this run") from None
        return _json(
            {
                "role": role,
                "offset": offset,
                "next_offset": rows.next_offset,
                "size": rows.size,
                "more": rows.more,
                "skipped": rows.skipped,
                "rows": rows.rows,
            }
        )

    async def _nodes(self, request: web.Request) -> web.Response:
        _allow(request)
        nodes = []
        for role, _ in self._metric_files():
            try:
                rows = tail_rows(self.metrics_dir / f"{role}.jsonl")
            except OSError:  # removed since it was listed
                continue
            nodes.append(node_row(role, rows))
        return _json({"nodes": nodes})

    async def _trajectory_list(self, request: web.Request) -> web.Response:
        _allow(request, "env", "limit")
        env = _name(request, "env", ENV_PATTERN, required=False)
        limit = _integer(request, "limit", DEFAULT_LIST_LIMIT, low=1, high=MAX_LIST_LIMIT)
        self._refresh_trajectories()
        index = self.trajectories
        return _json(
            {
                "groups": index.newest(limit, env),
                "envs": index.envs(),
                "indexed": len(index.groups),
                "skipped": index.skipped,
            }
        )

    async def _trajectory(self, request: web.Request) -> web.Response:
        _allow(request)
        group_id = request.match_info["group_id"]
        if not GROUP_ID_PATTERN.fullmatch(group_id):
            raise ApiError(400, "a group id is letters, digits and _.:- (at most 128)")
        self._refresh_trajectories()
        try:
            group = self.trajectories.read(group_id)
        except OSError:
            group = None
        if group is None:
            raise ApiError(404, f"no group {group_id!r} among this run's recent trajectories")
        return _json(group)

    def _refresh_trajectories(self) -> None:
        try:
            self.trajectories.refresh()
        except OSError as e:  # not a file, not readable: the list stays as it was
            raise ApiError(404, f"cannot read trajectories.jsonl: {e.strerror}") from None

    def _metric_files(self) -> list[tuple[str, int]]:
        """(role, bytes) of each metrics/<role>.jsonl, the known roles first."""
        try:
            paths = [p for p in self.metrics_dir.glob("*.jsonl") if p.is_file()]
        except OSError:
            return []
        found = {p.stem: p.stat().st_size for p in paths if ROLE_PATTERN.fullmatch(p.stem)}
        order = {role: i for i, role in enumerate(ROLE_ORDER)}
        return sorted(found.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))


def _allow(request: web.Request, *names: str) -> None:
    """A query may hold `names` and the token, nothing else, each once."""
    for key in request.query:
        if key not in names and key != "token":
            allowed = ", ".join(names) or "none"
            raise ApiError(400, f"unknown query parameter {key!r} (allowed: {allowed})")
        if len(request.query.getall(key)) > 1:
            raise ApiError(400, f"query parameter {key!r} is given twice")


def _name(request: web.Request, key: str, pattern: re.Pattern[str], *, required: bool) -> str:
    value = request.query.get(key, "")
    if not value and not required:
        return ""
    if not pattern.fullmatch(value):
        raise ApiError(400, f"{key} must be letters, digits and _-, got {value[:80]!r}")
    return value


def _integer(request: web.Request, key: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(key)
    if raw is None:
        return default
    if not re.fullmatch(r"\d{1,19}", raw) or not low <= int(raw) <= high:
        raise ApiError(400, f"{key} must be an integer from {low} to {high}, got {raw[:40]!r}")
    return int(raw)


async def serve(run_dir: Path, host: str, port: int, token: str, stop: asyncio.Event) -> None:
    """Serve until `stop` is set; prints the URL once listening."""
    runner = web.AppRunner(
        DashboardApp(run_dir, token).app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            raise AgentjetError(
                f"the dashboard cannot listen on {host}:{port} ({e.strerror}); "
                "choose another with --listen HOST:PORT (port 0: a free one)"
            ) from None
        bound = runner.addresses[0][1]
        print(f"dashboard: {dashboard_url(host, bound, token)}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def run_dashboard(run_dir: Path, host: str, port: int, token: str) -> int:
    """`agentjet dashboard`: serve `run_dir` until SIGINT or SIGTERM."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(run_dir, host, port, token, stop)

    uvloop.run(main())
    return 0
