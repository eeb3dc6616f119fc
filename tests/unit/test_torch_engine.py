"""The torch engine against the engine contract, plus what only it promises (top-p, sharing)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agentjet.episode import SamplingParams
from node.model import load_causal_lm
from node.torch_engine import TorchEngine, sample_next
from tests.engine_contract import (
    GREEDY,
    assert_logprobs_match_teacher_forcing,
    chat_prompts,
    check_completion,
    check_engine_contract,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    before = torch.get_num_threads()
    yield TorchEngine(tiny_model_dir, seed=3, threads=1)
    torch.set_num_threads(before)


def test_torch_engine_meets_the_engine_contract(tiny_model_dir: Path) -> None:
    before = torch.get_num_threads()
    try:
        contract = check_engine_contract(
            TorchEngine(tiny_model_dir, seed=11, threads=1),
            TorchEngine(tiny_model_dir, seed=11, threads=1),
            tiny_model_dir,
        )
        asyncio.run(contract)
    finally:
        torch.set_num_threads(before)


def test_top_p_logprobs_are_taken_before_truncation(
    engine: TorchEngine, tiny_model_dir: Path
) -> None:
    prompts = chat_prompts(engine)
    params = SamplingParams(temperature=0.7, top_p=0.5, max_new_tokens=8)
    results = asyncio.run(engine.generate(prompts, 4, params))
    reference, _ = load_causal_lm(tiny_model_dir)
    assert_logprobs_match_teacher_forcing(reference, prompts, results, params, atol=1e-4)


def test_top_p_samples_only_from_the_nucleus() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two tokens only.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=0.7)
    tokens, logprobs = sample_next(logits, params, generator)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[2] == counts[3] == 0
    assert 0.55 < counts[0] / 2000 < 0.70  # 0.5 / 0.8 = 0.625 after renormalising
    expected = torch.log(torch.tensor([0.5, 0.3]))[tokens]
    assert torch.allclose(logprobs, expected, atol=1e-6)


def test_temperature_scales_logits_before_the_logprob() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.5)
    tokens, logprobs = sample_next(logits, params, torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits / 0.5, dim=-1)[0, tokens]
    assert torch.allclose(logprobs, expected)


def test_repeated_prompts_each_get_n_independent_samples(engine: TorchEngine) -> None:
    prompt = chat_prompts(engine)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    results = asyncio.run(engine.generate([prompt, prompt], 3, params))
    assert [len(s) for s in results] == [3, 3]
    samples = [tuple(c.token_ids) for s in results for c in s]
    assert len(set(samples)) == 6
    for completion in results[0] + results[1]:
        check_completion(engine, completion, 6)


def test_finished_rows_stop_growing_while_others_continue(engine: TorchEngine) -> None:
    prompts = chat_prompts(engine)
    greedy = SamplingParams(greedy=True, max_new_tokens=10)
    free = asyncio.run(engine.generate(prompts, 1, greedy))
    # Make the first prompt's second greedy token a stop token; the others run on.
    stop = free[0][0].token_ids[1]
    engine.eos_token_ids.add(stop)
    try:
        stopped = asyncio.run(engine.generate(prompts, 1, greedy))
    finally:
        engine.eos_token_ids.discard(stop)
    assert stopped[0][0].token_ids == free[0][0].token_ids[:2]
    for before, after in zip(free[1:], stopped[1:], strict=True):
        ids = before[0].token_ids
        cut = next((k + 1 for k, t in enumerate(ids) if t == stop), len(ids))
        assert after[0].token_ids == ids[:cut]


@pytest.mark.parametrize(
    ("params", "n", "message"),
    [
        (SamplingParams(), 0, "n must be"),
        (SamplingParams(temperature=0.0), 1, "temperature"),
        (SamplingParams(top_p=0.0), 1, "top_p"),
        (SamplingParams(max_new_tokens=0), 1, "max_new_tokens"),
        (SamplingParams(max_new_tokens=5000), 1, "positions"),
    ],
)
def test_invalid_requests_are_refused(
    engine: TorchEngine, params: SamplingParams, n: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        asyncio.run(engine.generate([[1, 2, 3]], n, params))


def test_empty_prompt_is_refused(engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        asyncio.run(engine.generate([[]], 1, SamplingParams()))


def test_weights_of_its_dtype_become_the_engines_own_and_others_are_copied(
    tiny_model_dir: Path,
) -> None:
    """A fetched version's tensors (views of its buffer, node/weights.py) are taken as the
    weights, not copied next to them; a version in another dtype is cast into them."""
    threads = torch.get_num_threads()
    engine = TorchEngine(tiny_model_dir, seed=3, threads=1)
    torch.set_num_threads(threads)
    prompts = [[5, 6, 7]]
    before = asyncio.run(engine.generate(prompts, 1, GREEDY))
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    asyncio.run(engine.load_state_dict(state, version=1))
    assert all(engine.state_dict()[k].data_ptr() == t.data_ptr() for k, t in state.items())
    halves = {k: v.to(torch.bfloat16) for k, v in state.items()}
    asyncio.run(engine.load_state_dict(halves, version=2))
    own = engine.state_dict()
    assert all(own[k].dtype == torch.float32 for k in halves)
    assert all(own[k].data_ptr() == t.data_ptr() for k, t in state.items())  # copied in
    assert all(torch.equal(own[k], t.float()) for k, t in halves.items())
    asyncio.run(engine.load_state_dict(state, version=3))
    after = asyncio.run(engine.generate(prompts, 1, GREEDY))
    assert [c.token_ids for c in after[0]] == [c.token_ids for c in before[0]]
