"""The behaviour every inference engine must show, checked the same way on each of them.

The trainer's importance ratios are only right if the engine reports, for every sampled
token, `log_softmax(logits / T)[token]` of the very weights it sampled with; environments
rely on stop/length semantics; rollout nodes rely on in-place weight reloads. The torch
engine runs this on CPU in the unit tier, the vLLM engine on a lent GPU. The checks are
coroutines, as the engine interface is: drive them with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from agentjet.config import ModelConfig
from agentjet.episode import Completion, SamplingParams
from node.engine import Engine
from node.lora import AdapterMerger, random_adapters
from node.model import load_causal_lm
from node.torch_engine import TorchEngine

QUESTIONS = ("2+2?", "What is 13 times 7? Think step by step, then answer.", "Say hi")
SAMPLED = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=12)
GREEDY = SamplingParams(greedy=True, max_new_tokens=12)
# How far apart the tiny model's logits may be when two forwards are equal in exact
# arithmetic but round in float32 differently: adapters added beside the base weights or
# merged into them, a row batched or alone. Which way each sum rounds depends on the CPU's
# kernels (AVX-512, AVX2, plain C pick different orders and blockings), so no tolerance at
# the noise itself holds on every machine. Each such forward is within 1e-5 of a float64
# one on these logits (|logit| up to 8, a float32 ulp there ~1e-6), two of them within
# 2e-5; 1e-4 leaves room for other kernels and is still 100 times below the smallest real
# mistake seen (adapters rounded through bf16: 1e-2; a missing layer's adapters: ~1).
LOGIT_ATOL = 1e-4


def chat_prompts(engine: Engine) -> list[list[int]]:
    """Three chat prompts of different lengths (so a batch needs padding)."""
    prompts = []
    for question in QUESTIONS:
        encoded = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        prompts.append(list(encoded["input_ids"]))
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


async def check_engine_contract(
    engine: Engine,
    twin: Engine,
    model_dir: Path,
    *,
    dtype: str = "float32",
    logprob_atol: float = 1e-4,
) -> None:
    """Run every check. `twin` is a second engine built with the same seed and never used
    before; `model_dir` is the model both were built from (the teacher-forcing reference)."""
    prompts = chat_prompts(engine)
    await check_same_seed_same_samples(engine, twin, prompts)
    await check_shapes_and_bounds(engine, prompts)
    await check_stop_at_eos(engine, prompts[0])
    await check_greedy(engine, prompts)
    await check_padding_invariance(engine, prompts, logprob_atol)
    reference, _ = load_causal_lm(model_dir, dtype)
    for params in (SAMPLED, GREEDY):
        results = await engine.generate(prompts, 2, params)
        assert_logprobs_match_teacher_forcing(reference, prompts, results, params, logprob_atol)
    await check_weight_reload(engine, prompts)


def check_completion(engine: Engine, completion: Completion, max_new_tokens: int) -> None:
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


async def check_shapes_and_bounds(engine: Engine, prompts: list[list[int]]) -> None:
    for n in (1, 3):
        results = await engine.generate(prompts, n, SAMPLED)
        assert len(results) == len(prompts)
        for samples in results:
            assert len(samples) == n
            for completion in samples:
                check_completion(engine, completion, SAMPLED.max_new_tokens)
    short = SamplingParams(temperature=1.0, max_new_tokens=3)
    for samples in await engine.generate(prompts, 2, short):
        for completion in samples:
            check_completion(engine, completion, 3)
    assert await engine.generate([], 4, SAMPLED) == []


async def check_stop_at_eos(engine: Engine, prompt: list[int]) -> None:
    """Declare a token the model greedily emits mid-way an eos: generation must stop there,
    keep it as the last token and say "stop". (A random model rarely emits its real eos.)"""
    free = (await engine.generate([prompt], 1, GREEDY))[0][0].token_ids
    stop_at = next(k for k in range(1, len(free)) if free[k] not in free[:k])
    saved = set(engine.eos_token_ids)
    engine.eos_token_ids.add(free[stop_at])
    try:
        stopped = (await engine.generate([prompt], 2, GREEDY))[0]
    finally:
        engine.eos_token_ids.clear()
        engine.eos_token_ids.update(saved)
    for completion in stopped:
        assert completion.token_ids == free[: stop_at + 1]
        assert completion.finish_reason == "stop"


async def check_greedy(engine: Engine, prompts: list[list[int]]) -> None:
    first = await engine.generate(prompts, 3, GREEDY)
    second = await engine.generate(prompts, 3, GREEDY)
    for samples_a, samples_b in zip(first, second, strict=True):
        for completion in samples_a + samples_b:
            assert completion.token_ids == samples_a[0].token_ids
            check_completion(engine, completion, GREEDY.max_new_tokens)
    assert first[0][0].token_ids != first[1][0].token_ids, "different prompts, same output"


async def check_same_seed_same_samples(
    engine: Engine, twin: Engine, prompts: list[list[int]]
) -> None:
    ours = await engine.generate(prompts, 3, SAMPLED)
    theirs = await twin.generate(prompts, 3, SAMPLED)
    assert [[c.token_ids for c in s] for s in ours] == [[c.token_ids for c in s] for s in theirs]
    distinct = {tuple(c.token_ids) for s in ours for c in s}
    assert len(distinct) > len(prompts), "samples of one prompt should differ"


async def check_padding_invariance(
    engine: Engine, prompts: list[list[int]], logprob_atol: float
) -> None:
    """Prompts of different lengths in one batch decode as they would alone."""
    batched = await engine.generate(prompts, 1, GREEDY)
    for prompt, samples in zip(prompts, batched, strict=True):
        alone = (await engine.generate([prompt], 1, GREEDY))[0][0]
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


async def check_weight_reload(engine: Engine, prompts: list[list[int]]) -> None:
    """New weights load in place, a wrong state dict changes nothing, and a load and a
    decode issued together take turns in order: each decode sees one set of weights whole."""
    original = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    before = _ids(await engine.generate(prompts, 1, GREEDY))
    # Rolling every matrix changes the function but keeps shapes, and tied tensors stay equal.
    changed = {k: torch.roll(v, 1, dims=0) if v.dim() > 1 else v for k, v in original.items()}
    _, during = await asyncio.gather(
        engine.load_state_dict(changed, version=7), engine.generate(prompts, 1, GREEDY)
    )
    assert engine.policy_version == 7
    after = _ids(await engine.generate(prompts, 1, GREEDY))
    assert after != before
    assert _ids(during) == after, "a decode issued after a load did not wait for it"

    key = next(iter(original))
    bad_states = {
        "unexpected": {**original, "not.a.weight": torch.zeros(1)},
        "missing": {k: v for k, v in original.items() if k != key},
        "shape": {**original, key: torch.zeros(3, 3, 3)},
    }
    for state in bad_states.values():
        try:
            await engine.load_state_dict(state, version=8)
        except ValueError as e:
            assert "not.a.weight" in str(e) or key in str(e)
        else:
            raise AssertionError("a wrong state dict was accepted")
    assert engine.policy_version == 7
    assert _ids(await engine.generate(prompts, 1, GREEDY)) == after, (
        "a rejected state dict changed the weights"
    )

    last, _ = await asyncio.gather(
        engine.generate(prompts, 1, GREEDY), engine.load_state_dict(original, version=0)
    )
    assert _ids(last) == after, "a load issued after a decode changed its weights mid-way"
    assert engine.policy_version == 0
    assert _ids(await engine.generate(prompts, 1, GREEDY)) == before


def _ids(results: list[list[Completion]]) -> list[list[int]]:
    """The first sample's token ids per prompt."""
    return [samples[0].token_ids for samples in results]


# Three policies over one base: different ranks, one adapting only some layers.
POLICY_LORAS = {
    "planner": ModelConfig(lora_rank=2, lora_alpha=4),
    "solver": ModelConfig(lora_rank=8, lora_alpha=16),
    "critic": ModelConfig(lora_rank=4, lora_alpha=4, lora_targets=["q_proj", "v_proj"]),
}


async def check_policies_contract(
    engine: Any, model_dir: Path, *, device: str = "cpu", logprob_atol: float = 1e-4
) -> None:
    """Several policies' adapters in one engine (`load_adapters`, `generate(...,
    policies=)`): a batch mixing them samples each prompt as a torch engine with that
    policy's adapters merged into its weights does (greedy: the same tokens, logprobs within
    `logprob_atol`), also when rows stop mid-batch; a new version of one policy leaves the
    others' samples as they were; an unknown policy is refused. `engine` was started for
    POLICY_LORAS (vLLM: `policy_loras`) and has no adapters yet."""
    shapes, _ = load_causal_lm(model_dir)
    made = {p: random_adapters(shapes, c, seed) for seed, (p, c) in enumerate(POLICY_LORAS.items())}
    for policy, lora in POLICY_LORAS.items():
        await engine.load_adapters(policy, made[policy], lora, 1)
    prompts = chat_prompts(engine)
    prompts = [prompts[0], prompts[1], prompts[0], prompts[2]]
    policies = ["planner", "solver", "solver", None]
    results = await engine.generate(prompts, 2, GREEDY, policies)

    async def alone(policy: str | None, prompt: list[int], stops: set[int]) -> list[Completion]:
        single = TorchEngine(model_dir, device=device)
        single.eos_token_ids |= stops
        if policy is not None:
            state = single.state_dict()
            merged = AdapterMerger(state, POLICY_LORAS[policy]).merge(made[policy], state)
            await single.load_state_dict(merged, 1)
        return (await single.generate([prompt], 2, GREEDY))[0]

    def check(got: list[list[Completion]], expected: list[list[Completion]]) -> None:
        for samples, want in zip(got, expected, strict=True):
            for a, b in zip(samples, want, strict=True):
                assert a.token_ids == b.token_ids
                assert a.logprobs == pytest.approx(b.logprobs, abs=logprob_atol)

    stops: set[int] = set()
    check(results, [await alone(p, q, stops) for p, q in zip(policies, prompts, strict=True)])
    # one prompt under two policies is two prompts
    assert results[0][0].token_ids != results[2][0].token_ids
    # a stop token one row samples early: rows leave the batch while others decode on
    stops = {results[1][0].token_ids[2]}
    engine.eos_token_ids |= stops
    try:
        stopped = await engine.generate(prompts, 2, GREEDY, policies)
        assert len({len(r[0].token_ids) for r in stopped}) > 1
        check(stopped, [await alone(p, q, stops) for p, q in zip(policies, prompts, strict=True)])
    finally:
        engine.eos_token_ids -= stops
    # a new version of one policy: the others sample as before
    made["solver"] = random_adapters(shapes, POLICY_LORAS["solver"], seed=99)
    await engine.load_adapters("solver", made["solver"], POLICY_LORAS["solver"], 2)
    assert engine.policy_versions == {"planner": 1, "solver": 2, "critic": 1}
    again = await engine.generate(prompts, 2, GREEDY, policies)
    assert _ids([again[0], again[3]]) == _ids([results[0], results[3]])
    check(again, [await alone(p, q, set()) for p, q in zip(policies, prompts, strict=True)])
    # sampled rows of one prompt under two policies are two groups of n
    out = await engine.generate([prompts[0]] * 2, 3, SAMPLED, ["planner", "critic"])
    assert [len(r) for r in out] == [3, 3]
    with pytest.raises(ValueError, match="2 policies for 1 prompts"):
        await engine.generate([prompts[0]], 1, GREEDY, ["planner", "solver"])
    with pytest.raises(ValueError, match="no adapters for policy 'ghost'"):
        await engine.generate([prompts[0]], 1, GREEDY, ["ghost"])
