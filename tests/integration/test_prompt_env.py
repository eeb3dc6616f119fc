"""Bring your own data: `agentjet local` on a Parquet dataset of word answers, scored by
reward functions from a Python module, with held-out evaluation from a CSV file."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.integration.test_local import trained_locally

QUESTIONS = [
    ("Capital of France?", "Paris"),
    ("Opposite of hot?", "cold"),
    ("Colour of the sky?", "blue"),
    ("First letter of the alphabet?", "a"),
    ("Animal that barks?", "dog"),
    ("Frozen water is called?", "ice"),
]


def write_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """A Parquet training set in the user's own column names (one prompt a conversation
    with a system message), and a CSV held-out set."""
    import pyarrow
    import pyarrow.parquet

    rows = [
        {"qid": f"q{i}", "question": q, "solution": a, "topic": "trivia"}
        for i, (q, a) in enumerate(QUESTIONS)
    ]
    table = pyarrow.Table.from_pylist(rows)
    train = tmp_path / "train.parquet"
    pyarrow.parquet.write_table(table, train)
    held_out = tmp_path / "held_out.csv"
    with held_out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["qid", "question", "solution"])
        writer.writeheader()
        writer.writerows({"qid": f"h{i}", "question": q, "solution": "x"} for i, q in
                         enumerate(["Capital of Spain?", "Largest planet?"]))  # fmt: skip
    return train, held_out


@pytest.mark.integration
@pytest.mark.parametrize("sandboxed", [False, True], ids=["here", "in-sandboxes"])
def test_a_dataset_and_reward_functions_train_with_held_out_evaluation(
    tiny_model_dir: Path, tmp_path: Path, sandboxed: bool
) -> None:
    train, held_out = write_dataset(tmp_path)
    run_dir = tmp_path / "run"
    terms = (
        '[{name="even", function="tests.rewards:even_length"}, '
        '{name="says", function="tests.rewards:says_answer", weight=0.5}]'
    )
    settings = (
        'envs.0.name="prompt"',
        f"envs.0.task_file={json.dumps(str(train))}",
        f"envs.0.eval_file={json.dumps(str(held_out))}",
        'envs.0.id_field="qid"',
        'envs.0.prompt_field="question"',
        'envs.0.answer_field="solution"',
        f"envs.0.rewards={terms}",
        f"envs.0.reward_sandbox={str(sandboxed).lower()}",
        "rollout.eval_every=2",
        "trainer.reward_check_fraction=1.0",  # every group re-scored by the trainer
    )
    trainer, rollout, _ = trained_locally(tiny_model_dir, run_dir, 4, settings)
    steps = [r for r in trainer if r.get("event") == "step"]
    batches = [r for r in rollout if r.get("event") == "batch"]
    # both reward terms reported on their own; the tiny model earns "even" about half the time
    assert all({"reward/even", "reward/says"} <= r.keys() for r in batches)
    assert 0 < sum(r["reward/even"] for r in batches) / len(batches) < 1
    assert all(r["reward/errors"] == 0 for r in batches)

    # the trainer imported the same functions and agreed with every reward (sandboxed ones
    # are not re-scored there)
    [trainer_end] = [r for r in trainer if r.get("event") == "stopped"]
    assert trainer_end.get("groups_rejected_reward", 0) == 0
    # held-out evaluation before training and every 2 versions, from the CSV file
    evals = [r for r in rollout if r.get("event") == "eval"]
    assert evals and evals[0]["policy_version"] == 0
    assert all(r["eval/prompt/tasks"] == 2 for r in evals)
    assert all(0 <= r["eval/prompt/accuracy"] <= 1 for r in evals)
    versions = [r["policy_version"] for r in evals]
    assert versions == sorted(set(versions))

    # nothing lost, nothing trained twice
    created = [g for r in batches for g in r["group_ids"]]
    trained = [g for r in steps for g in r["trained_group_ids"]]
    stale = [g for r in trainer for g in r.get("stale_group_ids", [])]
    [rollout_end] = [r for r in rollout if r.get("event") == "stopped"]
    pending = trainer_end["queued_group_ids"] + rollout_end["unacked_group_ids"]
    assert len(trained) == len(set(trained))
    assert set(created) == set(trained) | set(stale) | set(pending)
