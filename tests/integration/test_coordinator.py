"""A real coordinator process on an ipc:// socket, driven by real clients.

Each test starts `python -m coordinator CONFIG` and reaps it by PID in the fixture's finalizer.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Literal

import pytest
import zmq

from agentjet import protocol
from agentjet.config import (
    Config,
    CoordinatorConfig,
    EnvConfig,
    NetConfig,
    RolloutConfig,
    RunConfig,
    to_toml,
)
from agentjet.errors import ProtocolError
from agentjet.identity import NodeKeys, read_node_keys
from agentjet.metrics import read_metrics
from agentjet.protocol import (
    PROTOCOL_VERSION,
    CoordinatorStatus,
    Error,
    GroupReport,
    Hello,
    Ok,
    SchedulerRow,
    StatusRequest,
    Welcome,
    WorkGrant,
    WorkGrants,
    WorkRequest,
)
from agentjet.transport import Client, NotAMember, PeerUnavailable
from tests import procs
from tests.factories import member_hello

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
# Starting Python with msgspec, numpy and zmq takes ~0.5 s; a busy 2-core box may take far more.
START_TIMEOUT_S = 30.0
# A coordinator asked to stop closes its socket and database well within this.
STOP_TIMEOUT_S = 10.0
# One request/reply on loopback; above this the server is presumed down and is asked again.
REPLY_TIMEOUT_S = 2.0
# How long a test waits for an asynchronous outcome (a lease sweep) before failing.
CONDITION_TIMEOUT_S = 15.0
# Pause between polls of the coordinator while waiting for a condition.
POLL_EVERY_S = 0.05
MAX_MESSAGE_BYTES = 1 << 16
GROUP_SIZE = 4


class Coordinators:
    """Starts coordinator processes on one config, history and swarm keys; reaps them by PID."""

    def __init__(self, workdir: Path, socket_dir: Path, keys_file: Path) -> None:
        self.workdir = workdir
        self.keys_file = keys_file
        self.endpoint = f"ipc://{socket_dir}/coordinator.ipc"  # short path: ipc has a ~100 B limit
        self.run_dir = workdir / "run"
        self.log_path = workdir / "coordinator.log"
        self.procs: list[subprocess.Popen[bytes]] = []

    def config(
        self,
        lease_s: float = 60.0,
        scheduler: Literal["uniform", "envsched"] = "uniform",
        difficulties: tuple[int, ...] = (3,),
    ) -> Config:
        return Config(
            rollout=RolloutConfig(group_size=GROUP_SIZE),
            envs=[EnvConfig(difficulties=list(difficulties))],
            coordinator=CoordinatorConfig(
                endpoint=self.endpoint, lease_s=lease_s, scheduler=scheduler, publish=False
            ),
            net=NetConfig(
                max_message_bytes=MAX_MESSAGE_BYTES,
                weight_chunk_bytes=1 << 12,
                keys=str(self.keys_file),
            ),
            run=RunConfig(dir=str(self.run_dir), seed=11),
        )

    def start(self, config: Config) -> subprocess.Popen[bytes]:
        config_path = self.workdir / "coordinator.toml"
        config_path.write_text(to_toml(config))
        with open(self.log_path, "ab") as log:
            proc = procs.popen(
                [sys.executable, "-m", "coordinator", str(config_path)],
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def member(self, node_id: str) -> NodeKeys:
        """The keys of node `node_id` of this swarm (certified by the root file)."""
        return read_node_keys(self.keys_file, node_id)

    def client(self, node_id: str, version: int = PROTOCOL_VERSION) -> Client:
        """A client of node `node_id` of this swarm, as a rollout node connects."""
        hello = Hello(node_id=node_id, role="rollout", protocol_version=version)
        return Client(
            self.endpoint,
            protocol.coordinator_reply_decoder,
            hello,
            MAX_MESSAGE_BYTES,
            REPLY_TIMEOUT_S,
            self.member(node_id),
        )

    def reap(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def coordinators(tmp_path: Path, keys_file: Path) -> Iterator[Coordinators]:
    socket_dir = Path(tempfile.mkdtemp(prefix="aj-", dir="/tmp"))
    launched = Coordinators(tmp_path, socket_dir, keys_file)
    try:
        yield launched
    finally:
        launched.reap()
        shutil.rmtree(socket_dir, ignore_errors=True)


async def wait_until_serving(node: Client, proc: subprocess.Popen[bytes]) -> CoordinatorStatus:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"coordinator exited with {proc.returncode}"
        try:
            status = await node.request(StatusRequest(), timeout_s=0.5)
        except PeerUnavailable:
            continue  # the request itself waited; the coordinator is still starting
        assert isinstance(status, CoordinatorStatus)
        return status
    raise AssertionError(f"coordinator did not answer within {START_TIMEOUT_S} s")


async def poll_until(
    condition: Callable[[], Awaitable[CoordinatorStatus | None]], what: str
) -> CoordinatorStatus:
    deadline = time.monotonic() + CONDITION_TIMEOUT_S
    while time.monotonic() < deadline:
        status = await condition()
        if status is not None:
            return status
        await asyncio.sleep(POLL_EVERY_S)
    raise AssertionError(f"{what} did not happen within {CONDITION_TIMEOUT_S} s")


async def status_of(node: Client) -> CoordinatorStatus:
    status = await node.request(StatusRequest())
    assert isinstance(status, CoordinatorStatus)
    return status


async def work(node: Client, node_id: str, k: int) -> list[WorkGrant]:
    reply = await node.request(WorkRequest(node_id=node_id, max_groups=k))
    assert isinstance(reply, WorkGrants), reply
    return reply.grants


def report(node_id: str, grant: WorkGrant, rewards: list[float] | None = None) -> GroupReport:
    return GroupReport(
        node_id=node_id,
        grant_id=grant.grant_id,
        rewards=rewards if rewards is not None else [1.0, 0.0, 1.0, 1.0],
        completion_tokens=40,
        turns=1.0,
        wall_s=0.5,
    )


def test_handshake_work_report_and_status(coordinators: Coordinators) -> None:
    proc = coordinators.start(coordinators.config())

    async def scenario() -> None:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, proc)
            assert node.welcome is not None and node.welcome.protocol_version == PROTOCOL_VERSION
            grants = await work(node, "node-a", 3)
            assert len({g.grant_id for g in grants}) == 3
            assert all(g.group_size == GROUP_SIZE and g.lease_s == 60.0 for g in grants)
            assert all(g.task.env == "arithmetic" and g.task.difficulty == 3 for g in grants)

            assert isinstance(await node.request(report("node-a", grants[0])), Ok)
            duplicate = await node.request(report("node-a", grants[0]))
            assert isinstance(duplicate, Error) and duplicate.code == "invalid"
            unknown = await node.request(GroupReport(node_id="node-a", grant_id="x", rewards=[]))
            assert isinstance(unknown, Error) and unknown.code == "invalid"

            status = await status_of(node)
            assert (status.grants_issued, status.grants_completed, status.leases_open) == (3, 1, 2)
            assert status.grants_expired == 0
            assert 0 <= status.nodes["node-a"] < 60.0
        finally:
            node.close()

    asyncio.run(scenario())


def test_bad_messages_are_answered_and_the_coordinator_keeps_serving(
    coordinators: Coordinators,
) -> None:
    proc = coordinators.start(coordinators.config())

    async def scenario() -> None:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, proc)
            for invalid in (
                WorkRequest(node_id="node-a", max_groups=0),
                WorkRequest(node_id="node-a", max_groups=2000),
                GroupReport(node_id="node-a", grant_id="g", rewards=[math.nan]),
            ):
                reply = await node.request(invalid)
                assert isinstance(reply, Error) and reply.code == "invalid", invalid
            # a request in any name but the node's own (here none) is no member's
            with pytest.raises(NotAMember):
                await node.request(WorkRequest(node_id="", max_groups=1))
            assert len(await work(node, "node-a", 1)) == 1
            status = await status_of(node)
            assert status.rejected_messages == 3 and status.refused == {"impersonation": 1}
        finally:
            node.close()

    asyncio.run(scenario())

    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    keys = coordinators.member("raw")
    keys.secure_client(raw)
    raw.connect(coordinators.endpoint)
    try:
        raw.send(protocol.encode(member_hello(keys)))
        assert raw.poll(int(REPLY_TIMEOUT_S * 1000)), "no Welcome"
        assert isinstance(protocol.coordinator_reply_decoder.decode(raw.recv()), Welcome)
        for garbage in (
            b"\xc1 not msgpack",
            protocol.encode(protocol.PolicyQuery()),  # a trainer message on the wrong socket
            b"\x00" * (MAX_MESSAGE_BYTES + 1),
        ):
            raw.send(garbage)
            assert raw.poll(int(REPLY_TIMEOUT_S * 1000)), "no answer to a malformed message"
            reply = protocol.coordinator_reply_decoder.decode(raw.recv())
            assert isinstance(reply, Error) and reply.code == "decode"
        raw.send(protocol.encode(StatusRequest()))
        assert raw.poll(int(REPLY_TIMEOUT_S * 1000))
        status = protocol.coordinator_reply_decoder.decode(raw.recv())
        assert isinstance(status, CoordinatorStatus)
        assert status.rejected_messages == 3 + 3
    finally:
        raw.close()
    assert proc.poll() is None


def test_a_peer_with_another_protocol_version_is_refused(coordinators: Coordinators) -> None:
    proc = coordinators.start(coordinators.config())

    async def scenario() -> None:
        node = coordinators.client("node-a")
        old = coordinators.client("node-old", version=PROTOCOL_VERSION + 1)
        try:
            await wait_until_serving(node, proc)
            with pytest.raises(ProtocolError, match="protocol version"):
                await old.request(WorkRequest(node_id="node-old", max_groups=1))
            status = await status_of(node)
            assert status.grants_issued == 0 and "node-old" not in status.nodes
        finally:
            node.close()
            old.close()

    asyncio.run(scenario())


def test_a_coordinator_killed_mid_run_resumes_from_its_history(
    coordinators: Coordinators,
) -> None:
    config = coordinators.config()
    first = coordinators.start(config)

    async def before_crash() -> list[WorkGrant]:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, first)
            grants = await work(node, "node-a", 4)
            for g in grants[:2]:
                assert isinstance(await node.request(report("node-a", g)), Ok)
            return grants
        finally:
            node.close()

    grants = asyncio.run(before_crash())
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=STOP_TIMEOUT_S)
    second = coordinators.start(config)

    async def after_restart() -> None:
        node = coordinators.client("node-a")
        try:
            status = await wait_until_serving(node, second)
            assert (status.grants_issued, status.grants_completed) == (4, 2)
            assert (status.leases_open, status.grants_expired) == (2, 0)

            again = await node.request(report("node-a", grants[0]))
            assert isinstance(again, Error) and "already completed" in again.message

            fresh = await work(node, "node-a", 2)
            assert {g.grant_id for g in fresh}.isdisjoint(g.grant_id for g in grants)
            assert {g.task.id for g in fresh}.isdisjoint(g.task.id for g in grants)  # no repeat
            assert isinstance(await node.request(report("node-a", grants[2])), Ok)

            status = await status_of(node)
            assert (status.grants_issued, status.grants_completed) == (6, 3)
            assert (status.leases_open, status.grants_expired) == (3, 0)
        finally:
            node.close()

    asyncio.run(after_restart())


def test_a_silent_nodes_work_is_granted_to_another_node(coordinators: Coordinators) -> None:
    proc = coordinators.start(coordinators.config(lease_s=1.0))

    async def scenario() -> None:
        silent = coordinators.client("node-silent")
        alive = coordinators.client("node-alive")
        try:
            await wait_until_serving(alive, proc)
            (lost,) = await work(silent, "node-silent", 1)

            async def expired() -> CoordinatorStatus | None:
                status = await status_of(alive)
                return status if status.grants_expired >= 1 else None

            status = await poll_until(expired, "expiry of the silent node's lease")
            assert status.leases_open == 0 and status.nodes["node-silent"] > 1.0

            regranted, new = await work(alive, "node-alive", 2)
            assert regranted.task == lost.task and regranted.grant_id != lost.grant_id
            assert new.task != lost.task  # re-granted once, not twice

            # The silent node finishes after all: its work counts, once.
            assert isinstance(await silent.request(report("node-silent", lost)), Ok)
            assert isinstance(await alive.request(report("node-alive", regranted)), Ok)
            status = await status_of(alive)
            assert (status.grants_issued, status.grants_completed) == (3, 2)
        finally:
            silent.close()
            alive.close()

    asyncio.run(scenario())


def test_sigterm_stops_cleanly_and_leaves_a_metrics_row(coordinators: Coordinators) -> None:
    proc = coordinators.start(coordinators.config())

    async def scenario() -> None:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, proc)
            (g,) = await work(node, "node-a", 1)
            assert isinstance(await node.request(report("node-a", g, [1.0, 0.0, 0.0, 0.0])), Ok)
        finally:
            node.close()

    asyncio.run(scenario())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0

    log = coordinators.log_path.read_text()
    assert f"coordinator serving on {coordinators.endpoint}" in log
    assert str(coordinators.run_dir / "coordinator.sqlite") in log
    last = read_metrics(coordinators.run_dir / "metrics" / "coordinator.jsonl")[-1]
    assert last["coordinator/grants_issued"] == 1
    assert last["coordinator/grants_completed"] == 1
    assert last["charts/mean_reward"] == 0.25


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_node_runs_on(
    coordinators: Coordinators,
) -> None:
    proc = coordinators.start(coordinators.config())

    async def serving() -> None:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, proc)
        finally:
            node.close()

    asyncio.run(serving())
    proc.send_signal(signal.SIGUSR1)  # what a user runs on a node that seems stuck

    async def still_serving() -> None:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, proc)
            assert len(await work(node, "node-a", 1)) == 1
        finally:
            node.close()

    asyncio.run(still_serving())  # a signal is handled before its target runs on: dumped
    log = coordinators.log_path.read_text()
    assert "Current thread" in log and "(most recent call first)" in log
    assert "agentjet/roles.py" in log  # the main thread's stack, down to the role runner
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0


def test_importing_the_coordinator_does_not_import_torch() -> None:
    probe = (
        "import sys, coordinator.service, coordinator.__main__; "
        "heavy = sorted({'torch', 'hivemind', 'transformers', 'vllm'} & set(sys.modules)); "
        "print(','.join(heavy))"
    )
    result = procs.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        check=True,
    )
    assert result.stdout.strip() == ""


# Rewards the envsched tests report: 1-digit tasks always right, 3-digit always wrong, and
# 2-digit tasks right half the time: only 2-digit groups carry a GRPO signal.
REWARDS_BY_DIFFICULTY = {
    1: [1.0] * GROUP_SIZE,
    2: [1.0, 0.0] * (GROUP_SIZE // 2),
    3: [0.0] * GROUP_SIZE,
}
# Rounds of 8 grants reported before the scheduler's choices are counted.
TEACHING_ROUNDS = 12


def test_envsched_learns_from_reports_and_keeps_its_statistics_across_a_restart(
    coordinators: Coordinators,
) -> None:
    config = coordinators.config(scheduler="envsched", difficulties=(1, 2, 3))
    first = coordinators.start(config)

    async def teach_then_count() -> tuple[Counter[int], list[SchedulerRow]]:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, first)
            for _ in range(TEACHING_ROUNDS):
                for g in await work(node, "node-a", 8):
                    rewards = REWARDS_BY_DIFFICULTY[g.task.difficulty]
                    assert isinstance(await node.request(report("node-a", g, rewards)), Ok)
            chosen = Counter(g.task.difficulty for g in await work(node, "node-a", 64))
            status = await status_of(node)
            assert status.scheduler == "envsched" and status.grants_issued == 8 * 12 + 64
            return chosen, status.table
        finally:
            node.close()

    chosen, table = asyncio.run(teach_then_count())
    # Uniform would give each difficulty a third (2/3 zero-variance groups); EnvSched skips
    # 1- and 3-digit work until about its zero-variance target (0.4) is left, never all of it.
    assert chosen[2] / 64 > 0.45 and chosen[1] > 0 and chosen[3] > 0, chosen
    envs = {row.name: row for row in table if row.level == "env"}
    assert envs["arithmetic"].visits == 8 * TEACHING_ROUNDS
    assert envs["arithmetic"].target_share == 1.0
    cells = [row for row in table if row.level == "cell"]
    assert cells[0].name.startswith("arithmetic d2 ")  # best first
    assert all(
        (row.mixed or 0.0) < 0.2 for row in cells if not row.name.startswith("arithmetic d2 ")
    )

    first.send_signal(signal.SIGKILL)
    first.wait(timeout=STOP_TIMEOUT_S)
    second = coordinators.start(config)

    async def after_restart() -> list[SchedulerRow]:
        node = coordinators.client("node-a")
        try:
            return (await wait_until_serving(node, second)).table
        finally:
            node.close()

    assert asyncio.run(after_restart()) == table  # replayed: the same statistics, bit for bit
    assert "scheduler statistics rebuilt from 96 reports" in coordinators.log_path.read_text()


def test_agentjet_status_prints_the_scheduler_table(coordinators: Coordinators) -> None:
    proc = coordinators.start(coordinators.config(scheduler="envsched", difficulties=(1, 2)))

    async def one_round() -> None:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, proc)
            for g in await work(node, "node-a", 4):
                rewards = REWARDS_BY_DIFFICULTY[g.task.difficulty]
                assert isinstance(await node.request(report("node-a", g, rewards)), Ok)
        finally:
            node.close()

    asyncio.run(one_round())
    # Through the real entry point, checking on the way that it never loads torch.
    probe = (
        "import sys; from agentjet_app.cli import main; "
        f"code = main(['status', '--coordinator', {coordinators.endpoint!r}, "
        f"'--keys', {str(coordinators.keys_file)!r}]); "
        "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded'); sys.exit(code)"
    )
    result = procs.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "scheduler envsched: 4 grants issued, 4 completed" in out
    assert "nodes: node-a" in out
    assert "environment (observed)" in out and "top cells (predicted)" in out
    env_line = next(line for line in out.splitlines() if line.startswith("arithmetic "))
    assert env_line.split()[1] == "4"  # visits
    assert out.rstrip().endswith("torch not loaded")

    silent = procs.run(
        [sys.executable, "-m", "agentjet_app.cli", "status", "--coordinator",
         coordinators.endpoint.replace("coordinator.ipc", "nobody.ipc"), "--timeout-s", "0.5",
         "--keys", str(coordinators.keys_file)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=START_TIMEOUT_S,
    )  # fmt: skip
    assert silent.returncode == 2
    assert silent.stderr.count("\n") == 1 and "no answer from" in silent.stderr
