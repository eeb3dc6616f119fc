"""verifiers environments with the real package (0.4.x): the small Taskset packages in
tests/vf_envs, importable as a user's installed package is (on PYTHONPATH, for every
process `agentjet local` starts), trained for a few versions with the tiny model; a taskset
whose rewards raise, hang and return NaN, counted and survived; `agentjet eval` on one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import procs
from tests.integration.test_local import trained_locally

pytestmark = pytest.mark.integration

PACKAGES = Path(__file__).parents[1] / "vf_envs"
REPO = Path(__file__).parents[2]
EVAL_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def packages_on_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [str(PACKAGES), str(REPO), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


def verifiers_env(package: str, args: str, *more: str) -> tuple[str, ...]:
    return (
        'envs.0.name="verifiers"',
        f'envs.0.verifiers_env="{package}"',
        f"envs.0.verifiers_args={args}",
        "rollout.group_size=2",
        "trainer.max_logprob_gap=0",  # lr 1e-3 moves the tiny model far per version
        *more,
    )


def test_a_single_turn_taskset_trains_with_its_rewards_and_eval_set(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = verifiers_env(
        "vf_words", "{count=6}", 'envs.0.verifiers_eval_args={split="test", count=3}',
        "envs.0.max_turns=1", "rollout.eval_every=2",
    )  # fmt: skip
    _, rollout, _ = trained_locally(tiny_model_dir, tmp_path / "run", 3, settings)
    batches = [r for r in rollout if r.get("event") == "batch"]
    rewards = [r["charts/reward_mean"] for r in batches]
    # the weighted sum (even length 1 + says the word 0.5): the random model earns some
    assert all(0 <= r <= 1.5 for r in rewards) and any(r > 0 for r in rewards)
    evals = [r for r in rollout if r.get("event") == "eval"]
    assert evals and evals[0]["policy_version"] == 0
    assert all(r["eval/verifiers/tasks"] == 3 for r in evals)


def test_a_tool_taskset_trains_over_several_turns(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = verifiers_env("vf_tools", "{count=4}", "envs.0.max_turns=2")
    _, rollout, _ = trained_locally(tiny_model_dir, tmp_path / "run", 2, settings)
    batches = [r for r in rollout if r.get("event") == "batch"]
    assert batches and all(r["charts/reward_mean"] >= 0 for r in batches)


def test_rewards_that_raise_hang_or_give_nan_fail_their_episodes_and_the_run_goes_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = verifiers_env(
        "vf_faulty", '{bad=["raise", "nan", "hang"], count=6}', "envs.0.episode_timeout_s=5",
        "envs.0.max_turns=1",
    )  # fmt: skip
    _, rollout, logs = trained_locally(tiny_model_dir, tmp_path / "run", 2, settings)
    batches = [r for r in rollout if r.get("event") == "batch"]
    assert max(r.get("groups_failed", 0) for r in batches) > 0
    assert "a reward raised RuntimeError: the reward broke" in logs
    assert "reward 'flaky' gave nan" in logs or "ran past 5 s" in logs


def test_agentjet_eval_scores_the_eval_set(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f"[model]\nname = {json.dumps(str(tiny_model_dir))}\n"
        "[rollout.sampling]\nmax_new_tokens = 6\n"
        '[[envs]]\nname = "verifiers"\nverifiers_env = "vf_words"\nmax_turns = 1\n'
        'verifiers_eval_args = {split = "test", count = 4}\n'
    )
    result = procs.run(
        [sys.executable, "-m", "agentjet_app.cli", "eval", "--checkpoint", "base",
         "--env", "verifiers", "--config", str(config)],
        capture_output=True, text=True, timeout=EVAL_TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["n"] == 4 and summary["env"] == "verifiers"
    assert 0 <= summary["overall"] <= 1 and 0 <= summary["mean_reward"] <= 1.5
    # a config without an eval set asks for a task file, in one line
    config.write_text(config.read_text().replace("verifiers_eval_args", "verifiers_args"))
    result = procs.run(
        [sys.executable, "-m", "agentjet_app.cli", "eval", "--checkpoint", "base",
         "--env", "verifiers", "--config", str(config)],
        capture_output=True, text=True, timeout=EVAL_TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "give --tasks FILE" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_v0_package_is_refused_in_one_line(tmp_path: Path) -> None:
    result = procs.run(
        [sys.executable, "-m", "agentjet_app.cli", "local", "--dry-run", "--run-dir",
         str(tmp_path), "--set", 'envs=[{name="verifiers", verifiers_env="vf_legacy"}]'],
        capture_output=True, text=True, timeout=EVAL_TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "config error at envs.0.verifiers_env: 'vf_legacy' has load_environment()" in (
        result.stderr
    )
    assert result.stderr.count("\n") == 1, result.stderr
