"""The metrics writer's trackers ([log] backends): every role's numbers in TensorBoard, the
JSONL untouched, and a tracker that fails costing a warning, never a row or a step."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path
from typing import Literal

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from agentjet.config import LogConfig, config_from_dict, to_toml
from agentjet.errors import ConfigError
from agentjet.metrics import MetricsWriter, read_metrics, tracker_scalars

pytestmark = pytest.mark.unit

TENSORBOARD = LogConfig(backends=["tensorboard"])

# Rows shaped like the roles' own: numbers, lists of ids, strings, tables, flags.
TRAINER_ROWS = [
    {"event": "started", "node_id": "t1", "policy_version": 0, "joined": False},
    {
        "event": "step",
        "policy_version": 1,
        "losses/policy_loss": 0.25,
        "charts/reward_mean": 0.5,
        "trained_group_ids": ["g1", "g2"],
        "queue": 3,
    },
    {
        "event": "step",
        "policy_version": 2,
        "losses/policy_loss": -0.125,
        "charts/reward_mean": 0.75,
        "trained_group_ids": ["g3"],
        "queue": 1,
    },
]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Each tag's (step, value, wall time) points, as TensorBoard reads them."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def write_all(writer: MetricsWriter, rows: list[dict[str, object]]) -> None:
    for row in rows:
        writer.write(row)
    writer.close()


def test_the_jsonl_rows_are_the_same_with_trackers_on(tmp_path: Path) -> None:
    write_all(MetricsWriter(tmp_path / "plain", "trainer"), TRAINER_ROWS)
    write_all(MetricsWriter(tmp_path / "tracked", "trainer", TENSORBOARD), TRAINER_ROWS)
    plain = read_metrics(tmp_path / "plain" / "metrics" / "trainer.jsonl")
    tracked = read_metrics(tmp_path / "tracked" / "metrics" / "trainer.jsonl")
    assert [list(r) for r in tracked] == [list(r) for r in plain]  # same keys, same order
    assert [{**r, "time": 0} for r in tracked] == [{**r, "time": 0} for r in plain]
    assert plain == [
        {"time": r["time"], "role": "trainer", **row}
        for r, row in zip(plain, TRAINER_ROWS, strict=True)
    ]


def test_tensorboard_shows_each_role_as_a_run_with_its_numbers(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r1"
    write_all(MetricsWriter(run_dir, "trainer", TENSORBOARD), TRAINER_ROWS)
    rollout_rows = [
        {"event": "batch", "policy_version": 1, "perf/samples_per_s": 4.5, "group_ids": []},
        {"event": "batch", "policy_version": 2, "perf/samples_per_s": 6.0, "env": "shell"},
    ]
    write_all(MetricsWriter(run_dir, "rollout", TENSORBOARD), rollout_rows)

    # `tensorboard --logdir runs/` finds one run per role.
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "runs"))
    runs.Reload()
    assert sorted(runs.Runs()) == ["r1/tensorboard/rollout", "r1/tensorboard/trainer"]

    times = [r["time"] for r in read_metrics(run_dir / "metrics" / "trainer.jsonl")]
    trainer = scalars(run_dir / "tensorboard" / "trainer")
    # Numbers only (no ids, strings or flags), a bare key under the role; the step is the
    # policy version and the wall time the row's own.
    assert trainer == {
        "losses/policy_loss": [(1, 0.25, times[1]), (2, -0.125, times[2])],
        "charts/reward_mean": [(1, 0.5, times[1]), (2, 0.75, times[2])],
        "trainer/queue": [(1, 3.0, times[1]), (2, 1.0, times[2])],
    }
    times = [r["time"] for r in read_metrics(run_dir / "metrics" / "rollout.jsonl")]
    assert scalars(run_dir / "tensorboard" / "rollout") == {
        "perf/samples_per_s": [(1, 4.5, times[0]), (2, 6.0, times[1])]
    }


def test_rows_without_a_version_take_the_latest_or_count(tmp_path: Path) -> None:
    write_all(
        MetricsWriter(tmp_path, "rollout", TENSORBOARD),
        [
            {"event": "restored", "groups_created": 0},  # before any version: row 0
            {"event": "batch", "policy_version": 3, "groups_created": 8},
            {"event": "stopped", "groups_created": 16},  # the latest version, 3
        ],
    )
    points = scalars(tmp_path / "tensorboard" / "rollout")["rollout/groups_created"]
    assert [(step, value) for step, value, _ in points] == [(0, 0.0), (3, 8.0), (3, 16.0)]
    # The coordinator has no versions: its rows are counted.
    write_all(
        MetricsWriter(tmp_path, "coordinator", TENSORBOARD),
        [{"coordinator/nodes": n} for n in (1, 2, 2)],
    )
    points = scalars(tmp_path / "tensorboard" / "coordinator")["coordinator/nodes"]
    assert [(step, value) for step, value, _ in points] == [(0, 1.0), (1, 2.0), (2, 2.0)]


def test_only_finite_numbers_reach_a_tracker() -> None:
    row = {
        "time": 1.5,
        "role": "rollout",
        "event": "batch",
        "policy_version": 4,
        "charts/reward_mean": 0.5,
        "unacked": 7,
        "joined": True,
        "perf/nan": float("nan"),
        "perf/inf": float("inf"),
        "huge": 10**400,
        "group_ids": ["a"],
        "sandbox/faults": {"timeout": 2},
        "lineage": "abc",
    }
    assert tracker_scalars(row, "rollout") == {"charts/reward_mean": 0.5, "rollout/unacked": 7.0}


def test_a_tracker_that_fails_mid_run_costs_one_warning_never_a_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = MetricsWriter(tmp_path, "trainer", TENSORBOARD)
    writer.write(TRAINER_ROWS[1])
    log_dir = tmp_path / "tensorboard" / "trainer"
    shutil.rmtree(log_dir)
    log_dir.write_text("")  # the tracker's dir is gone: every write to it fails
    with caplog.at_level(logging.WARNING, logger="agentjet.metrics"):
        for row in TRAINER_ROWS[1:]:
            writer.write(row)  # never raises into the role
        writer.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tensorboard" in warnings[0].getMessage()
    assert list(writer.failed) == ["tensorboard"]
    assert "NotADirectoryError" in writer.failed["tensorboard"]
    rows = read_metrics(tmp_path / "metrics" / "trainer.jsonl")
    assert [r["event"] for r in rows] == ["step", "step", "tracker_failed", "step"]
    assert rows[2]["backend"] == "tensorboard"


def test_a_tracker_that_cannot_start_costs_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "tensorboard").write_text("")  # no dir can be made for the event files
    with caplog.at_level(logging.WARNING, logger="agentjet.metrics"):
        writer = MetricsWriter(tmp_path, "coordinator", TENSORBOARD)
        write_all(writer, [{"coordinator/nodes": 1}, {"coordinator/nodes": 2}])
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert list(writer.failed) == ["tensorboard"]
    rows = read_metrics(tmp_path / "metrics" / "coordinator.jsonl")
    assert [r.get("event") for r in rows] == ["tracker_failed", None, None]
    assert [r.get("coordinator/nodes") for r in rows[1:]] == [1, 2]


@pytest.mark.parametrize("backend", ["wandb", "trackio"])
def test_a_tracker_not_installed_is_one_line_that_says_what_to_install(
    tmp_path: Path, backend: Literal["wandb", "trackio"]
) -> None:
    if importlib.util.find_spec(backend) is not None:
        pytest.skip(f"{backend} is installed here (its start would reach the network)")
    with pytest.raises(ConfigError) as e:
        MetricsWriter(tmp_path, "trainer", LogConfig(backends=[backend]))
    assert "\n" not in str(e.value) and f"pip install {backend}" in str(e.value)
    assert not (tmp_path / "metrics").exists()  # refused before anything was opened


def test_the_log_section_is_checked_and_round_trips() -> None:
    config = config_from_dict({"log": {"backends": ["tensorboard", "wandb"], "project": "p"}})
    assert config.log.backends == ["tensorboard", "wandb"] and config.log.group == ""
    assert config_from_dict({}).log.backends == []  # JSONL only
    assert "\n[log]\nbackends = []\n" in to_toml(config_from_dict({}))
    with pytest.raises(ConfigError, match=r"log\.backends\.0.*allowed: tensorboard, wandb"):
        config_from_dict({"log": {"backends": ["mlflow"]}})
