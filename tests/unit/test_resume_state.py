"""What a trainer resumes from: the newest checkpoint's trainer state, or a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentjet.errors import ModelError
from node.model import load_causal_lm
from node.trainer_lineage import load_params
from node.weights import RESUME_STATE, prune_checkpoints, read_resume_state, save_checkpoint

pytestmark = pytest.mark.unit


def checkpoint(root: Path, model_dir: Path, version: int) -> Path:
    model, tokenizer = load_causal_lm(model_dir, "float32")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    directory = save_checkpoint(
        model,
        tokenizer,
        root / f"v{version:06d}",
        version,
        {},
        resume_state={"params": params, "optimizer": {"state": {}, "param_groups": []}},
    )
    (root / "latest").write_text(directory.name + "\n")
    return directory


def test_the_newest_checkpoint_is_resumed_and_a_damaged_one_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    assert read_resume_state(root) is None  # a new run
    directory = checkpoint(root, tiny_model_dir, 4)
    state = read_resume_state(root)
    assert state is not None and state["policy_version"] == 4
    assert all(isinstance(t, torch.Tensor) for t in state["params"].values())

    (directory / RESUME_STATE).write_bytes(b"not a torch file")
    with pytest.raises(ModelError, match=f"cannot resume from {directory / RESUME_STATE}"):
        read_resume_state(root)


def test_only_the_newest_checkpoints_are_kept(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for version in (2, 4, 6, 10):
        checkpoint(root, tiny_model_dir, version)
    (root / "v000012.tmp").mkdir()  # a save cut short: the next save replaces it
    assert prune_checkpoints(root, 0) == []  # 0 keeps every one
    deleted = prune_checkpoints(root, 2)
    assert [p.name for p in deleted] == ["v000002", "v000004"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "v000006", "v000010", "v000012.tmp"]
    state = read_resume_state(root)  # the newest is still what a restart resumes from
    assert state is not None and state["policy_version"] == 10


def test_a_full_fine_tune_resumes_its_parameters_from_the_saved_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Without "params" in the resume state (a full fine-tune's), they come from the
    checkpoint's safetensors, bit for bit; with neither, resuming is refused by name."""
    root = tmp_path / "checkpoints"
    model, tokenizer = load_causal_lm(tiny_model_dir, "float32")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.125)  # weights no fresh load of the base has
    directory = save_checkpoint(
        model, tokenizer, root / "v000003", 3, {}, resume_state={"optimizer": {}}
    )
    (root / "latest").write_text(directory.name + "\n")
    state = read_resume_state(root)
    assert state is not None and state["policy_version"] == 3
    fresh, _ = load_causal_lm(tiny_model_dir, "float32")
    load_params(fresh, state["params"], tmp_path)
    for (name, mine), theirs in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(mine, theirs), name

    for file in directory.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ModelError, match="no params in .* and no safetensors beside it"):
        read_resume_state(root)
