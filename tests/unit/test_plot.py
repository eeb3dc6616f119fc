"""`agentjet plot` against run dirs written with the roles' own MetricsWriter: which curves
a run's rows make, the PNGs (real PNGs, of the size asked, none for a curve without data),
and one-line errors for a missing run dir, one without metrics and garbage lines."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentjet.errors import AgentjetError
from agentjet.metrics import MetricsWriter
from agentjet_app.cli import main as cli_main
from agentjet_app.plot import RunRows, charts, read_run, time_axis, write_plots

pytestmark = pytest.mark.unit

START = 1_800_000_000.0  # unix time of the run's first row
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Small PNGs draw fast; a single panel is 6 x 3.6 inches.
DPI = 40


def batch(minute: float, env: str, reward: float) -> dict[str, Any]:
    return {"time": START + 60 * minute, "event": "batch", "env": env, "policy_version": 0,
            "charts/reward_mean": reward, "perf/samples_per_s": 4.0}  # fmt: skip


def step(minute: float, version: int, trained: int, **more: Any) -> dict[str, Any]:
    return {"time": START + 60 * minute, "event": "step", "policy_version": version,
            "trained_group_ids": ["g1", "g2", "g3", "g4"], "charts/zero_variance_groups": 3,
            "charts/samples": 32, "charts/trained_samples": trained, "perf/samples_per_s": 2.0,
            "charts/staleness_mean": 1.5, "charts/staleness_max": 2, "perf/step_s": 10.0,
            "perf/s_per_version": 12.0, "charts/logprob_gap_max": 0.3,
            "logprob_gaps": {"g1": 0.1, "g2": 0.3}, "losses/policy": 0.25,
            "losses/grad_norm": 3.0, **more}  # fmt: skip


def write_rows(run_dir: Path, role: str, rows: list[dict[str, Any]]) -> None:
    writer = MetricsWriter(run_dir, role)
    for row in rows:
        writer.write(row)
    writer.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A 10-minute run: coordinator rows, rollout batches of two envs, trainer steps."""
    run = tmp_path / "run"
    write_rows(run, "coordinator", [{"time": START, "coordinator/nodes": 0}])
    write_rows(run, "rollout", [batch(m, "arithmetic", m / 10) for m in (1, 3, 5)]
               + [batch(2, "shell", 0.5), {"time": START + 60, "event": "restored"}])  # fmt: skip
    # Version 2's groups were all zero-variance: no gradient, so no gaps were measured.
    write_rows(run, "trainer", [step(2, 1, 8), step(4, 2, 0, logprob_gaps={}), step(10, 3, 16)])
    return run


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header, which must be a PNG's."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def curves(run_dir: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Chart name -> series -> points, minutes after START (single-panel charts only)."""
    return {
        chart.name: {
            name: [((t - START) / 60, v) for t, v in points]
            for name, points in chart.panels[0].series.items()
        }
        for chart in charts(read_run(run_dir))
    }


def test_each_curve_reads_the_rows_that_feed_it(run_dir: Path) -> None:
    found = curves(run_dir)
    assert list(found) == ["reward", "zero_variance", "throughput", "staleness", "step_time",
                           "logprob_gap", "losses", "overview"]  # fmt: skip
    assert found["reward"] == {
        "arithmetic": [(1, 0.1), (3, 0.3), (5, 0.5)],
        "shell": [(2, 0.5)],
    }
    assert found["zero_variance"] == {"share": [(2, 0.75), (4, 0.75), (10, 0.75)]}
    # Effective: 2 samples/s times the share of the step's 32 samples with gradient.
    assert found["throughput"] == {
        "rollout": [(1, 4.0), (2, 4.0), (3, 4.0), (5, 4.0)],
        "trainer": [(2, 2.0), (4, 2.0), (10, 2.0)],
        "trainer, effective": [(2, 0.5), (4, 0.0), (10, 1.0)],
    }
    assert found["logprob_gap"] == {
        "max": [(2, 0.3), (10, 0.3)],
        "mean": [(2, 0.2), (10, 0.2)],  # of the step's two groups' gaps
    }
    # The step without a sample with gradient wrote a gap and losses it never computed.
    losses = {panel.title: panel.series for panel in charts(read_run(run_dir))[6].panels}
    assert list(losses) == ["losses/policy", "losses/grad_norm"]
    assert [(t - START) / 60 for t, _ in losses["losses/policy"]["policy"]] == [2, 10]


def test_held_out_accuracy_is_one_line_per_env(tmp_path: Path) -> None:
    evals = [{"time": START + 60 * m, "event": "eval", "policy_version": m,
              "eval/arithmetic/accuracy": m / 10, "eval/arithmetic/mean_reward": 0.9,
              "eval/seconds": 3.0} for m in (0, 5)]  # fmt: skip
    write_rows(tmp_path, "rollout", evals)
    found = curves(tmp_path)
    assert list(found) == ["eval", "overview"]
    assert found["eval"] == {"arithmetic": [(0, 0.0), (5, 0.5)]}


def test_the_pngs_are_pngs_of_the_size_asked_and_only_for_curves_with_data(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plots"
    written = write_plots(run_dir, out, dpi=DPI)
    names = {"reward", "zero_variance", "throughput", "staleness", "step_time", "logprob_gap",
             "losses", "overview"}  # fmt: skip
    assert {p.name for p in out.iterdir()} == {f"{n}.png" for n in names}
    assert not (out / "eval.png").exists()  # the run has no held-out evals
    assert set(written) == {out / f"{n}.png" for n in names}
    panel = (6 * DPI, int(3.6 * DPI))
    assert png_size(out / "reward.png") == panel
    assert png_size(out / "losses.png") == (2 * panel[0], panel[1])  # two losses side by side
    assert png_size(out / "overview.png") == (2 * panel[0], 2 * panel[1])
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if line.startswith("wrote ")] == [
        f"wrote {path}" for path in written
    ]
    assert "no data in this run for: eval" in printed


def test_the_default_out_is_the_run_dirs_plots_folder(tmp_path: Path) -> None:
    write_rows(tmp_path, "rollout", [batch(1, "arithmetic", 0.5)])
    write_plots(tmp_path, dpi=DPI)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "overview.png",
        "reward.png",
        "throughput.png",
    ]


def test_garbage_and_torn_lines_are_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_rows(tmp_path, "rollout", [batch(1, "arithmetic", 0.5), batch(2, "arithmetic", 0.7)])
    rollout = tmp_path / "metrics" / "rollout.jsonl"
    good = rollout.read_bytes()
    # Garbage, a line that is no object, and a live writer's torn last line.
    rollout.write_bytes(b"\x00\xff not json\n[1, 2]\n" + good + b'{"time": NaN, "event": "ba')
    write_plots(tmp_path, dpi=DPI)
    assert "skipped 2 lines of metrics/rollout.jsonl" in capsys.readouterr().out
    assert curves(tmp_path)["reward"] == {"arithmetic": [(1, 0.5), (2, 0.7)]}


def no_metrics(run: Path) -> None:
    (run / "metrics").mkdir(parents=True)


def no_curve_rows(run: Path) -> None:
    write_rows(run, "coordinator", [{"coordinator/nodes": 1}])


def only_garbage(run: Path) -> None:
    no_metrics(run)
    (run / "metrics" / "trainer.jsonl").write_bytes(b"\x00\xff garbage\n[]\n{")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (None, "no such directory"),
        (no_metrics, "no metrics/*.jsonl"),
        (no_curve_rows, "no curves to plot"),
        (only_garbage, "no curves to plot"),
    ],
)
def test_bad_run_dirs_are_one_line_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], None] | None,
    message: str,
) -> None:
    run = tmp_path / "run"
    if make is not None:
        make(run)
    with pytest.raises(AgentjetError, match=re.escape(message)):
        write_plots(run, dpi=DPI)
    code = cli_main(["plot", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err
    assert not (run / "plots").exists()


def test_the_command_writes_the_plots_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_rows(tmp_path, "rollout", [batch(1, "arithmetic", 0.5)])
    out = tmp_path / "report"
    assert cli_main(["plot", "--run-dir", str(tmp_path), "--out", str(out), "--dpi", "30"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {out / 'reward.png'}",
        f"wrote {out / 'throughput.png'}",
        f"wrote {out / 'overview.png'}",
        "no data in this run for: eval, zero_variance, staleness, step_time, logprob_gap",
    ]
    assert png_size(out / "overview.png") == (2 * 6 * 30, int(3.6 * 30))  # two panels, one row
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert cli_main(["plot", "--run-dir", str(tmp_path), "--out", str(blocked)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write plots to {blocked}" in err


@pytest.mark.parametrize(
    ("span_s", "label"),
    [(60, "seconds"), (15 * 60, "minutes"), (5 * 3600, "hours")],
)
def test_the_time_axis_unit_fits_the_runs_length(span_s: float, label: str) -> None:
    run = RunRows(rows={"trainer": [{"time": START}, {"time": START + span_s}]})
    axis = time_axis(run)
    assert axis.start == START and axis.label.startswith(label)
