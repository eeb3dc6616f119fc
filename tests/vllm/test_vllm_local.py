"""`agentjet local` with `rollout.engine = "vllm"`, from the outside, as tests/integration/
test_local.py checks the torch engine's runs: versions advance, the rollout node samples
with each new version (the weights it loaded are those published), every group is
accounted for, and vLLM's engine-core and worker processes end with the run, cleanly or
when the rollout node is SIGKILLed (the lifeline)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from agentjet.lifeline import descendants, marked, marked_processes, running
from agentjet.metrics import read_metrics
from node.model import build_tiny_model
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


def test_an_agent_through_the_openai_endpoint_with_a_teacher_trains_on_vllm(
    vllm_device: str, vllm_model_dir: Path, tmp_path: Path
) -> None:
    """The react agent (openai client → the rollout node's endpoint → vLLM) plays multi-turn
    episodes, a teacher (another tiny model, beside the engine) scores every sample, and each
    episode's calls are merged and trained with the teacher's signal: nothing lost."""
    teacher = build_tiny_model(tmp_path / "teacher", seed=1, head_dim=64)
    run_dir = tmp_path / "run"
    settings = (
        *VLLM,
        'envs.0.name="react"',
        "envs.0.max_turns=3",
        "rollout.sampling.max_new_tokens=6",
        f"envs.0.teacher={json.dumps(str(teacher))}",
        "envs.0.teacher_coef=0.5",
    )
    trainer, rollout, spawned = run_to_the_end(vllm_model_dir, run_dir, 2, settings)
    logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "engine: vllm on" in logs and "OpenAI endpoint at http://127.0.0.1:" in logs
    steps = [r for r in trainer if r.get("event") == "step"]
    assert {r["policy_version"] for r in steps if r["optimizer_stepped"]} == {1, 2}
    # the random model never answers: three calls per episode, merged into one sample
    assert all(r["charts/samples"] == 4 * len(r["trained_group_ids"]) for r in steps)
    assert all(r["charts/teacher_samples"] == r["charts/trained_samples"] > 0 for r in steps)
    batches = [r for r in rollout if r.get("event") == "batch"]
    assert batches and all(r["distill/kl_to_teacher"] > 0 for r in batches)
    fates = group_fates(trainer, rollout)
    assert len(fates["trained"]) == len(set(fates["trained"]))
    assert set(fates["created"]) == {g for k in ("trained", "stale", "pending") for g in fates[k]}
    assert [pid for pid in spawned if running(pid)] == []


def test_an_engine_core_killed_under_an_agents_call_stops_the_node_and_loses_nothing(
    vllm_device: str, vllm_model_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL vLLM's engine core (what the OOM killer does) once the agents' episodes have
    trained a version. Whichever call meets the dead core first (an agent's, through the
    OpenAI endpoint: a 503 that says so; or a weight load), the rollout node counts one
    engine fault and exits with vLLM's error in one line, `agentjet local` stops every role,
    and each group the node made is trained, stale, or in its spool for its next start."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics" / "trainer.jsonl"
    killed: list[int] = []

    def kill_the_engine_core() -> bool:
        rows = read_metrics(metrics) if metrics.exists() else []
        lock = run_dir / "rollout.lock"  # agentjet/rundir.py: "<pid> rollout ..."
        if killed or not any(r.get("event") == "step" for r in rows) or not lock.exists():
            return False
        node = int(lock.read_text().split()[0])
        cores = [p for p in descendants(node) if command_line(p).startswith("VLLM::EngineCore")]
        assert len(cores) == 1, {p: command_line(p) for p in descendants(node)}
        os.kill(cores[0], signal.SIGKILL)
        killed.append(cores[0])
        return False  # no Ctrl-C: the node stops by itself

    settings = (*VLLM, 'envs.0.name="react"', "envs.0.max_turns=3")
    code, output, spawned = run_local(
        vllm_model_dir, run_dir, max_steps=0, settings=settings, interrupt_when=kill_the_engine_core
    )
    assert killed and code == 1, output
    assert "rollout exited with code" in output and "vLLM's engine core died" in output, output
    trainer = read_metrics(metrics)
    rollout = read_metrics(run_dir / "metrics" / "rollout.jsonl")
    [end] = [r for r in rollout if r.get("event") == "stopped"]
    assert end["engine_faults"] == 1
    fates = group_fates(trainer, rollout)
    assert len(fates["trained"]) == len(set(fates["trained"]))
    assert set(fates["created"]) == {g for k in ("trained", "stale", "pending") for g in fates[k]}
    spooled = list(run_dir.rglob("*.group"))
    assert len(spooled) == len(end["unacked_group_ids"])
    assert [pid for pid in spawned if running(pid)] == []
