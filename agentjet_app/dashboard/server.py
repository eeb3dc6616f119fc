"""The dashboard's web server: a run dir or a live swarm, read only, as JSON and one page.

    browser ──GET /, /static/*──────────▶ index.html, app.js, style.css (nothing external)
            ──GET /api/* every 2.5 s────▶ DashboardApp ──▶ a DataSource (source.py):
                                            RunDirSource  <run dir> (read only, reader.py)
                                            SwarmSource   the swarm's directory and sockets
                                                          (swarm.py, `--join`)

    /api/roles                          the roles (run dir: metrics files; swarm: nodes), each
                                        with its kind: coordinator, trainer or rollout
    /api/metrics?role=R&offset=N        R's complete rows after cursor N (run dir: a byte
                                        offset in metrics/R.jsonl; swarm: a row number), and
                                        the next cursor (bounded: `more` says to ask again)
    /api/nodes                          one row per role: version, queue, samples/s, time,
                                        rounds failed/partial/repaired, quarantined nodes,
                                        memory and GPU figures
    /api/scheduler                      the coordinator's CoordinatorStatus (EnvSched's envs,
                                        cells, top tasks), asked over ZMQ; "running": false
                                        and a message when it does not answer
    /api/trajectories?env=E&limit=N     the newest groups of trajectories.jsonl, newest first
    /api/trajectories/<group_id>        one group, as the rollout node wrote it

Run it:  agentjet dashboard --run-dir runs/<run> [--listen HOST:PORT] [--token TOKEN]
         agentjet dashboard --join MULTIADDR --keys FILE [--run-id ID]   (a live swarm)
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

from agentjet.errors import AgentjetError
from agentjet.roles import supervise
from agentjet_app.dashboard import dashboard_url
from agentjet_app.dashboard.reader import ENV_PATTERN, GROUP_ID_PATTERN, ROLE_PATTERN
from agentjet_app.dashboard.source import ApiError, DataSource, RunDirSource

# The largest `limit` of /api/trajectories (the viewer asks for 100).
MAX_LIST_LIMIT = 500
# Groups listed when the request names no limit.
DEFAULT_LIST_LIMIT = 100
# Requests in progress at shutdown get this long (small reads; a scheduler request still
# waiting on a silent coordinator is cut short).
SHUTDOWN_GRACE_S = 2.0
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


def _error(e: ApiError) -> web.Response:
    return web.json_response(
        {"error": e.message, "status": e.status}, status=e.status, dumps=_dumps
    )


def _json(body: dict[str, Any]) -> web.Response:
    return web.json_response(body, dumps=_dumps, headers={"Cache-Control": "no-store"})


class DashboardApp:
    """The handlers over one data source. `token`: "" lets every request in."""

    def __init__(self, source: DataSource, token: str = "") -> None:
        self.source = source
        self.token = token
        static = resources.files("agentjet_app.dashboard") / "static"
        self.static = {name: (static / name).read_bytes() for name in STATIC_FILES}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=1 << 16)
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/roles", self._roles)
        app.router.add_get("/api/metrics", self._metrics)
        app.router.add_get("/api/nodes", self._nodes)
        app.router.add_get("/api/scheduler", self._scheduler)
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
            response = _error(e)
        except web.HTTPException as e:  # aiohttp's own: no such route, wrong method
            response = _error(ApiError(e.status, e.reason))
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
        return _json({"run": self.source.name, "mode": self.source.mode} | self.source.roles())

    async def _metrics(self, request: web.Request) -> web.Response:
        _allow(request, "role", "offset")
        role = _name(request, "role", ROLE_PATTERN, required=True)
        offset = _integer(request, "offset", default=0, low=0, high=1 << 62)
        return _json(self.source.metrics(role, offset))

    async def _nodes(self, request: web.Request) -> web.Response:
        _allow(request)
        return _json({"mode": self.source.mode, "nodes": self.source.node_rows()})

    async def _scheduler(self, request: web.Request) -> web.Response:
        _allow(request)
        return _json({"mode": self.source.mode} | await self.source.scheduler())

    async def _trajectory_list(self, request: web.Request) -> web.Response:
        _allow(request, "env", "limit")
        env = _name(request, "env", ENV_PATTERN, required=False)
        limit = _integer(request, "limit", DEFAULT_LIST_LIMIT, low=1, high=MAX_LIST_LIMIT)
        return _json(self.source.trajectories(env, limit))

    async def _trajectory(self, request: web.Request) -> web.Response:
        _allow(request)
        group_id = request.match_info["group_id"]
        if not GROUP_ID_PATTERN.fullmatch(group_id):
            raise ApiError(400, "a group id is letters, digits and _.:- (at most 128)")
        return _json(self.source.trajectory(group_id))


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


async def serve(source: DataSource, host: str, port: int, token: str, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, with the source's background loops (a loop that fails
    stops the dashboard with its error); prints the URL once listening."""
    runner = web.AppRunner(
        DashboardApp(source, token).app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
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
        await supervise(stop, source.loops())
    finally:
        await runner.cleanup()


def run_dashboard(run_dir: Path, host: str, port: int, token: str) -> int:
    """`agentjet dashboard --run-dir`: serve `run_dir` until SIGINT or SIGTERM."""
    source = RunDirSource(run_dir)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(source, host, port, token, stop)

    try:
        uvloop.run(main())
    finally:
        source.close()
    return 0
