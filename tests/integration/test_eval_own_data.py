"""`agentjet eval` on your own data, as a user runs it: a task file and a reward function
on the command line, a run's saved config, and the answers shown beside their rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_cli import agentjet

pytestmark = pytest.mark.integration

ROWS = [
    {"id": "capital-fr", "prompt": "Capital of France?", "answer": "Paris"},
    {"id": "capital-it", "prompt": "Capital of Italy?", "answer": "Rome"},
    {"id": "capital-es", "prompt": "Capital of Spain?", "answer": "Madrid"},
]


@pytest.fixture
def capitals(tmp_path: Path) -> Path:
    path = tmp_path / "capitals.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def test_a_task_file_and_a_reward_on_the_command_line_are_enough(
    tiny_model_dir: Path, capitals: Path
) -> None:
    result = agentjet(
        "eval", "--checkpoint", str(tiny_model_dir), "--tasks", str(capitals),
        "--env", "prompt", "--set", "envs.0.reward=tests.rewards:even_length",
        "--set", "rollout.sampling.max_new_tokens=6", "--show", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # stdout holds the JSON alone
    assert summary["env"] == "prompt" and summary["n"] == 3
    assert 0.0 <= summary["cut_at_max_new_tokens"] <= 1.0
    # --show 2: the first two tasks, each prompt with its expected answer, the model's
    # answer and the reward it scored; the third task is not shown
    shown = result.stderr
    assert "--- task capital-fr (1 of 2) ---" in shown
    assert "--- task capital-it (2 of 2) ---" in shown and "capital-es" not in shown
    assert "Capital of France?" in shown and "expected: Paris" in shown
    headings = [line for line in shown.splitlines() if line.startswith("answer (reward ")]
    assert len(headings) == 2
    assert all(h.split()[2].rstrip(";):") in ("0", "1") for h in headings)  # even_length


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ([], "envs.0.reward"),  # no reward at all
        (["--set", "envs.0.reward=no_such_module:score"], "'no_such_module:score'"),
    ],
)
def test_a_missing_reward_is_refused_before_the_model_loads(
    tmp_path: Path, capitals: Path, settings: list[str], key: str
) -> None:
    # The model named here does not exist: reaching it would fail with that error instead.
    missing_model = tmp_path / "no-model"
    result = agentjet(
        "eval", "--checkpoint", "base", "--tasks", str(capitals), "--env", "prompt",
        "--set", f"model.name={json.dumps(str(missing_model))}", *settings,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert key in result.stderr and "reward" in result.stderr
    assert "no-model" not in result.stderr


def test_a_runs_saved_config_picks_its_environment(
    tiny_model_dir: Path, tmp_path: Path, capitals: Path
) -> None:
    held_out = tmp_path / "held_out.csv"
    held_out.write_text(
        "id,question,answer\npe,Capital of Peru?,Lima\ntd,Capital of Chad?,N'Djamena\n"
    )
    run_dir = tmp_path / "run"
    made = agentjet(
        "local", "--dry-run", "--run-dir", str(run_dir),
        "--set", f"model.name={json.dumps(str(tiny_model_dir))}",
        "--set", "rollout.sampling.max_new_tokens=4",
        "--set", "envs.0.name=prompt", "--set", f"envs.0.task_file={json.dumps(str(capitals))}",
        "--set", f"envs.0.eval_file={json.dumps(str(held_out))}",
        "--set", "envs.0.prompt_field=question",
        "--set", "envs.0.reward=tests.rewards:says_answer",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    # The run's config alone: its environment, its columns, its reward, its held-out file
    result = agentjet(
        "eval", "--config", str(run_dir / "config.toml"), "--checkpoint", "base", "--show", "1"
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["env"] == "prompt" and summary["n"] == 2
    assert "--- task pe (1 of 1) ---" in result.stderr
    assert "Capital of Peru?" in result.stderr and "expected: Lima" in result.stderr
    # says_answer: the tiny random model never names the capital
    assert summary["mean_reward"] == 0.0
    # and another task file, read with the same columns
    other = tmp_path / "other.csv"
    other.write_text("id,question,answer\npe,Capital of Peru?,Lima\n")
    result = agentjet(
        "eval", "--config", str(run_dir / "config.toml"), "--checkpoint", "base",
        "--tasks", str(other),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["n"] == 1
