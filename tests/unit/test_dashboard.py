"""The dashboard's server and readers against a run dir written by hand: what a browser
gets for good and bad requests, incremental reads past a torn line, and the token rule."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentjet.config import dashboard_address, load_config
from agentjet.errors import ConfigError
from agentjet_app.cli import main as cli_main
from agentjet_app.dashboard.reader import TrajectoryIndex, read_rows
from agentjet_app.dashboard.server import MAX_LIST_LIMIT, DashboardApp
from agentjet_app.dashboard.source import RunDirSource

pytestmark = pytest.mark.unit

Check = Callable[[TestClient[Any, Any]], Awaitable[None]]


def line(row: dict[str, Any]) -> bytes:
    return (json.dumps(row) + "\n").encode()


def step(version: int, **more: Any) -> dict[str, Any]:
    return {"time": 1000.0 + version, "role": "trainer", "event": "step",
            "policy_version": version, "queue": version + 1, "perf/samples_per_s": 2.5,
            "charts/reward_mean": 0.5, **more}  # fmt: skip


def group(group_id: str, env: str = "arithmetic", rewards: tuple[float, ...] = (1.0, 0.0)):
    return {
        "time": 2000.0,
        "group_id": group_id,
        "env": env,
        "task_id": "d1:2+3",
        "node_id": "rollout-1",
        "policy_version": 3,
        "samples": [
            {"reward": r, "advantage": r - 0.5, "episode": 0, "policy_version": 3, "turns": 1,
             "finish_reason": "stop", "error": "", "prompt": [["2+3=", 0]],
             "completion": [["<tool>", 0, -0.1], ["5", 1, -0.25]]}
            for r in rewards
        ],
    }  # fmt: skip


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "trainer.jsonl").write_bytes(
        line(step(1, **{"gpu/0/mem_used_mb": 100.0})) + line(step(2)) + b'{"time": 10'
    )
    batch = {"time": 999.0, "role": "rollout", "event": "batch", "env": "arithmetic",
             "policy_version": 0, "unacked": 4, "charts/reward_mean": 0.25}  # fmt: skip
    loaded = {"time": 1005.0, "role": "rollout", "event": "weights_loaded", "policy_version": 2}
    (metrics / "rollout.jsonl").write_bytes(line(batch) + line(loaded))
    (metrics / "coordinator.jsonl").write_bytes(
        line({"time": 998.0, "role": "coordinator", "coordinator/leases_open": 7})
    )
    (tmp_path / "trajectories.jsonl").write_bytes(
        line(group("g1")) + line(group("g2", env="prompt")) + b'{"group_id": "g3", "sam'
    )
    return tmp_path


def served(run_dir: Path, check: Check, token: str = "") -> None:
    async def go() -> None:
        app = DashboardApp(RunDirSource(run_dir), token).app()
        async with TestClient(TestServer(app)) as client:
            await check(client)

    asyncio.run(go())


async def get(client: TestClient[Any, Any], url: str, status: int = 200, **kw: Any) -> Any:
    reply = await client.get(url, **kw)
    assert reply.status == status, (url, reply.status, await reply.text())
    assert reply.content_type == "application/json"
    body = await reply.json()
    if status != 200:
        assert body["status"] == status and body["error"]
    return body


# ── reading metrics incrementally ─────────────────────────────────────────────────────


def test_rows_after_an_offset_wait_for_a_torn_last_line(run_dir: Path) -> None:
    path = run_dir / "metrics" / "trainer.jsonl"
    first = read_rows(path, 0)
    assert [r["policy_version"] for r in first.rows] == [1, 2]
    assert first.next_offset == len(line(step(1, **{"gpu/0/mem_used_mb": 100.0}))) + len(
        line(step(2))
    )
    assert not first.more
    assert read_rows(path, first.next_offset).rows == []  # the torn row is not read yet
    with path.open("ab") as f:  # the writer finishes the row and writes another
        f.write(b'01.0, "event": "step", "policy_version": 3}\n' + line(step(4)))
    later = read_rows(path, first.next_offset)
    assert [r["policy_version"] for r in later.rows] == [3, 4]
    assert later.next_offset == path.stat().st_size


def test_reads_are_bounded_and_skip_rows_that_do_not_decode(tmp_path: Path) -> None:
    path = tmp_path / "rollout.jsonl"
    rows = [line({"time": i, "value": float("nan") if i == 3 else i}) for i in range(10)]
    path.write_bytes(b"".join(rows[:5]) + b'{"time": 1\n[1, 2]\n' + b"".join(rows[5:]))
    got, offset, skipped = [], 0, 0
    for _ in range(20):
        part = read_rows(path, offset, max_rows=3)
        assert len(part.rows) <= 3
        got += part.rows
        skipped += part.skipped
        offset = part.next_offset
        if not part.more:
            break
    assert [r["time"] for r in got] == list(range(10))
    assert got[3]["value"] is None  # NaN is no JSON a browser reads
    assert skipped == 2  # the half row and the list
    assert offset == path.stat().st_size


def test_a_row_longer_than_a_reply_is_skipped_not_stuck_on(tmp_path: Path) -> None:
    path = tmp_path / "trainer.jsonl"
    path.write_bytes(line({"pad": "x" * 5000}) + line({"time": 1}))
    first = read_rows(path, 0, max_bytes=1000)
    assert first.rows == [] and first.skipped == 1 and first.more
    assert read_rows(path, first.next_offset).rows == [{"time": 1}]


# ── /api against bad input ────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("query", "status"),
    [
        ("role=trainer&offset=-1", 400),
        ("role=trainer&offset=abc", 400),
        ("role=trainer&offset=1e3", 400),
        ("role=trainer&offset=99999999999999999999999", 400),
        ("role=trainer&offset=5", 400),  # not the start of a row
        ("role=trainer&offset=100000", 400),  # past the end
        ("role=../../etc/passwd", 400),
        ("role=..%2F..%2Fetc%2Fpasswd", 400),
        ("role=/etc/passwd", 400),
        ("role=trainer.jsonl", 400),
        ("role=", 400),
        ("offset=0", 400),
        ("role=trainer&role=rollout", 400),
        ("role=trainer&limit=3", 400),
        ("role=sandbox", 404),
    ],
)
def test_bad_metrics_queries_are_answered_not_crashed_on(
    run_dir: Path, query: str, status: int
) -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        await get(client, f"/api/metrics?{query}", status)
        await get(client, "/api/metrics?role=trainer")  # and it still serves

    served(run_dir, check)


def test_metrics_replies_give_rows_and_the_next_offset(run_dir: Path) -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        body = await get(client, "/api/metrics?role=trainer&offset=0")
        assert [r["policy_version"] for r in body["rows"]] == [1, 2]
        again = await get(client, f"/api/metrics?role=trainer&offset={body['next_offset']}")
        assert again["rows"] == [] and again["next_offset"] == body["next_offset"]
        roles = await get(client, "/api/roles")
        assert [r["role"] for r in roles["roles"]] == ["coordinator", "trainer", "rollout"]

    served(run_dir, check)


def test_each_policys_trainer_is_a_role_of_its_own(run_dir: Path) -> None:
    """[[policies]]: a policy's trainer writes under policies/NAME/metrics; the dashboard
    shows it as role trainer-NAME, beside the others."""
    planner = run_dir / "policies" / "planner" / "metrics"
    planner.mkdir(parents=True)
    (planner / "trainer.jsonl").write_bytes(line(step(7)))

    async def check(client: TestClient[Any, Any]) -> None:
        roles = await get(client, "/api/roles")
        assert [r["role"] for r in roles["roles"]] == [
            "coordinator",
            "trainer",
            "trainer-planner",
            "rollout",
        ]
        body = await get(client, "/api/metrics?role=trainer-planner&offset=0")
        assert [r["policy_version"] for r in body["rows"]] == [7]
        nodes = await get(client, "/api/nodes")
        assert {n["label"]: n["kind"] for n in nodes["nodes"]}["trainer-planner"] == "trainer"
        await get(client, "/api/metrics?role=trainer-critic&offset=0", status=404)

    served(run_dir, check)


@pytest.mark.parametrize(
    ("url", "status"),
    [
        ("/api/trajectories?limit=0", 400),
        (f"/api/trajectories?limit={MAX_LIST_LIMIT + 1}", 400),
        ("/api/trajectories?limit=10000000000000000000000000", 400),
        ("/api/trajectories?limit=-5", 400),
        ("/api/trajectories?env=../../x", 400),
        ("/api/trajectories?group=g1", 400),
        ("/api/trajectories/g404", 404),
        ("/api/trajectories/g3", 404),  # torn: not written yet
        ("/api/trajectories/..%2F..%2Fetc%2Fpasswd", 400),
        ("/api/trajectories/%00", 400),
        ("/api/trajectories/" + "a" * 300, 400),
        ("/api/nodes?x=1", 400),
        ("/api/nothing", 404),
        ("/etc/passwd", 404),
        ("/static/../server.py", 404),
        ("/static/reader.py", 404),
    ],
)
def test_bad_trajectory_and_other_requests(run_dir: Path, url: str, status: int) -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        await get(client, url, status)

    served(run_dir, check)


def test_only_reads_are_allowed(run_dir: Path) -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        reply = await client.post("/api/roles", data=b"{}")
        assert reply.status == 405
        assert (await reply.json())["status"] == 405

    served(run_dir, check)


def test_missing_files_are_empty_or_not_found(tmp_path: Path) -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        assert (await get(client, "/api/roles"))["roles"] == []
        assert (await get(client, "/api/nodes"))["nodes"] == []
        assert (await get(client, "/api/trajectories"))["groups"] == []
        await get(client, "/api/metrics?role=trainer", 404)
        await get(client, "/api/trajectories/g1", 404)

    served(tmp_path, check)


# ── what the page shows ───────────────────────────────────────────────────────────────


def test_nodes_take_each_figure_from_the_newest_row_that_has_it(run_dir: Path) -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        nodes = {n["role"]: n for n in (await get(client, "/api/nodes"))["nodes"]}
        assert list(nodes) == ["coordinator", "trainer", "rollout"]
        trainer = nodes["trainer"]
        assert [trainer[k] for k in ("policy_version", "queue", "samples_per_s")] == [2, 3, 2.5]
        assert trainer["time"] == 1002.0 and trainer["event"] == "step"
        assert trainer["memory"] == {"gpu/0/mem_used_mb": 100.0}
        rollout = nodes["rollout"]  # its newest row has no queue: the batch row's
        assert (rollout["policy_version"], rollout["queue"], rollout["memory"]) == (2, 4, {})
        assert nodes["coordinator"]["queue"] == 7

    served(run_dir, check)


def test_nodes_show_a_trainers_failed_rounds_and_the_nodes_it_quarantined(run_dir: Path) -> None:
    counts = {"counts/swarm_failed_rounds": 3, "counts/swarm_partial_rounds": 1,
              "counts/swarm_repairs": 2, "counts/nodes_quarantined": 2}  # fmt: skip
    with (run_dir / "metrics" / "trainer.jsonl").open("ab") as f:
        f.write(b"01.0}\n")  # the torn row ends
        f.write(line({"time": 1003.0, "event": "quarantined", "node_id": "rollout-x"}))
        f.write(line(step(3, **counts)))
        f.write(line({"time": 1004.0, "event": "stopped", "quarantined": ["rollout-x", "r-y"]}))

    async def check(client: TestClient[Any, Any]) -> None:
        nodes = {n["role"]: n for n in (await get(client, "/api/nodes"))["nodes"]}
        trainer = nodes["trainer"]
        rounds = [trainer[f"rounds_{k}"] for k in ("failed", "partial", "repaired")]
        assert rounds == [3, 1, 2]
        assert trainer["quarantined"] == ["r-y", "rollout-x"]
        assert trainer["quarantined_count"] == 2 and trainer["kind"] == "trainer"
        assert nodes["rollout"]["rounds_failed"] is None and nodes["rollout"]["quarantined"] == []

    served(run_dir, check)


def test_a_lifted_quarantine_is_no_longer_listed(run_dir: Path) -> None:
    with (run_dir / "metrics" / "trainer.jsonl").open("ab") as f:
        f.write(b"01.0}\n")  # the torn row ends
        f.write(line({"time": 1003.0, "event": "quarantined", "node_id": "rollout-x"}))
        f.write(line({"time": 1004.0, "event": "quarantined", "node_id": "r-y"}))
        f.write(line({"time": 1305.0, "event": "quarantine_lifted", "node_id": "rollout-x"}))

    async def check(client: TestClient[Any, Any]) -> None:
        nodes = {n["role"]: n for n in (await get(client, "/api/nodes"))["nodes"]}
        assert nodes["trainer"]["quarantined"] == ["r-y"]

    served(run_dir, check)


def test_trajectories_are_listed_newest_first_and_opened_whole(run_dir: Path) -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        listed = await get(client, "/api/trajectories")
        assert [g["group_id"] for g in listed["groups"]] == ["g2", "g1"]
        assert listed["envs"] == ["arithmetic", "prompt"]
        assert listed["groups"][1]["rewards"] == [1.0, 0.0]
        only = await get(client, "/api/trajectories?env=arithmetic&limit=1")
        assert [g["group_id"] for g in only["groups"]] == ["g1"]
        assert await get(client, "/api/trajectories/g1") == group("g1")
        with (run_dir / "trajectories.jsonl").open("ab") as f:  # the torn group is finished
            f.write(b'ples": []}\n')
        assert (await get(client, "/api/trajectories/g3"))["samples"] == []

    served(run_dir, check)


def test_the_index_follows_a_file_rewritten_to_its_newest_half(tmp_path: Path) -> None:
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes(b"".join(line(group(f"g{i}")) for i in range(4)))
    index = TrajectoryIndex(path)
    index.refresh()
    assert [g["group_id"] for g in index.newest(10)] == ["g3", "g2", "g1", "g0"]
    replacement = tmp_path / "new"  # as the rollout node does past its cap: a rename
    replacement.write_bytes(line(group("g3")) + line(group("g4")) + line(group("g3")))
    replacement.replace(path)
    index.refresh()
    assert [g["group_id"] for g in index.newest(10)] == ["g3", "g4"]
    assert index.read("g4") == group("g4")
    assert index.read("g0") is None


def test_the_page_loads_nothing_from_elsewhere(run_dir: Path) -> None:
    static = resources.files("agentjet_app.dashboard") / "static"
    for name in ("index.html", "app.js", "style.css"):
        text = (static / name).read_text()
        assert not re.search(r"(https?:)?//[\w.-]+\.\w", text.replace("http://", "")), name
        assert "http" not in text, name

    async def check(client: TestClient[Any, Any]) -> None:
        page = await client.get("/")
        assert page.status == 200 and "app.js" in await page.text()
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
        script = await client.get("/static/app.js")
        assert script.status == 200 and script.content_type == "text/javascript"

    served(run_dir, check)


# ── the token ─────────────────────────────────────────────────────────────────────────


def test_with_a_token_every_api_request_must_carry_it(run_dir: Path) -> None:
    async def check(client: TestClient[Any, Any]) -> None:
        await get(client, "/api/roles", 401)
        await get(client, "/api/trajectories/g1", 401)
        await get(client, "/api/roles?token=wrong", 401)
        await get(client, "/api/roles", 401, headers={"Authorization": "Bearer wrong"})
        await get(client, "/api/roles?token=s3cret")
        await get(client, "/api/metrics?role=trainer&token=s3cret")
        await get(client, "/api/roles", headers={"Authorization": "Bearer s3cret"})
        assert (await client.get("/")).status == 200  # the page is no secret; the run is

    served(run_dir, check, token="s3cret")


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:8080", "[::1]:9000", "127.0.0.2:1"])
def test_loopback_needs_no_token(listen: str) -> None:
    host, port = dashboard_address(listen, "", "--listen")
    assert port == int(listen.rsplit(":", 1)[1]) and "[" not in host


@pytest.mark.parametrize("listen", ["0.0.0.0:8080", "10.0.0.5:80", "example.org:80"])
def test_any_other_address_needs_a_token(listen: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a loopback address"):
        dashboard_address(listen, "", "--listen")
    assert dashboard_address(listen, "t0ken", "--listen")[0] == listen.rsplit(":", 1)[0]
    with pytest.raises(ConfigError, match="dashboard.listen.*give a token"):
        load_config(overrides=[f'dashboard.listen="{listen}"'])


@pytest.mark.parametrize("listen", ["8080", ":8080", "host:", "host:99999", "host:http"])
def test_a_listen_address_is_host_and_port(listen: str) -> None:
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        dashboard_address(listen, "t", "--listen")


def test_the_command_refuses_a_public_address_without_a_token_in_one_line(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["dashboard", "--run-dir", str(run_dir), "--listen", "0.0.0.0:0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "give a token" in err
    missing = cli_main(["dashboard", "--run-dir", str(run_dir / "nope")])
    assert missing == 2 and "no such directory" in capsys.readouterr().err


def test_the_live_mode_needs_the_swarms_keys_and_its_flags_go_with_join_only(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["dashboard", "--join", "/ip4/127.0.0.1/tcp/1/p2p/Qm", "--run-id", "r"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no swarm keys" in err
    code = cli_main(["dashboard", "--run-dir", str(run_dir), "--run-id", "r"])
    assert code == 2 and "go with --join" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one of the two, not both
        cli_main(["dashboard", "--run-dir", str(run_dir), "--join", "/ip4/127.0.0.1/tcp/1"])


def test_hostile_requests_get_an_answer_never_a_server_error(run_dir: Path) -> None:
    rng = random.Random(7)
    pieces = ["role", "offset", "env", "limit", "token", "=", "&", "..", "/", "%2F", "%00",
              "%ff", "%", "trainer", "-1", "9" * 30, "\u00e9", " ", "#", "?", ";"]  # fmt: skip

    def noise() -> str:
        if rng.random() < 0.3:  # raw bytes, percent-encoded
            return "".join(f"%{rng.randrange(256):02x}" for _ in range(rng.randrange(1, 8)))
        return "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8)))

    async def check(client: TestClient[Any, Any]) -> None:
        for _ in range(300):
            path = rng.choice(["/api/metrics?", "/api/trajectories?", "/api/trajectories/",
                               "/api/nodes?", "/api/roles?", "/static/", "/a"])  # fmt: skip
            reply = await client.get(path + noise(), allow_redirects=False)
            assert reply.status in (200, 400, 404), (path, reply.status, await reply.text())
        await get(client, "/api/metrics?role=trainer")

    served(run_dir, check)
