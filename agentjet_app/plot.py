"""PNG figures of a run's main curves, for reports: `agentjet plot --run-dir DIR [--out DIR]`.

    metrics/<role>.jsonl ──read_run──▶ rows by role ──charts──▶ Chart: panels of series
    (the dashboard's reader:            (pure: which rows       ──write_plots──▶ <out>/<name>.png
     torn or garbage lines skipped)      feed which curve)          (matplotlib, Agg canvas)

Writes into `--out` (default <run dir>/plots), each only when the run has its data:

    reward.png         reward mean of the rollout batches, one line per environment
    eval.png           held-out accuracy (`eval/<env>/accuracy`, with rollout.eval_every)
    zero_variance.png  share of a trainer step's groups whose samples all got one reward
    throughput.png     samples/s of the trainer and the rollout node, and effective
                       samples/s: the trainer's, times the step's share of samples with
                       gradient (`charts/trained_samples / charts/samples`)
    staleness.png      policy versions behind, mean and max per step
    step_time.png      learner step and time per policy version (s)
    logprob_gap.png    sampler vs learner logprob gap (nats), max and mean per step
                       (a step without a sample with gradient has no gap and no losses)
    losses.png         one panel per `losses/*` key of the trainer's step rows
    overview.png       the first four of the panels above that have data, 2 x 2

The x axis of every figure is wall time since the run's first metrics row (s, min or h,
as the run's length fits), as on the dashboard, so figures of one run line up.
matplotlib is imported only when figures are drawn, never by the other commands.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentjet.errors import AgentjetError
from agentjet_app.dashboard.reader import read_rows

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# One panel's size in inches; a figure of several panels puts them on a grid of such cells.
PANEL_SIZE_IN = (6.0, 3.6)
# Pixels per inch of the PNGs: a single panel is 600 x 360 pixels, the overview 1200 x 720.
DEFAULT_DPI = 100
# Panels in overview.png: a 2 x 2 grid, enough for a report's first look.
OVERVIEW_PANELS = 4
# Markers on a series with this many points or fewer (held-out evals, short runs).
MARKER_MAX_POINTS = 60
# The x axis unit: seconds below this span, hours from the next, minutes between.
SECONDS_AXIS_MAX_S = 180
MINUTES_AXIS_MAX_S = 3 * 3600

Point = tuple[float, float]  # (unix time, value)


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: dict[str, list[Point]]  # legend name -> points, oldest first


@dataclass(frozen=True)
class Chart:
    name: str  # the PNG's file stem
    panels: list[Panel]


@dataclass
class RunRows:
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # role -> rows
    skipped: dict[str, int] = field(default_factory=dict)  # role -> lines not a JSON object


@dataclass(frozen=True)
class Axis:
    start: float  # unix time of x = 0
    seconds_per_unit: float
    label: str


def read_run(run_dir: Path) -> RunRows:
    """Every role's complete rows; a missing run dir or one without metrics is an error."""
    if not run_dir.is_dir():
        raise AgentjetError(f"--run-dir {run_dir}: no such directory")
    files = sorted((run_dir / "metrics").glob("*.jsonl"))
    if not files:
        raise AgentjetError(
            f"--run-dir {run_dir}: no metrics/*.jsonl in it; give the run dir that "
            "agentjet local or agentjet node printed (runs/<timestamp>)"
        )
    run = RunRows()
    for path in files:
        rows, skipped = _read_all(path)
        run.rows[path.stem] = rows
        if skipped:
            run.skipped[path.stem] = skipped
    return run


def _read_all(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The complete rows of a metrics file, in bounded reads, and the lines skipped."""
    rows: list[dict[str, Any]] = []
    skipped = offset = 0
    try:
        while True:
            part = read_rows(path, offset)
            rows += part.rows
            skipped += part.skipped
            offset = part.next_offset
            if not part.more:
                return rows, skipped
    except OSError as e:
        raise AgentjetError(f"cannot read {path}: {e.strerror or e}") from None


# The single-panel figures: file stem, title, y axis label.
FIGURES = (
    ("reward", "Reward mean of rollout batches, by environment", "reward"),
    ("eval", "Held-out accuracy, by environment", "accuracy"),
    ("zero_variance", "Zero-variance groups (share of the step's groups)", "share"),
    ("throughput", "Samples/s (effective: samples with gradient)", "samples/s"),
    ("staleness", "Policy staleness (versions behind)", "versions"),
    ("step_time", "Step time", "s"),
    ("logprob_gap", "Logprob gap, sampler vs learner", "nats"),
)


def charts(run: RunRows) -> list[Chart]:
    """The figures the run has data for, in the order of the module docstring."""
    points: dict[str, dict[str, list[Point]]] = {}
    for role, rows in run.rows.items():
        for row in rows:
            time = _number(row.get("time"))
            if time is None:
                continue
            for chart, series, value in row_points(role, row):
                number = _number(value)
                if number is not None:
                    points.setdefault(chart, {}).setdefault(series, []).append((time, number))
    found = [
        Chart(name, [Panel(title, ylabel, _by_time(points[name]))])
        for name, title, ylabel in FIGURES
        if name in points
    ]
    losses = [Panel(key, "", _by_time(points[key])) for key in points if key.startswith("losses/")]
    if losses:
        found.append(Chart("losses", losses))
    if found:
        panels = [panel for chart in found for panel in chart.panels]
        found.append(Chart("overview", panels[:OVERVIEW_PANELS]))
    return found


def row_points(role: str, row: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(chart, series, value) for each curve one metrics row feeds; a value that is no
    finite number is dropped later."""
    event = row.get("event")
    if event == "batch":
        env = row.get("env")
        name = env if isinstance(env, str) and env else "all"
        return [
            ("reward", name, row.get("charts/reward_mean")),
            ("throughput", role, row.get("perf/samples_per_s")),
        ]
    if event == "eval":
        return [
            ("eval", key.removeprefix("eval/").removesuffix("/accuracy"), value)
            for key, value in row.items()
            if key.startswith("eval/") and key.endswith("/accuracy")
        ]
    if event != "step":
        return []
    # A step without a sample with gradient (all its groups zero-variance) computed no
    # loss and no logprob gap; it writes them as 0, which is no point on those curves.
    computed = _number(row.get("charts/trained_samples")) != 0
    losses = [
        (key, key.removeprefix("losses/"), value)
        for key, value in row.items()
        if key.startswith("losses/") and computed
    ]
    return [
        ("zero_variance", "share", zero_variance_share(row)),
        ("throughput", role, row.get("perf/samples_per_s")),
        ("throughput", f"{role}, effective", effective_samples_per_s(row)),
        ("staleness", "mean", row.get("charts/staleness_mean")),
        ("staleness", "max", row.get("charts/staleness_max")),
        ("step_time", "learner step", row.get("perf/step_s")),
        ("step_time", "per version", row.get("perf/s_per_version")),
        ("logprob_gap", "max", row.get("charts/logprob_gap_max") if computed else None),
        ("logprob_gap", "mean", mean_logprob_gap(row)),
        *losses,
    ]


def zero_variance_share(row: dict[str, Any]) -> float | None:
    """The share of a step's trained groups whose samples all got the same reward."""
    groups = row.get("trained_group_ids")
    zero = _number(row.get("charts/zero_variance_groups"))
    if not isinstance(groups, list) or not groups or zero is None:
        return None
    return min(zero / len(groups), 1.0)


def effective_samples_per_s(row: dict[str, Any]) -> float | None:
    """The trainer's samples/s times the step's share of samples with gradient."""
    rate = _number(row.get("perf/samples_per_s"))
    samples = _number(row.get("charts/samples"))
    trained = _number(row.get("charts/trained_samples"))
    if rate is None or trained is None or not samples:
        return None
    return rate * trained / samples


def mean_logprob_gap(row: dict[str, Any]) -> float | None:
    """The mean of a step's per-group sampler-vs-learner gaps."""
    gaps = row.get("logprob_gaps")
    found = [_number(gap) for gap in gaps.values()] if isinstance(gaps, dict) else []
    values = [gap for gap in found if gap is not None]
    return sum(values) / len(values) if values else None


def time_axis(run: RunRows) -> Axis:
    """Time since the run's first metrics row, in a unit its length fits."""
    times = [_number(row.get("time")) for rows in run.rows.values() for row in rows]
    known = [t for t in times if t is not None]
    start, end = (min(known), max(known)) if known else (0.0, 0.0)
    if end - start < SECONDS_AXIS_MAX_S:
        return Axis(start, 1.0, "seconds since the run's first metrics row")
    if end - start < MINUTES_AXIS_MAX_S:
        return Axis(start, 60.0, "minutes since the run's first metrics row")
    return Axis(start, 3600.0, "hours since the run's first metrics row")


def write_plots(run_dir: Path, out_dir: Path | None = None, dpi: int = DEFAULT_DPI) -> list[Path]:
    """Draw every chart the run has data for into `out_dir`; the PNGs written."""
    if dpi < 1:
        raise AgentjetError(f"--dpi must be >= 1, got {dpi}")
    if importlib.util.find_spec("matplotlib") is None:
        raise AgentjetError(
            "agentjet plot draws with matplotlib, which is not installed: "
            "pip install 'agentjet[plot]' (./just setup installs it)"
        )
    run = read_run(run_dir)
    found = charts(run)
    for role, count in run.skipped.items():
        print(f"skipped {count} lines of metrics/{role}.jsonl that are not JSON objects")
    if not found:
        raise AgentjetError(
            f"--run-dir {run_dir}: no curves to plot yet; the rollout node writes its first "
            "batch row and the trainer its first step row after their first batch"
        )
    out = out_dir if out_dir is not None else run_dir / "plots"
    axis = time_axis(run)
    written = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for chart in found:
            path = out / f"{chart.name}.png"
            _draw(chart.panels, axis, dpi, path)
            print(f"wrote {path}")
            written.append(path)
    except OSError as e:
        raise AgentjetError(f"cannot write plots to {out}: {e.strerror or e}") from None
    missing = [name for name, _, _ in FIGURES if name not in {c.name for c in found}]
    if missing:
        print(f"no data in this run for: {', '.join(missing)}")
    return written


def _draw(panels: list[Panel], axis: Axis, dpi: int, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    width, height = PANEL_SIZE_IN
    figure = Figure(figsize=(width * columns, height * rows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(rows, columns, squeeze=False)
    for ax, panel in zip(grid.flat, panels, strict=False):
        _draw_panel(ax, panel, axis)
    for ax in grid.flat[len(panels) :]:
        ax.set_axis_off()
    figure.savefig(path, dpi=dpi)


def _draw_panel(ax: Axes, panel: Panel, axis: Axis) -> None:
    for name, points in panel.series.items():
        xs = [(t - axis.start) / axis.seconds_per_unit for t, _ in points]
        ys = [value for _, value in points]
        marker = "o" if len(points) <= MARKER_MAX_POINTS else None
        ax.plot(xs, ys, label=name, linewidth=1.2, marker=marker, markersize=2.5)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(axis.label, fontsize=8)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _by_time(series: dict[str, list[Point]]) -> dict[str, list[Point]]:
    return {name: sorted(points) for name, points in series.items()}


def _number(value: Any) -> float | None:
    """A finite int or float (not a bool) as a float, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value) if math.isfinite(value) else None
    except OverflowError:  # an int beyond float range
        return None
