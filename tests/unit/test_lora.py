"""LoRA: a rollout node that merges a version's adapters into its base weights runs the
same function as the trainer's peft model, from a blob a fraction of the full size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentjet.config import ModelConfig
from node.lora import AdapterMerger, add_adapters, merged_weights, write_adapter
from node.model import load_causal_lm
from node.weights import snapshot
from tests.engine_contract import LOGIT_ATOL

pytestmark = pytest.mark.unit

CONFIG = ModelConfig(lora_rank=4, lora_alpha=8)


def trained_adapters(model_dir: Path) -> torch.nn.Module:
    """A peft model whose adapters moved away from their init (B starts at zero)."""
    model, _ = load_causal_lm(model_dir)
    peft_model = add_adapters(model, CONFIG)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    return peft_model


def test_merged_adapters_give_the_trainers_function(tiny_model_dir: Path) -> None:
    trainer_model = trained_adapters(tiny_model_dir)
    engine_model, _ = load_causal_lm(tiny_model_dir)
    engine_state = {n: p.data for n, p in engine_model.named_parameters()}
    merger = AdapterMerger(engine_state, CONFIG)

    blob = snapshot(trainer_model, 1, 1 << 20)
    adapters = {n: p.detach() for n, p in trainer_model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    merged = merger.merge(adapters, engine_state)
    assert merged.keys() == engine_state.keys()
    with torch.no_grad():
        for key, tensor in merged.items():
            engine_state[key].copy_(tensor)
        tokens = torch.tensor([[1, 5, 9, 200, 31]])
        expected = trainer_model(input_ids=tokens).logits
        # W0·x + B·(A·x) against (W0 + B·A)·x: equal but for float32 rounding
        torch.testing.assert_close(
            engine_model(input_ids=tokens).logits, expected, rtol=0, atol=LOGIT_ATOL
        )
    # the adapters travel, not the model: a small fraction of the full weights' bytes
    full = snapshot(load_causal_lm(tiny_model_dir)[0], 1, 1 << 20)
    assert blob.nbytes < full.nbytes / 10

    # a second version merges from the base weights, not on top of the first
    again = merger.merge(adapters, engine_state)
    assert all(torch.equal(again[k], merged[k]) for k in merged)


def test_a_checkpoint_holds_the_merged_weights_under_plain_names(tiny_model_dir: Path) -> None:
    trainer_model = trained_adapters(tiny_model_dir)
    plain, _ = load_causal_lm(tiny_model_dir)
    weights = merged_weights(trainer_model, CONFIG)
    assert weights.keys() == dict(plain.named_parameters()).keys()
    changed = [k for k, t in plain.named_parameters() if not torch.equal(weights[k], t)]
    assert changed and all(
        k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
        for k in changed
    )


@pytest.mark.parametrize(
    ("key", "shape", "message"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (4, 64), "not a LoRA adapter"),
        (
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight",
            (4, 64),
            "does not fit",
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
            (4, 64),
            "does not fit",
        ),
    ],
)
def test_adapters_that_do_not_fit_are_refused(
    tiny_model_dir: Path, key: str, shape: tuple[int, int], message: str
) -> None:
    engine_model, _ = load_causal_lm(tiny_model_dir)
    engine_state = {n: p.data for n, p in engine_model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        AdapterMerger(engine_state, CONFIG).merge({key: torch.zeros(shape)}, engine_state)


def test_an_adapter_folder_loads_in_peft_as_the_trainers_function(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The folder a vLLM engine is given as a LoRA request: PEFT's format, read here by
    # PEFT itself (vLLM cannot run on this machine; tests/gpu/test_vllm_engine.py runs it).
    from peft import PeftModel

    trainer_model = trained_adapters(tiny_model_dir)
    adapters = {n: p.detach() for n, p in trainer_model.named_parameters() if p.requires_grad}
    base, _ = load_causal_lm(tiny_model_dir)
    folder = write_adapter(adapters, dict(base.named_parameters()), CONFIG, tmp_path / "v1")
    loaded = PeftModel.from_pretrained(base, str(folder))
    tokens = torch.tensor([[1, 5, 9, 200, 31]])
    with torch.no_grad():
        expected = trainer_model(input_ids=tokens).logits
        assert torch.allclose(loaded(input_ids=tokens).logits, expected, atol=1e-5)
        assert not torch.allclose(load_causal_lm(tiny_model_dir)[0](input_ids=tokens).logits,
                                  expected, atol=1e-3)  # fmt: skip  # the adapters matter


def test_an_adapter_folder_is_not_written_for_adapters_that_do_not_fit(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    base, _ = load_causal_lm(tiny_model_dir)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    with pytest.raises(ValueError, match="does not fit"):
        write_adapter({key: torch.zeros(4, 64)}, dict(base.named_parameters()), CONFIG, tmp_path)
    assert not (tmp_path / "adapter_model.safetensors").exists()
