"""The adapter bank: one forward where every row runs its own policy's LoRA adapters gives,
row by row, what that policy's merged weights give (node/adapter_bank.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentjet.config import ModelConfig
from node.adapter_bank import AdapterBank
from node.lora import AdapterMerger
from node.model import load_causal_lm

pytestmark = pytest.mark.unit

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Three policies: different ranks, and one that adapts only some layers.
POLICIES = {
    "planner": ModelConfig(lora_rank=2, lora_alpha=4, lora_targets=TARGETS),
    "solver": ModelConfig(lora_rank=8, lora_alpha=16, lora_targets=TARGETS),
    "critic": ModelConfig(lora_rank=4, lora_alpha=4, lora_targets=["q_proj", "v_proj"]),
}
ROWS = [[1, 5, 9, 200, 31], [7, 7, 8, 9, 10], [300, 2, 41, 5, 6], [11, 12, 13, 14, 15]]


def adapters(model: torch.nn.Module, config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random adapters in peft's names for every targeted Linear of `model`."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in config.lora_targets:
            rows, cols = module.weight.shape
            r = config.lora_rank
            prefix = f"base_model.model.{name}"
            out[f"{prefix}.lora_A.default.weight"] = torch.randn(r, cols, generator=generator) / 8
            out[f"{prefix}.lora_B.default.weight"] = torch.randn(rows, r, generator=generator) / 8
    return out


def scale(config: ModelConfig) -> float:
    return config.lora_alpha / config.lora_rank


@torch.no_grad()
def merged_logits(model_dir: Path, policy: str | None, tensors: dict, ids: list[int]):
    """`ids`' logits under one policy's merged weights (None: the base), a batch of one."""
    model, _ = load_causal_lm(model_dir)
    if policy is not None:
        state = {n: p.data for n, p in model.named_parameters()}
        for key, tensor in AdapterMerger(state, POLICIES[policy]).merge(tensors, state).items():
            state[key].copy_(tensor)
    return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.fixture
def bank_model(tiny_model_dir: Path):
    model, _ = load_causal_lm(tiny_model_dir)
    bank = AdapterBank(model, TARGETS)
    made = {}
    for seed, (policy, config) in enumerate(POLICIES.items()):
        made[policy] = adapters(model, config, seed)
        bank.put(policy, made[policy], scale(config), version=1)
    return model, bank, made


@torch.no_grad()
def test_one_mixed_batch_equals_each_policys_merged_weights_row_by_row(
    tiny_model_dir: Path, bank_model
) -> None:
    model, bank, made = bank_model
    assert bank.policies == ["critic", "planner", "solver"]
    row_policies = ["planner", None, "solver", "critic"]
    with bank.rows(bank.slots(row_policies)):
        logits = model(input_ids=torch.tensor(ROWS)).logits
    for row, (policy, ids) in enumerate(zip(row_policies, ROWS, strict=True)):
        expected = merged_logits(tiny_model_dir, policy, made.get(policy, {}), ids)
        assert torch.allclose(logits[row], expected, atol=1e-5), policy
    # the rows differ by their adapters: the same tokens under two policies differ
    same = [ROWS[0]] * 2
    with bank.rows(bank.slots(["planner", "solver"])):
        pair = model(input_ids=torch.tensor(same)).logits
    assert not torch.allclose(pair[0], pair[1], atol=1e-3)
    # outside `rows` the model is the base model
    base = merged_logits(tiny_model_dir, None, {}, ROWS[0])
    assert torch.equal(model(input_ids=torch.tensor([ROWS[0]])).logits[0], base)


@torch.no_grad()
def test_a_new_version_of_one_policy_leaves_the_others_bit_for_bit(
    tiny_model_dir: Path, bank_model
) -> None:
    model, bank, made = bank_model
    row_policies = ["planner", "solver", "critic", None]
    slots = bank.slots(row_policies)
    with bank.rows(slots):
        before = model(input_ids=torch.tensor(ROWS)).logits
    newer = adapters(model, POLICIES["solver"], seed=99)
    bank.put("solver", newer, scale(POLICIES["solver"]), version=2)
    assert bank.versions == {"planner": 1, "solver": 2, "critic": 1}
    with bank.rows(bank.slots(row_policies)):
        after = model(input_ids=torch.tensor(ROWS)).logits
    for row in (0, 2, 3):
        assert torch.equal(after[row], before[row])
    assert torch.allclose(
        after[1], merged_logits(tiny_model_dir, "solver", newer, ROWS[1]), atol=1e-5
    )


@torch.no_grad()
def test_bad_adapters_and_unknown_policies_are_refused_and_change_nothing(bank_model) -> None:
    model, bank, made = bank_model
    slots = bank.slots(["planner", "solver", "critic", None])
    with bank.rows(slots):
        before = model(input_ids=torch.tensor(ROWS)).logits
    wrong_shape = dict(made["solver"])
    key = next(k for k in wrong_shape if k.endswith("lora_B.default.weight"))
    wrong_shape[key] = torch.zeros(3, 8)
    not_adapter = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}
    one_half = {k: v for k, v in made["solver"].items() if "lora_A" in k}
    for bad in (wrong_shape, not_adapter, one_half):
        with pytest.raises(ValueError):
            bank.put("solver", bad, 2.0, version=3)
    with pytest.raises(ValueError, match="no adapters for policy 'ghost'"):
        bank.slots(["planner", "ghost"])
    with bank.rows(slots):
        assert torch.equal(model(input_ids=torch.tensor(ROWS)).logits, before)
    with bank.rows(slots[:2]), pytest.raises(ValueError, match="slots for 2"):
        model(input_ids=torch.tensor(ROWS))


@torch.no_grad()
def test_a_removed_policys_slot_is_reused_and_hooks_come_off(
    tiny_model_dir: Path, bank_model
) -> None:
    model, bank, made = bank_model
    size = bank.nbytes()
    bank.remove("planner")
    with pytest.raises(ValueError, match="planner"):
        bank.slots(["planner"])
    fresh = adapters(model, POLICIES["planner"], seed=7)
    bank.put("writer", fresh, scale(POLICIES["planner"]), version=1)
    assert bank.nbytes() == size  # the freed slot, not a new one
    with bank.rows(bank.slots(["writer"])):
        logits = model(input_ids=torch.tensor([ROWS[0]])).logits[0]
    assert torch.allclose(
        logits, merged_logits(tiny_model_dir, "planner", fresh, ROWS[0]), atol=1e-5
    )
    bank.close()
    with bank.rows(bank.slots(["writer"])):
        plain = model(input_ids=torch.tensor([ROWS[0]])).logits[0]
    assert torch.equal(plain, merged_logits(tiny_model_dir, None, {}, ROWS[0]))


def test_the_torch_engine_samples_each_prompt_under_its_own_policy_in_one_batch(
    tiny_model_dir: Path,
) -> None:
    import asyncio

    from agentjet.episode import SamplingParams
    from node.torch_engine import TorchEngine

    engine = TorchEngine(tiny_model_dir)
    made = {p: adapters(engine.model, c, seed) for seed, (p, c) in enumerate(POLICIES.items())}
    targets = sorted({t for c in POLICIES.values() for t in c.lora_targets})
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    prompts = [ROWS[0], ROWS[1], ROWS[0], ROWS[2]]
    policies = ["planner", "solver", "solver", None]

    async def mixed() -> list:
        for policy, config in POLICIES.items():
            await engine.load_adapters(policy, made[policy], scale(config), 1, targets)
        return await engine.generate(prompts, 2, greedy, policies)

    async def alone(policy: str | None, prompt: list[int], stop: set[int]) -> list:
        single = TorchEngine(tiny_model_dir)
        single.eos_token_ids |= stop
        if policy is not None:
            state = single.state_dict()
            merger = AdapterMerger(state, POLICIES[policy])
            await single.load_state_dict(merger.merge(made[policy], state), 1)
        return await single.generate([prompt], 2, greedy)

    results = asyncio.run(mixed())
    assert engine.adapters is not None and engine.adapters.versions == dict.fromkeys(POLICIES, 1)
    # one prompt under two policies is two prompts: different continuations here
    assert results[0][0].token_ids != results[2][0].token_ids
    # again with a stop token one row samples early: rows leave the batch mid-decode
    stop = {results[1][0].token_ids[2]}
    engine.eos_token_ids |= stop
    stopped = asyncio.run(engine.generate(prompts, 2, greedy, policies))
    assert len({len(r[0].token_ids) for r in stopped}) > 1
    for run, stops in ((results, set()), (stopped, stop)):
        for got, policy, prompt in zip(run, policies, prompts, strict=True):
            (expected,) = asyncio.run(alone(policy, prompt, stops))
            for a, b in zip(got, expected, strict=True):
                assert a.token_ids == b.token_ids, policy
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)

    sampled = SamplingParams(temperature=1.0, max_new_tokens=6)
    out = asyncio.run(engine.generate([ROWS[0], ROWS[0]], 3, sampled, ["planner", "critic"]))
    assert [len(r) for r in out] == [3, 3]
    with pytest.raises(ValueError, match="2 policies for 1 prompts"):
        asyncio.run(engine.generate([ROWS[0]], 1, greedy, ["planner", "solver"]))
    with pytest.raises(ValueError, match="no adapters for policy 'ghost'"):
        asyncio.run(engine.generate([ROWS[0]], 1, greedy, ["ghost"]))
    plain = TorchEngine(tiny_model_dir)
    with pytest.raises(ValueError, match="no policy adapters are loaded"):
        asyncio.run(plain.generate([ROWS[0]], 1, greedy, ["planner"]))
