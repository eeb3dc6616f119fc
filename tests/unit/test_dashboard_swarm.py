"""The dashboard's live parts without a swarm: a role's ring of recent rows, the
MetricsRequest it answers (bad and hostile `since` included), /api/scheduler with and
without a coordinator, and the live source against bad directory records.

The coordinator here is the real role class, set up in this process on a loopback socket
with the swarm's keys; its loops run on the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from agentjet import protocol
from agentjet.config import Config, CoordinatorConfig, NetConfig, RunConfig
from agentjet.identity import read_node_keys
from agentjet.metrics import RECENT_ROWS, MetricsWriter, RecentRows
from agentjet.protocol import GpuStats, MetricsRequest, MetricsRows, NodeRecord
from agentjet.roles import Role
from agentjet.transport import outsider_client
from agentjet_app.dashboard.server import DashboardApp
from agentjet_app.dashboard.source import LIVE_TRAJECTORIES_NOTE, RunDirSource
from agentjet_app.dashboard.swarm import FORGET_AFTER_S, SwarmSource, node_key
from coordinator.service import Coordinator
from tests.factories import member_hello

pytestmark = pytest.mark.unit

# One reply on loopback takes milliseconds; this bounds a test that would otherwise hang.
REPLY_TIMEOUT_S = 5.0

Check = Callable[[TestClient[Any, Any]], Awaitable[None]]


def texts(*rows: dict[str, Any]) -> list[str]:
    return [json.dumps(row) for row in rows]


# ── the ring a role keeps ─────────────────────────────────────────────────────────────


def test_the_ring_keeps_the_newest_rows_and_says_how_many_it_dropped() -> None:
    ring = RecentRows(capacity=3)
    for i in range(5):
        ring.add(json.dumps({"i": i}))
    reply = ring.answer(MetricsRequest(since=0))
    assert isinstance(reply, MetricsRows)
    assert [json.loads(t)["i"] for t in reply.rows] == [2, 3, 4]
    assert (reply.next, reply.written, reply.dropped) == (5, 5, 2)
    assert ring.answer(MetricsRequest(since=4)) == MetricsRows(
        rows=['{"i": 4}'], next=5, written=5, dropped=0
    )
    assert ring.answer(MetricsRequest(since=5)) == MetricsRows(rows=[], next=5, written=5)


def test_a_reply_is_bounded_in_bytes_and_a_long_row_goes_alone() -> None:
    ring = RecentRows(capacity=10)
    for text in ["a" * 10, "b" * 10, "c" * 10, "d" * 50, "e" * 10]:
        ring.add(text)
    first = ring.answer(MetricsRequest(since=0), max_bytes=25)
    assert isinstance(first, MetricsRows) and first.rows == ["a" * 10, "b" * 10]
    third = ring.answer(MetricsRequest(since=first.next), max_bytes=25)
    assert isinstance(third, MetricsRows) and third.rows == ["c" * 10]
    long = ring.answer(MetricsRequest(since=third.next), max_bytes=25)
    assert isinstance(long, MetricsRows) and long.rows == ["d" * 50] and long.next == 4


@pytest.mark.parametrize("since", [-1, 3, 2**63])
def test_a_since_outside_the_rows_written_is_one_clear_error(since: int) -> None:
    ring = RecentRows()
    ring.add("{}")
    ring.add("{}")
    reply = ring.answer(MetricsRequest(since=since))
    assert isinstance(reply, protocol.Error) and reply.code == "invalid"
    assert f"since={since}" in reply.message and "ask from 0" in reply.message


def test_the_writer_feeds_the_ring_and_writes_nothing_new_to_disk(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, "trainer")
    for i in range(RECENT_ROWS + 5):
        writer.write({"event": "step", "policy_version": i})
    writer.close()
    assert len(writer.recent.rows) == RECENT_ROWS and writer.recent.written == RECENT_ROWS + 5
    lines = (tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()
    assert len(lines) == RECENT_ROWS + 5
    assert list(writer.recent.rows) == lines[-RECENT_ROWS:]  # the same text, byte for byte
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["trainer.jsonl"]


# ── a real coordinator, answering on its socket ───────────────────────────────────────


@pytest.fixture
def coordinator(tmp_path: Path, keys_file: Path) -> Iterator[Coordinator]:
    config = Config(
        coordinator=CoordinatorConfig(endpoint="tcp://127.0.0.1:*", publish=False),
        net=NetConfig(keys=str(keys_file)),
        run=RunConfig(dir=str(tmp_path / "coordinator")),
    )
    role = Coordinator(config)
    with ExitStack() as cleanup:
        role.setup(cleanup)
        yield role


@asynccontextmanager
async def serving(role: Role) -> AsyncIterator[None]:
    """`role` serving on this loop until the block ends (then stopped, as on SIGTERM)."""
    stop = asyncio.Event()
    task = asyncio.create_task(role.run(stop))
    try:
        yield
    finally:
        stop.set()
        await task


def write_run_dir(run_dir: Path, endpoint: str, keys_file: Path) -> None:
    """What `agentjet local` leaves of the coordinator: its address and keys."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = f'[coordinator]\nendpoint = "{endpoint}"\n\n[net]\nkeys = "{keys_file}"\n'
    (run_dir / "config.toml").write_text(config)


async def get(client: TestClient[Any, Any], url: str, status: int = 200) -> Any:
    reply = await client.get(url)
    assert reply.status == status, (url, reply.status, await reply.text())
    return await reply.json()


@asynccontextmanager
async def dashboard(source: Any) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(DashboardApp(source).app())) as client:
        yield client


@pytest.mark.parametrize(
    "payload",
    [
        {"t": "metrics_request", "since": -1},
        {"t": "metrics_request", "since": 2**64 - 1},
        {"t": "metrics_request", "since": "0"},
        {"t": "metrics_request", "since": 1.5},
        {"t": "metrics_request"},
        {"t": "metrics_request", "since": 0, "rows": ["{}"]},
    ],
)
def test_hostile_metrics_requests_get_one_error_and_the_coordinator_serves_on(
    coordinator: Coordinator, keys_file: Path, payload: dict[str, Any]
) -> None:
    keys = read_node_keys(keys_file, "probe")

    async def go() -> None:
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        keys.secure_client(sock)
        sock.connect(coordinator.server.endpoint)

        async def ask(body: bytes) -> Any:
            await sock.send(body)
            assert await sock.poll(int(REPLY_TIMEOUT_S * 1000)), "no answer"
            return protocol.coordinator_reply_decoder.decode(await sock.recv())

        try:
            async with serving(coordinator):
                coordinator.metrics.write({"coordinator/grants_issued": 3})
                hello = member_hello(keys, "client")
                assert isinstance(await ask(protocol.encode(hello)), protocol.Welcome)
                reply = await ask(msgspec.msgpack.encode(payload))
                assert isinstance(reply, protocol.Error) and reply.message
                assert not await sock.poll(100), "a second reply to one request"
                rows = await ask(protocol.encode(MetricsRequest(since=0)))
                assert isinstance(rows, MetricsRows) and rows.written == 1
                assert json.loads(rows.rows[0])["coordinator/grants_issued"] == 3
        finally:
            sock.close()
            context.term()

    asyncio.run(go())


def test_the_scheduler_page_asks_the_run_dirs_coordinator_and_says_when_it_has_ended(
    coordinator: Coordinator, keys_file: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    write_run_dir(run_dir, coordinator.server.endpoint, keys_file)
    source = RunDirSource(run_dir)

    async def go() -> None:
        async with dashboard(source) as client:
            async with serving(coordinator):
                rollout = outsider_client(
                    coordinator.server.endpoint,
                    "coordinator",
                    read_node_keys(keys_file, "rollout-1"),
                    REPLY_TIMEOUT_S,
                    "rollout",
                )
                try:
                    work = protocol.WorkRequest(node_id="rollout-1", max_groups=2)
                    assert isinstance(await rollout.request(work), protocol.WorkGrants)
                finally:
                    rollout.close()
                body = await get(client, "/api/scheduler")
                assert body["running"] and body["endpoint"] == coordinator.server.endpoint
                status = body["status"]
                assert status["grants_issued"] == 2 and status["leases_open"] == 2
                envs = [row for row in status["table"] if row["level"] == "env"]
                assert [row["name"] for row in envs] == ["arithmetic"]
            ended = await get(client, "/api/scheduler")  # 200: a finished run is no error
            assert not ended["running"] and ended["status"] is None
            assert "the coordinator is not running (the run has ended)" in ended["message"]

    try:
        asyncio.run(go())
    finally:
        source.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "no config.toml"),
        ('[net]\nkeys = "/nowhere/swarm.keys"\n', "are not readable here"),
        ("[coordinator\n", "cannot read"),
    ],
)
def test_the_scheduler_page_without_a_coordinator_to_ask_says_why(
    tmp_path: Path, config: str | None, message: str
) -> None:
    if config is not None:
        (tmp_path / "config.toml").write_text(config)

    async def go() -> None:
        async with dashboard(RunDirSource(tmp_path)) as client:
            body = await get(client, "/api/scheduler")
            assert body["running"] is False and message in body["message"]

    asyncio.run(go())


# ── the live source against its directory ─────────────────────────────────────────────


class Directory:
    """A stand-in for node/directory.py's Directory: the records a read returns."""

    def __init__(self, records: list[NodeRecord]) -> None:
        self.listed = records
        self.bad_records = 0
        self.fails = False

    def records(self) -> list[NodeRecord]:
        if self.fails:
            raise TimeoutError("the DHT did not answer")
        return list(self.listed)


def rollout(node_id: str, **fields: Any) -> NodeRecord:
    return NodeRecord(node_id=node_id, role="rollout", **({"time": 1000.0} | fields))


def test_the_live_source_shows_good_records_and_leaves_out_bad_ones(
    coordinator: Coordinator, keys_file: Path
) -> None:
    gpu = GpuStats(index=0, name="H200", util_pct=87.0, mem_used_mb=1024.0, mem_total_mb=2048.0)
    good = [
        NodeRecord(
            node_id="coordinator-box-1",
            role="coordinator",
            endpoint=coordinator.server.endpoint,
            time=1000.0,
        ),
        rollout("rollout-a", policy_version=4, queue=2, capacity=8, samples_per_s=1.5, gpus=[gpu]),
        rollout("rollout-b.example.com-7", samples_per_s=math.inf),  # inf: shown as null
        NodeRecord(
            node_id="trainer-quiet",
            role="trainer",
            time=1000.0,
            endpoint="tcp://127.0.0.1:1",  # nothing listens: shown as unreachable
            quarantined=["rollout-evil"],
            policy="planner",  # [[policies]]: named with its policy
        ),
    ]
    bad = [
        rollout("two words"),
        rollout("x" * 300),
        rollout(""),
        rollout("rollout-c", endpoint="http://evil.example:80"),
        msgspec.structs.replace(rollout("rollout-d"), time=math.nan),
        NodeRecord(node_id="trainer-x", role="trainer", time=1000.0, policy="<b>x</b>"),
    ]
    directory = Directory(good + bad)
    source = SwarmSource(directory, "swarm-test", read_node_keys(keys_file, "dashboard"))

    async def go() -> None:
        async with serving(coordinator), dashboard(source) as client:
            coordinator.metrics.write({"coordinator/leases_open": 5, "charts/mean_reward": 0.5})
            await source.refresh()
            roles = await get(client, "/api/roles")
            assert roles["mode"] == "swarm" and roles["run"] == "swarm-test"
            listed = {r["label"]: r for r in roles["roles"]}
            assert list(listed) == [
                "coordinator-box-1",
                "trainer-quiet (planner)",
                "rollout-a",
                "rollout-b.example.com-7",
            ]
            assert "6 records of the last directory read were left out" in roles["problems"][0]
            key = listed["rollout-b.example.com-7"]["role"]
            assert key == node_key("rollout-b.example.com-7") and "." not in key

            nodes = {n["label"]: n for n in (await get(client, "/api/nodes"))["nodes"]}
            assert nodes["coordinator-box-1"]["queue"] == 5  # its leases, from its rows
            assert nodes["rollout-a"]["memory"]["gpu/0/util_pct"] == 87.0
            assert nodes["rollout-a"]["source"] == "directory"
            assert nodes["rollout-b.example.com-7"]["samples_per_s"] is None
            assert nodes["trainer-quiet (planner)"]["quarantined"] == ["rollout-evil"]
            assert "no reply" in nodes["trainer-quiet (planner)"]["error"]

            rows = await get(client, "/api/metrics?role=coordinator-box-1")
            assert rows["rows"][-1]["coordinator/leases_open"] == 5 and not rows["more"]
            heartbeat = (await get(client, "/api/metrics?role=rollout-a"))["rows"]
            assert heartbeat == [
                {"time": 1000.0, "role": "rollout-a", "event": "heartbeat", "policy_version": 4,
                 "unacked": 2, "capacity": 8, "perf/samples_per_s": 1.5, "gpu/0/util_pct": 87.0,
                 "gpu/0/mem_used_mb": 1024.0, "gpu/0/mem_total_mb": 2048.0}
            ]  # fmt: skip
            await get(client, f"/api/metrics?role=rollout-a&offset={rows['size'] + 5}", 400)
            await get(client, "/api/metrics?role=rollout-nobody", 404)

            scheduler = await get(client, "/api/scheduler")
            assert scheduler["running"] and scheduler["status"]["leases_open"] == 0
            trajectories = await get(client, "/api/trajectories")
            assert trajectories["groups"] == [] and trajectories["note"] == LIVE_TRAJECTORIES_NOTE
            assert (await get(client, "/api/trajectories/g1", 404))["error"] == (
                LIVE_TRAJECTORIES_NOTE
            )

            directory.fails = True  # a failed read: said on the page, the nodes stay
            await source.refresh()
            roles = await get(client, "/api/roles")
            assert any("could not be read" in p for p in roles["problems"])
            assert len(roles["roles"]) == 4

    try:
        asyncio.run(go())
    finally:
        source.close()


def test_a_node_gone_from_the_directory_leaves_the_page_after_a_while() -> None:
    source = SwarmSource(Directory([]), "swarm-test", None)
    source.update([rollout("rollout-a")], now=0.0)
    source.update([rollout("rollout-a", time=1001.0)], now=1.0)
    source.update([], now=FORGET_AFTER_S)  # a read that missed it: still listed
    assert list(source.nodes) == ["rollout-a"]
    assert source.nodes["rollout-a"].mirror.written == 2  # one row per new heartbeat
    source.update([], now=FORGET_AFTER_S + 2.0)
    assert source.nodes == {}


def test_the_live_scheduler_page_without_a_coordinator_record() -> None:
    source = SwarmSource(Directory([rollout("rollout-a")]), "swarm-test", None)

    async def go() -> None:
        async with dashboard(source) as client:
            await source.refresh()
            body = await get(client, "/api/scheduler")
            assert body["running"] is False and "no coordinator" in body["message"]

    asyncio.run(go())
