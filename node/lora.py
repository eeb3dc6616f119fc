"""LoRA: train small adapters instead of the full weights (`model.lora_rank > 0`).

    trainer: model ──add_adapters (peft)──▶ base frozen, adapters trainable
             ──SwarmOptimizer(adapters)──▶ averaged with the other trainers
             ──snapshot(trainable only)──▶ adapter tensors on the wire (a few MB)
    rollout: adapter tensors ──AdapterMerger──▶ W = W0 + (alpha / rank) · B @ A
             ──▶ engine.load_state_dict (full weights, as without LoRA)

Only this module imports peft. A rollout node keeps a copy of the base weights of the
adapted layers (W0), so each version is merged from the base, never on top of the last.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in adapters.items():
            match = _ADAPTER_KEY.match(key)
            if match is None:
                raise ValueError(f"{key!r} is not a LoRA adapter tensor")
            pairs.setdefault(match["module"] + ".weight", {})[match["ab"]] = tensor
        merged = dict(engine_state)
        for key, pair in pairs.items():
            if key not in self.base or pair.keys() != {"A", "B"}:
                raise ValueError(f"adapter for {key!r} does not fit this model")
            base = self.base[key]
            # Merged where the engine's weights are (its GPU, or the CPU).
            a, b = pair["A"].to(base.device), pair["B"].to(base.device)
            if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != base.shape:
                raise ValueError(f"adapter for {key!r} has shapes {a.shape}, {b.shape}")
            merged[key] = base + self.scale * (b.float() @ a.float()).to(base.dtype)
        return merged
