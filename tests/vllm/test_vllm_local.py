"""`agentjet local` with `rollout.engine = "vllm"`, from the outside, as tests/integration/
test_local.py checks the torch engine's runs: versions advance, the rollout node samples
with each new version (the weights it loaded are those published), every group is
accounted for, and vLLM's engine-core and worker processes end with the run, cleanly or
when the rollout node is SIGKILLed (the lifeline)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from agentjet.lifeline import descendants, marked, marked_processes, running
from agentjet.metrics import read_metrics
from tests.integration.test_local import gone, group_fates, run_local, run_to_the_end
from tests.procs import command_line

pytestmark = pytest.mark.vllm

VLLM = ('rollout.engine="vllm"', "trainer.max_logprob_gap=0")  # lr 1e-3 on a random model


def test_a_local_run_on_vllm_trains_and_the_engine_follows_every_version(
    vllm_device: str, vllm_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    trainer, rollout, spawned = run_to_the_end(vllm_model_dir, run_dir, 3, VLLM)
    log = (run_dir / "logs" / "rollout.log").read_text()
    assert "engine: vllm on cpu" in log or "engine: vllm on cuda" in log
    steps = [r for r in trainer if r.get("event") == "step"]
    assert {r["policy_version"] for r in steps if r["optimizer_stepped"]} == {1, 2, 3}
    published = {r["policy_version"]: r["policy_sha256"] for r in steps}
    loaded = [r for r in rollout if r.get("event") == "weights_loaded"]
    assert loaded and all(published[r["policy_version"]] == r["policy_sha256"] for r in loaded)
    # later steps train samples of newer versions: the engine sampled with what it loaded
    newest = [max(r["trained_group_versions"]) for r in steps]
    assert newest == sorted(newest) and newest[-1] >= 1
    fates = group_fates(trainer, rollout)
    assert len(fates["trained"]) == len(set(fates["trained"]))
    assert set(fates["created"]) == {
        g for k in ("trained", "stale", "left_out", "pending") for g in fates[k]
    }
    assert [pid for pid in spawned if running(pid)] == []  # vLLM's processes included


def test_vllm_processes_end_when_the_rollout_node_is_sigkilled(
    vllm_device: str, vllm_model_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL the rollout node alone once its engine has sampled a version. Every process
    below it (vLLM's engine core and worker, spawned by multiprocessing) carries the node's
    lifeline mark, so its watcher ends them (agentjet/lifeline.py; the launcher's own stop
    would too, which is why the marks are checked), and none outlives the run."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics" / "trainer.jsonl"
    below: dict[int, str] = {}
    marks: list[tuple[str, int]] = []

    def sampled_and_killed() -> bool:
        rows = read_metrics(metrics) if metrics.exists() else []
        lock = run_dir / "rollout.lock"  # agentjet/rundir.py: "<pid> rollout ..."
        if not any(r.get("event") == "step" for r in rows) or not lock.exists():
            return False
        node = int(lock.read_text().split()[0])
        below.update({pid: command_line(pid) for pid in descendants(node)})
        [watcher] = [pid for pid, line in below.items() if "agentjet.lifeline" in line]
        token = below[watcher].split()[4]  # python -m agentjet.lifeline PID TOKEN ...
        pipe = int(os.readlink(f"/proc/{watcher}/fd/0").removeprefix("pipe:[").rstrip("]"))
        marks.append((token, pipe))
        unmarked = {pid: line for pid, line in below.items() if pid != watcher}
        for pid in [pid for pid in unmarked if marked(pid, token, pipe)]:
            del unmarked[pid]
        assert unmarked == {}, f"not the rollout node's lifeline's: {unmarked}"
        os.kill(node, signal.SIGKILL)
        return True

    code, output, spawned = run_local(
        vllm_model_dir, run_dir, max_steps=0, settings=VLLM, interrupt_when=sampled_and_killed
    )
    # vLLM's engine core and its worker at least, besides the watcher
    assert len(below) >= 3, output
    assert gone(set(below)), {pid: below[pid] for pid in below if running(pid)}
    assert marked_processes(*marks[0]) == set()
    assert [pid for pid in spawned if running(pid)] == []
