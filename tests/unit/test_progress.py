"""The progress lines `agentjet local` prints from the run's metrics files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from agentjet_app.local import Progress, held_out_lines
from node.verify import Quarantine

pytestmark = pytest.mark.unit


def switched(version: int) -> bytes:
    return (json.dumps({"event": "weights_loaded", "policy_version": version}) + "\n").encode()


def test_a_continued_run_shows_only_its_own_rows_and_skips_a_torn_one(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    rollout = metrics / "rollout.jsonl"
    # the earlier run: two rows, and a third cut off by a power cut
    rollout.write_bytes(switched(1) + switched(2) + b'{"event": "weights_lo')
    out = io.StringIO()
    progress = Progress(out)
    progress.skip_existing(tmp_path)
    progress.poll(tmp_path)
    assert out.getvalue() == ""
    # this run appends to the torn row (one undecodable line), then writes its own
    with rollout.open("ab") as f:
        f.write(switched(3) + switched(4))
    progress.poll(tmp_path)
    [line] = out.getvalue().splitlines()
    assert line.endswith("s] rollout node switched to policy v4")


def test_a_quarantined_rollout_node_is_shown_with_its_reason(tmp_path: Path) -> None:
    """The only rollout node of a local run quarantined: training stops, and the lines say
    why and what to change instead of just stopping, again while it lasts, then its end."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    reason = (
        "quarantined: 3 failed checks (trainer.quarantine_after=3), the last: logprob gap"
        " 0.783 over trainer.max_logprob_gap=0.5"
    )
    consequence = Quarantine(after=3).consequence()
    remind = "training stopped: every group arriving is from quarantined node rollout-a"
    lifted = "quarantine of rollout-a lifted after 300 s in which no other node sent a group"
    rows = [
        {"event": "quarantined", "node_id": "rollout-a", "reason": reason, "message": consequence},
        {"event": "quarantine_reminder", "node_id": "rollout-a", "message": remind},
        {"event": "quarantine_reminder", "node_id": "rollout-a", "message": remind},
        {"event": "quarantine_lifted", "node_id": "rollout-a", "message": lifted},
    ]
    (metrics / "trainer.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = io.StringIO()
    Progress(out).poll(tmp_path)
    first, *reminders, last = out.getvalue().splitlines()
    assert f"WARNING: the trainer quarantined rollout-a ({reason}): {consequence}" in first
    assert "trainer.max_logprob_gap (0 = off) or trainer.quarantine_after" in first
    assert "training stops (said again every 60 s)" in first
    assert [line.split("] ", 1)[1] for line in reminders] == [f"WARNING: trainer: {remind}"] * 2
    assert last.endswith(f"] trainer: {lifted}")


def test_a_held_out_evaluation_is_one_line_per_environment(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    row = {
        "event": "eval",
        "policy_version": 20,
        "eval/arithmetic/accuracy": 17 / 54,
        "eval/arithmetic/mean_reward": 17 / 54,
        "eval/arithmetic/tasks": 54,
        "eval/prompt/accuracy": 0.5,
        "eval/prompt/tasks": 4,
        "eval/seconds": 3.2,
    }
    (metrics / "rollout.jsonl").write_text(json.dumps(row) + "\n")
    out = io.StringIO()
    Progress(out).poll(tmp_path)
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines == [
        "held-out arithmetic 31.5% at v20 (54 tasks)",
        "held-out prompt 50.0% at v20 (4 tasks)",
    ]
    assert held_out_lines({**row, "policy_version": 0}, "solver ")[0] == (
        "held-out arithmetic 31.5% at solver v0 (54 tasks)"
    )
