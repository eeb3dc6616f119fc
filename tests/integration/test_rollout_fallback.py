"""A rollout node keeps working while the coordinator is away (local fallback).

Trainer and rollout node run as real processes; no coordinator ever listens on the
configured endpoint. The trainer must still reach its versions on groups the rollout node
drew locally.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentjet.config import load_config, to_toml
from agentjet.metrics import read_metrics
from tests import procs

pytestmark = pytest.mark.integration

RUN_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
MAX_STEPS = 2


def test_rollout_trains_on_local_tasks_while_coordinator_is_away(
    tiny_model_dir: Path, tmp_path: Path, keys_file: Path
):
    sockets = Path(tempfile.mkdtemp(prefix="aj-", dir="/tmp"))
    config = load_config(
        None,
        [
            f"model.name={json.dumps(str(tiny_model_dir))}",
            f'coordinator.endpoint="ipc://{sockets}/nobody.ipc"',
            f'net.trainer_endpoint="ipc://{sockets}/trainer.ipc"',
            "net.request_timeout_s=1.0",
            f"net.keys={json.dumps(str(keys_file))}",
            "rollout.group_size=4",
            "rollout.groups_per_batch=2",
            "rollout.sampling.max_new_tokens=4",
            "trainer.groups_per_step=2",
            f"run.max_steps={MAX_STEPS}",
            f'run.dir="{tmp_path / "run"}"',
        ],
    )
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    roles: dict[str, subprocess.Popen[bytes]] = {}
    for role in ("trainer", "rollout"):
        log = open(tmp_path / f"{role}.log", "wb")  # noqa: SIM115
        roles[role] = procs.popen(
            [
                sys.executable,
                "-m",
                "agentjet_app.cli",
                "node",
                "--role",
                role,
                "--config",
                str(path),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
    try:
        assert roles["trainer"].wait(timeout=RUN_TIMEOUT_S) == 0
        roles["rollout"].send_signal(signal.SIGTERM)
        assert roles["rollout"].wait(timeout=STOP_TIMEOUT_S) == 0
    finally:
        for proc in roles.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    steps = [
        r
        for r in read_metrics(tmp_path / "run" / "metrics" / "trainer.jsonl")
        if r.get("event") == "step"
    ]
    assert max(r["policy_version"] for r in steps) == MAX_STEPS
    trained = [g for r in steps for g in r["trained_group_ids"]]
    assert trained and all(g.startswith("local-") for g in trained)
    assert "drawing tasks locally" in (tmp_path / "rollout.log").read_text()
