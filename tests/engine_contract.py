"""The behaviour every inference engine must show, checked the same way on each of them.

The trainer's importance ratios are only right if the engine reports, for every sampled
token, `log_softmax(logits / T)[token]` of the very weights it sampled with; environments
rely on stop/length semantics; rollout nodes rely on in-place weight reloads. The torch
engine runs this on CPU in the unit tier, the vLLM engine on a lent GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from agentjet.episode import Completion, Generator, SamplingParams
from node.model import load_causal_lm


class EngineUnderTest(Generator, Protocol):
    vocab_size: int
    eos_token_ids: set[int]

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...


QUESTIONS = ("2+2?", "What is 13 times 7? Think step by step, then answer.", "Say hi")
SAMPLED = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=12)
GREEDY = SamplingParams(greedy=True, max_new_tokens=12)


def chat_prompts(engine: EngineUnderTest) -> list[list[int]]:
    """Three chat prompts of different lengths (so a batch needs padding)."""
    prompts = []
    for question in QUESTIONS:
        encoded = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        prompts.append(list(encoded["input_ids"]))
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


def check_engine_contract(
    engine: EngineUnderTest,
    twin: EngineUnderTest,
    model_dir: Path,
    *,
    dtype: str = "float32",
    logprob_atol: float = 1e-4,
) -> None:
    """Run every check. `twin` is a second engine built with the same seed and never used
    before; `model_dir` is the model both were built from (the teacher-forcing reference)."""
    prompts = chat_prompts(engine)
    check_same_seed_same_samples(engine, twin, prompts)
    check_shapes_and_bounds(engine, prompts)
    check_stop_at_eos(engine, prompts[0])
    check_greedy(engine, prompts)
    check_padding_invariance(engine, prompts, logprob_atol)
    reference, _ = load_causal_lm(model_dir, dtype)
    for params in (SAMPLED, GREEDY):
        results = engine.generate(prompts, 2, params)
        assert_logprobs_match_teacher_forcing(reference, prompts, results, params, logprob_atol)
    check_weight_reload(engine, prompts)


def check_completion(engine: EngineUnderTest, completion: Completion, max_new_tokens: int) -> None:
    """One completion is well formed: ids in the vocabulary, a finite logprob <= 0 per token,
    and it ends exactly at its first eos ("stop") or at the length limit ("length")."""
    ids, logprobs = completion.token_ids, completion.logprobs
    assert 1 <= len(ids) <= max_new_tokens
    assert len(logprobs) == len(ids)
    assert all(0 <= t < engine.vocab_size for t in ids)
    assert all(math.isfinite(lp) and lp <= 1e-6 for lp in logprobs)
    assert not any(t in engine.eos_token_ids for t in ids[:-1]), "generation ran past an eos"
    if completion.finish_reason == "stop":
        assert ids[-1] in engine.eos_token_ids
    else:
        assert completion.finish_reason == "length"
        assert len(ids) == max_new_tokens
        assert ids[-1] not in engine.eos_token_ids


def check_shapes_and_bounds(engine: EngineUnderTest, prompts: list[list[int]]) -> None:
    for n in (1, 3):
        results = engine.generate(prompts, n, SAMPLED)
        assert len(results) == len(prompts)
        for samples in results:
            assert len(samples) == n
            for completion in samples:
                check_completion(engine, completion, SAMPLED.max_new_tokens)
    short = SamplingParams(temperature=1.0, max_new_tokens=3)
    for samples in engine.generate(prompts, 2, short):
        for completion in samples:
            check_completion(engine, completion, 3)
    assert engine.generate([], 4, SAMPLED) == []


def check_stop_at_eos(engine: EngineUnderTest, prompt: list[int]) -> None:
    """Declare a token the model greedily emits mid-way an eos: generation must stop there,
    keep it as the last token and say "stop". (A random model rarely emits its real eos.)"""
    free = engine.generate([prompt], 1, GREEDY)[0][0].token_ids
    stop_at = next(k for k in range(1, len(free)) if free[k] not in free[:k])
    saved = set(engine.eos_token_ids)
    engine.eos_token_ids.add(free[stop_at])
    try:
        stopped = engine.generate([prompt], 2, GREEDY)[0]
    finally:
        engine.eos_token_ids.clear()
        engine.eos_token_ids.update(saved)
    for completion in stopped:
        assert completion.token_ids == free[: stop_at + 1]
        assert completion.finish_reason == "stop"


def check_greedy(engine: EngineUnderTest, prompts: list[list[int]]) -> None:
    first = engine.generate(prompts, 3, GREEDY)
    second = engine.generate(prompts, 3, GREEDY)
    for samples_a, samples_b in zip(first, second, strict=True):
        for completion in samples_a + samples_b:
            assert completion.token_ids == samples_a[0].token_ids
            check_completion(engine, completion, GREEDY.max_new_tokens)
    assert first[0][0].token_ids != first[1][0].token_ids, "different prompts, same output"


def check_same_seed_same_samples(
    engine: EngineUnderTest, twin: EngineUnderTest, prompts: list[list[int]]
) -> None:
    ours = engine.generate(prompts, 3, SAMPLED)
    theirs = twin.generate(prompts, 3, SAMPLED)
    assert [[c.token_ids for c in s] for s in ours] == [[c.token_ids for c in s] for s in theirs]
    distinct = {tuple(c.token_ids) for s in ours for c in s}
    assert len(distinct) > len(prompts), "samples of one prompt should differ"


def check_padding_invariance(
    engine: EngineUnderTest, prompts: list[list[int]], logprob_atol: float
) -> None:
    """Prompts of different lengths in one batch decode as they would alone."""
    batched = engine.generate(prompts, 1, GREEDY)
    for prompt, samples in zip(prompts, batched, strict=True):
        alone = engine.generate([prompt], 1, GREEDY)[0][0]
        assert samples[0].token_ids == alone.token_ids
        for a, b in zip(samples[0].logprobs, alone.logprobs, strict=True):
            assert abs(a - b) <= logprob_atol


def assert_logprobs_match_teacher_forcing(
    reference: torch.nn.Module,
    prompts: list[list[int]],
    results: list[list[Completion]],
    params: SamplingParams,
    atol: float,
) -> None:
    """Recompute each sampled token's logprob with one full forward pass over prompt +
    completion, as the trainer does: log_softmax(logits / T) before any top-p (T=1 greedy)."""
    temperature = 1.0 if params.greedy else params.temperature
    with torch.inference_mode():
        for prompt, samples in zip(prompts, results, strict=True):
            for completion in samples:
                ids = torch.tensor([prompt + completion.token_ids])
                logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                logprobs = torch.log_softmax(logits / temperature, dim=-1)
                expected = logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None])
                got = torch.tensor(completion.logprobs)
                assert torch.allclose(got, expected.squeeze(-1), atol=atol, rtol=0), (
                    f"max diff {(got - expected.squeeze(-1)).abs().max().item():.2e}"
                )


def check_weight_reload(engine: EngineUnderTest, prompts: list[list[int]]) -> None:
    original = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    before = engine.generate(prompts, 1, GREEDY)
    # Rolling every matrix changes the function but keeps shapes, and tied tensors stay equal.
    changed = {k: torch.roll(v, 1, dims=0) if v.dim() > 1 else v for k, v in original.items()}
    engine.load_state_dict(changed, version=7)
    assert engine.policy_version == 7
    after = engine.generate(prompts, 1, GREEDY)
    assert [s[0].token_ids for s in after] != [s[0].token_ids for s in before]

    key = next(iter(original))
    bad_states = {
        "unexpected": {**original, "not.a.weight": torch.zeros(1)},
        "missing": {k: v for k, v in original.items() if k != key},
        "shape": {**original, key: torch.zeros(3, 3, 3)},
    }
    for state in bad_states.values():
        try:
            engine.load_state_dict(state, version=8)
        except ValueError as e:
            assert "not.a.weight" in str(e) or key in str(e)
        else:
            raise AssertionError("a wrong state dict was accepted")
    assert engine.policy_version == 7
    assert [s[0].token_ids for s in engine.generate(prompts, 1, GREEDY)] == [
        s[0].token_ids for s in after
    ], "a rejected state dict changed the weights"

    engine.load_state_dict(original, version=0)
    restored = engine.generate(prompts, 1, GREEDY)
    assert [s[0].token_ids for s in restored] == [s[0].token_ids for s in before]
