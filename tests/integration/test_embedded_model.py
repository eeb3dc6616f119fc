"""The embedded SmolLM2-135M end to end: dequantized from its GGUF, loaded and asked."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentjet.config import EMBEDDED_MODEL
from agentjet.episode import SamplingParams
from node.model import load_causal_lm, resolve_model
from node.torch_engine import TorchEngine

pytestmark = pytest.mark.integration


def test_the_embedded_model_converts_and_answers(tmp_path: Path) -> None:
    """The real thing: dequantize the GGUF (~20 s) and ask SmolLM2 something it knows."""
    path = resolve_model(EMBEDDED_MODEL, str(tmp_path))
    assert path == tmp_path / "smollm2-135m"
    model, tokenizer = load_causal_lm(path)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    engine = TorchEngine(path, threads=2)
    encoded: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    [[answer]] = asyncio.run(
        engine.generate([encoded["input_ids"]], 1, SamplingParams(greedy=True))
    )
    assert "Paris" in tokenizer.decode(answer.token_ids)
    assert resolve_model(EMBEDDED_MODEL, str(tmp_path)) == path  # cached: no second conversion
