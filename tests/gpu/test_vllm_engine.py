"""The vLLM engine against the engine contract, on a lent GPU (skipped elsewhere)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from agentjet.episode import SamplingParams
from tests.engine_contract import check_engine_contract

if TYPE_CHECKING:
    from node.vllm_engine import VLLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _start(model_dir: Path, seed: int) -> VLLMEngine:
    pytest.importorskip("vllm")
    from node.vllm_engine import VLLMEngine

    # Two engines share the GPU in this module; eager mode skips graph capture (faster start).
    return VLLMEngine(
        model_dir, dtype="float32", seed=seed, gpu_memory_utilization=0.2, enforce_eager=True
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> VLLMEngine:
    return _start(tiny_model_dir, seed=11)


@pytest.fixture(scope="module")
def twin(tiny_model_dir: Path) -> VLLMEngine:
    return _start(tiny_model_dir, seed=11)


def test_vllm_engine_meets_the_engine_contract(
    engine: VLLMEngine, twin: VLLMEngine, tiny_model_dir: Path
) -> None:
    # GPU kernels differ from the CPU float32 reference in the last digits, not by more.
    asyncio.run(check_engine_contract(engine, twin, tiny_model_dir, logprob_atol=2e-3))


def test_vllm_engine_refuses_top_p_below_one(engine: VLLMEngine) -> None:
    with pytest.raises(ValueError, match="top_p"):
        asyncio.run(engine.generate([[1, 2, 3]], 2, SamplingParams(top_p=0.9)))


def test_vllm_engine_loads_lora_versions_as_adapters(tiny_model_dir: Path) -> None:
    """A LoRA version loaded as an adapter samples as the torch engine does with the same
    version merged into its weights (greedy: the same tokens, logprobs within GPU noise)."""
    pytest.importorskip("vllm")
    from agentjet.config import ModelConfig
    from node.lora import AdapterMerger, add_adapters
    from node.model import load_causal_lm
    from node.torch_engine import TorchEngine
    from node.vllm_engine import VLLMEngine

    config = ModelConfig(lora_rank=4, lora_alpha=8)
    peft_model = add_adapters(load_causal_lm(tiny_model_dir)[0], config)
    with torch.no_grad():
        torch.manual_seed(1)
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    adapters = {n: p.detach() for n, p in peft_model.named_parameters() if p.requires_grad}

    vllm = VLLMEngine(
        tiny_model_dir, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True,
        lora=config,
    )  # fmt: skip
    assert vllm.takes_adapters
    torch_engine = TorchEngine(tiny_model_dir, dtype="float32", device="cuda")
    merged = AdapterMerger(torch_engine.state_dict(), config).merge(
        adapters, torch_engine.state_dict()
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = [[1, 5, 9, 200], [7, 7, 31]]

    async def both() -> None:
        before = await vllm.generate(prompts, 1, greedy)
        await vllm.load_state_dict(adapters, 1)
        await torch_engine.load_state_dict(merged, 1)
        got = await vllm.generate(prompts, 1, greedy)
        want = await torch_engine.generate(prompts, 1, greedy)
        assert vllm.policy_version == 1
        assert [c[0].token_ids for c in got] == [c[0].token_ids for c in want]
        assert [c[0].logprobs for c in got] != [c[0].logprobs for c in before]  # it applies
        for g, w in zip(got, want, strict=True):
            assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=2e-3)
        await vllm.load_state_dict(adapters, 2)  # a second version replaces the first
        assert [c[0].token_ids for c in await vllm.generate(prompts, 1, greedy)] == [
            c[0].token_ids for c in want
        ]

    asyncio.run(both())


def test_vllm_engine_samples_several_policies_in_one_batch(tiny_model_dir: Path) -> None:
    """The torch engine's policies contract (tests/unit/test_adapter_bank.py runs it on
    CPU): one batch, a LoRA request per prompt, each row as that policy's merged weights."""
    pytest.importorskip("vllm")
    from node.vllm_engine import VLLMEngine
    from tests.engine_contract import POLICY_LORAS, check_policies_contract

    vllm = VLLMEngine(
        tiny_model_dir, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True,
        policy_loras=list(POLICY_LORAS.values()),
    )  # fmt: skip
    asyncio.run(check_policies_contract(vllm, tiny_model_dir, device="cuda", logprob_atol=2e-3))
    assert vllm.policy_versions == {"planner": 1, "solver": 2, "critic": 1}
