"""LoRA: train small adapters instead of the full weights (`model.lora_rank > 0`).

    trainer: model ──add_adapters (peft)──▶ base frozen, adapters trainable
             ──SwarmOptimizer(adapters)──▶ averaged with the other trainers
             ──snapshot(trainable only)──▶ adapter tensors on the wire (a few MB)
    rollout, torch engine: adapter tensors ──AdapterMerger──▶ W = W0 + (alpha / rank) · B @ A
             ──▶ engine.load_state_dict (full weights, as without LoRA)
    rollout, vLLM engine (`takes_adapters`): adapter tensors ──write_adapter──▶ a PEFT adapter
             folder ──▶ the engine's LoRA request (base weights untouched, no merge)

Only this module imports peft. A rollout node that merges keeps a copy of the base weights
of the adapted layers (W0), so each version is merged from the base, never on top of the
last.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from agentjet.config import ModelConfig

# peft's names for adapter tensors: <module>.lora_A.default.weight, under base_model.model.
_ADAPTER_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.default\.weight$"
)


def add_adapters(model: Any, config: ModelConfig) -> Any:
    """The model wrapped by peft with fresh adapters; only they require gradients."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=list(config.lora_targets),
        lora_dropout=0.0,
        bias="none",
    )
    return get_peft_model(model, lora)


def merged_weights(model: Any, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A peft model's weights as the plain model's, adapters merged in (for checkpoints
    that transformers and `agentjet eval` load without peft)."""
    own = dict(model.get_base_model().named_parameters())
    base = {k.replace(".base_layer.", "."): t.detach() for k, t in own.items() if ".lora_" not in k}
    adapters = {k: t.detach() for k, t in model.named_parameters() if ".lora_" in k}
    return AdapterMerger(base, config).merge(adapters, base)


class AdapterMerger:
    """Rollout side: turns a version's adapter tensors into the engine's full weights."""

    def __init__(self, engine_state: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
        self.scale = config.lora_alpha / config.lora_rank
        targets = tuple(f".{t}.weight" for t in config.lora_targets)
        # W0 of every layer an adapter may change, copied before any version is loaded.
        self.base = {k: t.clone() for k, t in engine_state.items() if k.endswith(targets)}

    def merge(
        self, adapters: Mapping[str, torch.Tensor], engine_state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Full weights: the engine's own for layers without adapters, W0 + scale·B@A for
        the others. Raises ValueError for a key, pair or shape that does not fit."""
        merged = dict(engine_state)
        for module, (a, b) in adapter_pairs(adapters, self.base).items():
            base = self.base[module + ".weight"]
            # Merged where the engine's weights are (its GPU, or the CPU).
            a, b = a.to(base.device), b.to(base.device)
            merged[module + ".weight"] = base + self.scale * (b.float() @ a.float()).to(base.dtype)
        return merged


def random_adapters(
    model: torch.nn.Module, config: ModelConfig, seed: int, b_scale: float = 0.1
) -> dict[str, torch.Tensor]:
    """Adapters for `model` in peft's names with random values (tests and benchmarks: a
    trained adapter without training): A ~ N(0, 1/in), B ~ N(0, b_scale²) on every Linear
    named in `config.lora_targets`, of rank `config.lora_rank`."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in config.lora_targets:
            rows, cols = module.weight.shape
            r = config.lora_rank
            a = torch.randn(r, cols, generator=generator) / cols**0.5
            b = torch.randn(rows, r, generator=generator) * b_scale
            out[f"base_model.model.{name}.lora_A.default.weight"] = a
            out[f"base_model.model.{name}.lora_B.default.weight"] = b
    return out


def adapter_pairs(
    adapters: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A version's adapter tensors (peft's names) as {module: (A, B)}, each checked against
    the base weight it adapts (`base`: HF names). ValueError for a key, pair or shape that
    does not fit: they come from another node."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapters.items():
        match = _ADAPTER_KEY.match(key)
        if match is None:
            raise ValueError(f"{key!r} is not a LoRA adapter tensor")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    checked = {}
    for module, pair in pairs.items():
        weight = base.get(module + ".weight")
        if weight is None or pair.keys() != {"A", "B"}:
            raise ValueError(f"adapter for {module + '.weight'!r} does not fit this model")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != weight.shape:
            raise ValueError(f"adapter for {module + '.weight'!r} has shapes {a.shape}, {b.shape}")
        checked[module] = (a, b)
    return checked


def write_adapter(
    adapters: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    config: ModelConfig,
    directory: Path,
) -> Path:
    """A version's adapters as a PEFT adapter folder (adapter_config.json and
    adapter_model.safetensors), the format vLLM's LoRA requests and
    `peft.PeftModel.from_pretrained` load. Checked as `adapter_pairs`; returns `directory`."""
    from safetensors.torch import save_file

    pairs = adapter_pairs(adapters, base)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().cpu().contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "target_modules": sorted(config.lora_targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(settings, indent=1))
    return directory
