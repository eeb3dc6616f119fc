"""reasoning-gym by name: `agentjet local` trains the tiny model on rows reasoning-gym makes
on the fly, with per-task rewards, held-out evaluation without a file and the trainer
re-checking rewards; then `agentjet eval --env reasoning_gym` scores its checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests import procs
from tests.integration.test_local import trained_locally

TASKS = (
    '[{name="leg_counting", weight=1, config={min_animals=1, max_animals=2}}, '
    '{name="basic_arithmetic", weight=2, config={max_terms=2, max_digits=1}}]'
)


@pytest.mark.integration
def test_reasoning_gym_trains_and_evaluates_without_files(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    settings = (
        'envs.0.name="reasoning_gym"',
        f"envs.0.tasks={TASKS}",
        "envs.0.eval_rows=2",
        'envs.0.rg_answer="tags_or_text"',  # the random tiny model writes no tags
        "rollout.eval_every=2",
        "trainer.reward_check_fraction=1.0",  # every group re-scored by the trainer
    )
    trainer, rollout, _ = trained_locally(tiny_model_dir, run_dir, 3, settings)
    batches = [r for r in rollout if r.get("event") == "batch"]
    assert batches and all(r["env"] == "reasoning_gym" for r in batches)
    # each dataset's reward on its own, from the tasks the batch played
    reported = {k for r in batches for k in r if k.startswith("reward/")}
    assert reported <= {"reward/leg_counting", "reward/basic_arithmetic", "reward/errors"}
    assert "reward/basic_arithmetic" in reported
    assert all(r["reward/errors"] == 0 for r in batches)
    [trainer_end] = [r for r in trainer if r.get("event") == "stopped"]
    assert trainer_end.get("groups_rejected_reward", 0) == 0
    assert trainer_end.get("groups_reward_unchecked", 0) == 0  # every task rebuilt by id
    # held-out rows with no file: 2 per dataset, at version 0 and every 2 versions
    evals = [r for r in rollout if r.get("event") == "eval"]
    assert evals and evals[0]["policy_version"] == 0
    assert all(r["eval/reasoning_gym/tasks"] == 4 for r in evals)
    assert all("eval/reasoning_gym/leg_counting/accuracy" in r for r in evals)

    # `agentjet eval` on the run's checkpoint, the run's config naming the environment
    checkpoint = max((run_dir / "checkpoints").glob("v*"))
    result = procs.run(
        [sys.executable, "-m", "agentjet_app.cli", "eval", "--env", "reasoning_gym",
         "--checkpoint", str(checkpoint), "--config", str(run_dir / "config.toml")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["n"] == 4 and summary["decoding"] == "greedy"
    assert set(summary["by_op"]) == {"leg_counting", "basic_arithmetic"}
