"""The adapter bank: one forward where every row runs its own policy's LoRA adapters gives,
row by row, what that policy's merged weights give (node/adapter_bank.py).

W0·x + B·(A·x) and (W0 + B·A)·x round differently in float32, so rows are compared with
merged weights within LOGIT_ATOL (tests/engine_contract.py says why). What the bank must not
change at all (the rows of other policies, the model outside `rows`) is compared bit for
bit, against the same batch through the same kernels."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from agentjet.config import ModelConfig
from node.adapter_bank import AdapterBank
from node.lora import AdapterMerger, random_adapters
from node.model import load_causal_lm
from node.torch_engine import TorchEngine
from tests.engine_contract import GREEDY, LOGIT_ATOL, check_policies_contract

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
    return random_adapters(model, config, seed, b_scale=0.125)


def scale(config: ModelConfig) -> float:
    return config.lora_alpha / config.lora_rank


@torch.no_grad()
def merged_logits(
    model_dir: Path, policy: str | None, tensors: dict, ids: list[int], configs: dict = POLICIES
) -> torch.Tensor:
    """`ids`' logits under one policy's merged weights (None: the base), a batch of one."""
    model, _ = load_causal_lm(model_dir)
    if policy is not None:
        state = {n: p.data for n, p in model.named_parameters()}
        for key, tensor in AdapterMerger(state, configs[policy]).merge(tensors, state).items():
            state[key].copy_(tensor)
    return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.fixture
def bank_model(tiny_model_dir: Path):
    model, _ = load_causal_lm(tiny_model_dir)
    bank = AdapterBank(model)
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
        torch.testing.assert_close(
            logits[row], expected, rtol=0, atol=LOGIT_ATOL, msg=lambda m, p=policy: f"{p}: {m}"
        )
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
    for row in (0, 2, 3):  # the same rows, slots and kernels: only slot 1's numbers changed
        assert torch.equal(after[row], before[row])
    torch.testing.assert_close(
        after[1], merged_logits(tiny_model_dir, "solver", newer, ROWS[1]), rtol=0, atol=LOGIT_ATOL
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
    torch.testing.assert_close(
        logits, merged_logits(tiny_model_dir, "planner", fresh, ROWS[0]), rtol=0, atol=LOGIT_ATOL
    )
    # a policy adapting layers no other policy does: they are hooked when it arrives
    mlp = ModelConfig(lora_rank=4, lora_alpha=8, lora_targets=["up_proj", "down_proj"])
    with_mlp = {**POLICIES, "mlp": mlp}
    made_mlp = adapters(model, mlp, seed=8)
    bank.put("mlp", made_mlp, scale(mlp), version=1)
    with bank.rows(bank.slots(["mlp", "writer"])):
        both = model(input_ids=torch.tensor([ROWS[1], ROWS[0]])).logits
    torch.testing.assert_close(both[1], logits, rtol=0, atol=LOGIT_ATOL)  # batched, alone
    torch.testing.assert_close(
        both[0],
        merged_logits(tiny_model_dir, "mlp", made_mlp, ROWS[1], with_mlp),
        rtol=0,
        atol=LOGIT_ATOL,
    )
    bank.close()
    with bank.rows(bank.slots(["writer"])):
        plain = model(input_ids=torch.tensor([ROWS[0]])).logits[0]
    assert torch.equal(plain, merged_logits(tiny_model_dir, None, {}, ROWS[0]))


def test_the_torch_engine_samples_each_prompt_under_its_own_policy_in_one_batch(
    tiny_model_dir: Path,
) -> None:
    asyncio.run(check_policies_contract(TorchEngine(tiny_model_dir), tiny_model_dir))
    plain = TorchEngine(tiny_model_dir)
    with pytest.raises(ValueError, match="no policy adapters are loaded"):
        asyncio.run(plain.generate([ROWS[0]], 1, GREEDY, ["planner"]))
