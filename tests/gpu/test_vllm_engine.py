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
