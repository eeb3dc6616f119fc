"""One run dir, one node of each role: a second node pointed at a live node's run dir is
refused in one line that names the holder; a dead holder's run dir is taken over.

Real processes (a coordinator, the CLI, a stand-in that holds a trainer's run dir), each
reaped by PID; a holder says it holds the lock on its stdout before the test goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentjet_app.cli import main as cli_main
from tests import procs
from tests.integration.test_cli import agentjet
from tests.integration.test_coordinator import (  # noqa: F401
    REPO_ROOT,
    STOP_TIMEOUT_S,
    Coordinators,
    coordinators,
    wait_until_serving,
)

pytestmark = pytest.mark.integration

# Holds RUN_DIR as the trainer node NAME until its stdin closes (or it is killed).
HOLDER = """
import sys
from pathlib import Path
from agentjet.rundir import hold_run_dir
hold = hold_run_dir(Path(sys.argv[1]), "trainer", sys.argv[2])
print("held", flush=True)
sys.stdin.read()
"""


def start_holder(run_dir: Path, name: str) -> subprocess.Popen[str]:
    holder = procs.popen(
        [sys.executable, "-c", HOLDER, str(run_dir), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_second_coordinator_is_refused_and_a_dead_ones_run_dir_taken_over(
    coordinators: Coordinators,  # noqa: F811
) -> None:
    config = coordinators.config()
    first = coordinators.start(config)

    async def serving(proc: subprocess.Popen[bytes]) -> None:
        node = coordinators.client("node-a")
        try:
            await wait_until_serving(node, proc)
        finally:
            node.close()

    asyncio.run(serving(first))
    config_path = coordinators.workdir / "coordinator.toml"
    second = agentjet("coordinator", "--config", str(config_path), cwd=coordinators.workdir)
    assert second.returncode == 2
    assert second.stderr == (
        f"agentjet: error: run dir {coordinators.run_dir} is held by a live coordinator "
        f"(pid {first.pid}): stop that one, or give this one another run dir (--run-dir DIR, "
        "or run.dir)\n"
    )
    assert first.poll() is None  # the one serving serves on

    first.send_signal(signal.SIGKILL)  # no cleanup: the kernel drops its lock
    first.wait(timeout=STOP_TIMEOUT_S)
    third = coordinators.start(config)
    asyncio.run(serving(third))
    lock = coordinators.run_dir / "coordinator.lock"
    assert lock.read_text() == f"{third.pid} coordinator\n"
    third.send_signal(signal.SIGTERM)
    assert third.wait(timeout=STOP_TIMEOUT_S) == 0


def test_a_second_trainer_is_refused_before_it_loads_anything(
    tmp_path: Path, keys_file: Path
) -> None:
    alice_keys = tmp_path / "alice.keys"
    assert cli_main(["keys", "issue", "--node", "alice", "--keys", str(keys_file),
                     "--out", str(alice_keys)]) == 0  # fmt: skip
    run_dir = tmp_path / "runs" / "alice"  # the default run dir of node alice, below
    holder = start_holder(run_dir, "alice")
    try:
        second = agentjet("node", "--role", "trainer", "--keys", str(alice_keys), cwd=tmp_path)
        assert second.returncode == 2
        assert second.stdout == "run dir: runs/alice (--run-dir to choose another)\n"
        assert second.stderr == (
            f"agentjet: error: run dir runs/alice is held by a live trainer node (pid "
            f"{holder.pid}, alice): stop that one, or give this one another run dir "
            "(--run-dir DIR, or run.dir)\n"
        )
    finally:
        holder.kill()
        holder.wait(timeout=STOP_TIMEOUT_S)
    # Killed holding it: the next holder takes it at once.
    taker = start_holder(run_dir, "alice")
    assert (run_dir / "trainer.lock").read_text() == f"{taker.pid} trainer alice\n"
    assert taker.stdin is not None
    taker.stdin.close()  # its end: it exits on its own
    assert taker.wait(timeout=STOP_TIMEOUT_S) == 0
