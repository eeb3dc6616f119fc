"""The `agentjet` command as a user types it: help, dry runs, eval, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import procs

pytestmark = pytest.mark.integration

CLI_TIMEOUT_S = 300


def agentjet(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return procs.run(
        [sys.executable, "-m", "agentjet_app.cli", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["local"],
        ["node"],
        ["coordinator"],
        ["eval"],
        ["tasks"],
        ["status"],
        ["sandbox"],
        ["sandbox", "build-image"],
        ["agent"],
        ["keys"],
        ["keys", "init"],
        ["plot"],
        ["dashboard"],
    ],
)
def test_every_subcommand_has_help(command):
    result = agentjet(*command, "--help")
    assert result.returncode == 0
    assert "usage: agentjet" in result.stdout


def test_dry_run_writes_resolved_config(tmp_path):
    result = agentjet("local", "--dry-run", "--run-dir", str(tmp_path), "--set", "trainer.lr=3e-5")
    assert result.returncode == 0, result.stderr
    assert "lr = 3e-05" in (tmp_path / "config.toml").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["local", "--dry-run", "--set", "trainer.lrr=1"],
            "config error at trainer.lrr: unknown key",
        ),
        (["local", "--dry-run", "--set", "nonsense"], "expected key.path=value"),
        (["node", "--role", "trainer", "--config", "missing.toml"], "missing.toml does not exist"),
        (["local", "--max-steps", "-1"], "--max-steps must be >= 0"),
        (["tasks", "--count", "3", "--difficulties", "7", "--out", "x"], "--difficulties"),
        (["node", "--role", "judge"], "argument --role: invalid choice: 'judge'"),
        (["eval", "--tasks", "t.jsonl"], "give --checkpoint DIR (or base), or --policy NAME"),
        (["eval", "--tasks", "t.jsonl", "--policy", "a"], "--policy a: no checkpoint in"),
        (
            ["node", "--role", "rollout", "--policy", "a"],
            "--policy and --policy-count are for --role trainer",
        ),
        (
            ["node", "--role", "trainer", "--set", "net.insecure=true", "--policy", "a"],
            "--policy a: no such [[policies]] entry (none)",
        ),
        (
            ["node", "--role", "trainer", "--set", "net.insecure=true", "--policy", "a,zz"]
            + ["--set", 'policies.0.name="a"', "--set", 'policies.1.name="b"'],
            "--policy zz: no such [[policies]] entry (a, b)",
        ),
        (
            ["node", "--role", "trainer", "--set", "net.insecure=true", "--policy-count", "3"]
            + ["--set", 'policies.0.name="a"', "--set", 'policies.1.name="b"'],
            "--policy-count 3: between 1 and the number of policies (a, b)",
        ),
        (["train"], "invalid choice: 'train'"),
        (["agent", "--rollout", "http://x", "--agent", "nomodule"], "like module:function"),
        (["agent", "--rollout", "http://x", "--agent", "no_such_mod:f"], "cannot be loaded"),
        (["local", "--dry-run", "--set", "envs.0.name=agent"], "needs agent"),
        (["local", "--dry-run", "--set", "rollout.agent_listen=nowhere"], "is not HOST:PORT"),
        (["tasks", "--env", "python_code", "--count", "999", "--out", "x"], "ask for fewer"),
        (["node", "--role", "trainer"], "run `agentjet keys init` once"),
        (["coordinator", "--keys", "nope.keys"], "cannot read swarm keys nope.keys"),
        (["local", "--keys", "k", "--set", "net.insecure=true"], "net.keys is set too"),
        (["node", "--role", "teacher", "--set", "net.insecure=true"], "needs a teacher to serve"),
        (["node", "--role", "trainer", "--teacher", "x"], "--teacher is for --role teacher"),
        (["node", "--role", "teacher", "--teacher", "./nowhere"], "not a model folder"),
        (
            ["local", "--dry-run", "--set", 'rollout.teachers="nodes"'],
            "agentjet local cannot find",
        ),
        (
            ["node", "--role", "rollout", "--set", 'rollout.teachers="nodes"'],
            "a rollout node without --join cannot find",
        ),
    ],
)
def test_user_errors_are_one_line(args, message, tmp_path):
    (tmp_path / "t.jsonl").write_text('{"id": "a", "prompt": "1+1?", "answer": 2}\n')
    result = agentjet(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_eval_reports_accuracy_by_difficulty(tiny_model_dir: Path, tmp_path: Path):
    tasks = tmp_path / "tasks.jsonl"
    assert agentjet("tasks", "--count", "12", "--seed", "3", "--out", str(tasks)).returncode == 0
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    assert len(rows) == 12 and {r["difficulty"] for r in rows} == {1, 2, 3}
    result = agentjet(
        "eval", "--checkpoint", str(tiny_model_dir), "--tasks", str(tasks),
        "--set", "rollout.sampling.max_new_tokens=4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["n"] == 12
    assert set(summary["by_difficulty"]) == {"1", "2", "3"}
    assert set(summary["by_op"]) == {"+", "-", "*"}
    assert 0.0 <= summary["overall"] <= 1.0
    assert summary["decoding"] == "greedy"


def test_eval_samples_answers_at_the_rollout_temperature(tiny_model_dir: Path, tmp_path: Path):
    tasks = tmp_path / "tasks.jsonl"
    assert agentjet("tasks", "--count", "5", "--seed", "3", "--out", str(tasks)).returncode == 0
    result = agentjet(
        "eval", "--checkpoint", str(tiny_model_dir), "--tasks", str(tasks), "--samples", "3",
        "--batch-size", "4", "--set", "rollout.sampling.max_new_tokens=4",
        "--set", "rollout.sampling.temperature=0.7",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["n"] == 5
    assert summary["decoding"] == "3 per task, sampled at temperature 0.7"
    result = agentjet("eval", "--checkpoint", str(tiny_model_dir), "--tasks", str(tasks),
                      "--samples", "-1")  # fmt: skip
    assert result.returncode == 2 and "--samples must be >= 0" in result.stderr


def test_eval_scores_a_parquet_held_out_set_with_your_reward_function(
    tiny_model_dir: Path, tmp_path: Path
):
    import pyarrow
    import pyarrow.parquet

    rows = [{"q": f"Say something {i}", "answer": "x"} for i in range(6)]
    held_out = tmp_path / "held_out.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), held_out)
    train = tmp_path / "train.jsonl"
    train.write_text('{"id": "t", "prompt": "Say something"}\n')
    config = tmp_path / "config.toml"
    config.write_text(
        f"[model]\nname = {json.dumps(str(tiny_model_dir))}\n"
        "[rollout.sampling]\nmax_new_tokens = 5\n"
        f'[[envs]]\nname = "prompt"\ntask_file = {json.dumps(str(train))}\n'
        'prompt_field = "q"\nreward = "tests.rewards:even_length"\n'
    )
    result = agentjet(
        "eval", "--checkpoint", "base", "--tasks", str(held_out), "--env", "prompt",
        "--config", str(config), "--samples", "4", "--batch-size", "24",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["n"] == 6 and summary["env"] == "prompt"
    # even_length: a reward of 0 or 1 per answer, so accuracy and mean reward agree
    assert 0 < summary["mean_reward"] < 1
    assert summary["overall"] == summary["mean_reward"]


def test_eval_rejects_bad_inputs_with_one_line(tiny_model_dir: Path, tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "1+1?", "answer": 2}\n{"id": "b", "prompt": 5}\n')
    result = agentjet("eval", "--checkpoint", str(tiny_model_dir), "--tasks", str(bad))
    assert result.returncode == 2
    assert "line 2" in result.stderr and result.stderr.count("\n") == 1
    result = agentjet("eval", "--checkpoint", str(tmp_path), "--tasks", str(bad))
    assert result.returncode == 2 and "not a checkpoint folder" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a box without CUDA")
@pytest.mark.parametrize(
    "args",
    [
        ["local", "--set", "trainer.device=cuda"],
        ["node", "--role", "trainer", "--set", "net.insecure=true", "--set", "trainer.device=cuda"],
    ],
)
def test_a_gpu_asked_for_on_a_box_without_one_is_one_line(args, tmp_path):
    result = agentjet(*args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("agentjet: error: trainer.device = 'cuda' but torch sees no CUDA GPU")
    assert "Traceback" not in result.stderr
