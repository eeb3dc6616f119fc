"""Verified trajectories: the gap statistic, the decisions, task rebuilding, reward re-checks,
quarantine bookkeeping, and the learner leaving forged groups out of its gradients exactly."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoTokenizer

from agentjet import protocol, rl
from agentjet.cli import format_swarm
from agentjet.config import TrainerConfig
from agentjet.episode import Episode, SamplingParams
from agentjet.tasks import TaskSource, arithmetic_task_from_id, generate_tasks, write_task_file
from node.learner import Learner
from node.model import load_causal_lm
from node.rollout import build_group
from node.torch_engine import TorchEngine
from node.verify import (
    MAX_LISTED_NODES,
    MAX_TRACKED_NODES,
    Quarantine,
    find_task,
    over_gap,
    picked_for_reward_check,
    reward_checkers,
    reward_problem,
)
from sandboxes.envs.chat import chat_prompt_ids
from tests.factories import forge, make_group
from tests.unit.test_trainer_logic import lone_swarm

pytestmark = pytest.mark.unit

ARITHMETIC = reward_checkers([])["arithmetic"]


def test_logprob_gap_is_the_mean_absolute_difference_over_trained_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.5, -2.0, -0.5], [-4.0, -4.0, -4.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    # sample 0: (0.5 + 0) / 2, the untrained third token ignored; sample 1: nothing trained
    assert rl.logprob_gap(logprobs, sampler, mask).tolist() == [0.25, 0.0]


def test_groups_over_the_gap_bound_are_rejected_and_zero_turns_the_check_off():
    gaps = {"honest": 0.02, "edge": 0.5, "forged": 3.1}
    assert over_gap(gaps, 0.5) == {"forged"}
    assert over_gap(gaps, 0.0) == set()


def test_the_reward_check_picks_a_share_of_group_ids_a_sender_cannot_predict():
    ids = [f"grant-{i}" for i in range(2000)]
    picked = [g for g in ids if picked_for_reward_check(g, 0.25, b"trainer-1")]
    assert 400 <= len(picked) <= 600
    assert picked == [g for g in ids if picked_for_reward_check(g, 0.25, b"trainer-1")]
    # another trainer's secret picks other groups
    assert picked != [g for g in ids if picked_for_reward_check(g, 0.25, b"trainer-2")]
    assert all(picked_for_reward_check(g, 1.0, b"") for g in ids)
    assert not any(picked_for_reward_check(g, 0.0, b"") for g in ids)


def test_generated_arithmetic_tasks_are_rebuilt_from_their_ids(tmp_path: Path):
    tasks = generate_tasks(30, seed=3, env="arithmetic")
    assert [arithmetic_task_from_id(t.id, "arithmetic") for t in tasks] == tasks
    for bad in ("t1", "d4:1+1", "d1:1/1", "d1:1+1 ", "d3:1234+1", "d1:" + "9" * 5000 + "+1"):
        assert arithmetic_task_from_id(bad, "arithmetic") is None
    only_sums = TaskSource("arithmetic", difficulties=[1], ops=["+"])
    assert only_sums.find("d1:3+4") == arithmetic_task_from_id("d1:3+4", "arithmetic")
    assert only_sums.find("d2:30+40") is None and only_sums.find("d1:3*4") is None
    path = tmp_path / "tasks.jsonl"
    write_task_file(tasks[:3], path)
    from_file = TaskSource("arithmetic", task_file=str(path))
    assert from_file.find(tasks[0].id) == tasks[0] and from_file.find(tasks[5].id) is None
    group = make_group()
    assert find_task(group, [only_sums]) is None  # "t1" is no task of this trainer's
    assert find_task(msgspec.structs.replace(group, task_id="d1:3+4"), [only_sums]) is not None
    assert find_task(msgspec.structs.replace(group, env="shell"), [only_sums]) is None


def test_rewards_are_rechecked_against_the_task_the_prompt_asks(tiny_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = arithmetic_task_from_id("d1:3+4", "arithmetic")
    other = arithmetic_task_from_id("d1:2+2", "arithmetic")
    assert task is not None and other is not None

    def group(asked: protocol.Task, answers: list[str], rewards: list[float]):
        prompt = chat_prompt_ids(tokenizer, None, asked)
        samples = [
            protocol.Sample(
                prompt_ids=protocol.pack_ids(prompt),
                completion_ids=protocol.pack_ids(tokenizer.encode(a, add_special_tokens=False)),
                logprobs=protocol.pack_floats([-0.1] * len(tokenizer.encode(a))),
                loss_mask=protocol.pack_mask([1] * len(tokenizer.encode(a))),
                reward=r,
                advantage=0.0,
                policy_version=0,
            )
            for a, r in zip(answers, rewards, strict=True)
        ]
        return msgspec.structs.replace(make_group(), task_id=task.id, samples=samples)

    assert (
        reward_problem(group(task, ["It is 7.", "5"], [1.0, 0.0]), task, tokenizer, ARITHMETIC)
        is None
    )
    wrong = reward_problem(group(task, ["It is 7.", "5"], [1.0, 1.0]), task, tokenizer, ARITHMETIC)
    assert wrong == "sample 1: reward 1 reported, 0 on re-check"
    # a right answer to another question, claimed for this task
    asked_other = reward_problem(group(other, ["7"], [1.0]), task, tokenizer, ARITHMETIC)
    assert asked_other == "sample 0: the prompt does not ask task 'd1:3+4'"


def test_a_node_is_quarantined_after_its_nth_failed_check():
    quarantine = Quarantine(after=3)
    assert not quarantine.failed("bad", "gap 3")
    assert not quarantine.failed("bad", "gap 4")
    assert not quarantine.failed("good", "gap 1")
    assert quarantine.reason("bad") is None and quarantine.listed() == []
    assert quarantine.failed("bad", "wrong reward")
    assert not quarantine.failed("bad", "again")  # quarantined once
    assert quarantine.reason("bad") == "quarantined: 3 failed checks, the last: wrong reward"
    assert quarantine.reason("good") is None
    assert quarantine.listed() == ["bad"]


def test_quarantine_bookkeeping_is_bounded_against_made_up_node_ids():
    quarantine = Quarantine(after=1)
    for i in range(MAX_TRACKED_NODES + 5):
        quarantine.failed(f"n{i}", "x")
    assert len(quarantine.failures) == MAX_TRACKED_NODES
    assert quarantine.reason("n0") is None and quarantine.reason(f"n{MAX_TRACKED_NODES}")
    assert len(quarantine.listed()) == MAX_LISTED_NODES


def test_status_shows_each_trainers_quarantined_nodes():
    records = [
        protocol.NodeRecord(node_id="t1", role="trainer", quarantined=["rollout-x", "rollout-y"]),
        protocol.NodeRecord(node_id="r1", role="rollout"),
    ]
    assert "quarantined by t1: rollout-x, rollout-y" in format_swarm(records, now=0.0)
    # a record from before the field existed still decodes
    old = msgspec.msgpack.encode({"node_id": "t0", "role": "trainer"})
    assert protocol.node_record_decoder.decode(old).quarantined == []


def test_status_shows_what_each_trainer_refused():
    records = [
        protocol.NodeRecord(
            node_id="t1", role="trainer", refused={"round_joins": 5, "impersonation": 2}
        ),
        protocol.NodeRecord(node_id="t2", role="trainer"),
    ]
    shown = format_swarm(records, now=0.0)
    assert "refused by t1: impersonation 2, round joins 5" in shown
    assert "refused by t2" not in shown


def test_the_learner_leaves_forged_groups_out_of_its_gradients_exactly(
    tiny_model_dir: Path, one_torch_thread: None
):
    """Honest groups sampled by the engine pass; the same groups with made-up logprobs or
    altered tokens are rejected, and the step is the one the honest groups alone make."""
    temperature = 0.7
    engine = TorchEngine(tiny_model_dir, seed=2)
    params = SamplingParams(temperature=temperature, max_new_tokens=6)
    honest = []
    for i, prompt in enumerate([[1, 5, 9, 200], [1, 7, 300, 400]]):
        episodes = []
        [samples] = asyncio.run(engine.generate([prompt], 3, params))
        for j, completion in enumerate(samples):
            episode = Episode(prompt_ids=prompt, reward=float(j == 0))
            episode.add_model_turn(completion)
            episodes.append(episode)
        task = protocol.Task(id=f"t{i}", env="arithmetic", prompt="")
        grant = protocol.WorkGrant(grant_id=f"h{i}", task=task, group_size=3, lease_s=1.0)
        honest.append(build_group(grant, episodes, "n", 0.0))
    vocab = engine.vocab_size
    forged = [
        forge(honest[0], "zero-logprobs", logprobs=lambda lp: lp * 0),
        forge(honest[1], "altered-tokens", tokens=lambda ids: (ids + 1000) % vocab),
    ]

    def step(groups: list[protocol.TrajectoryGroup]) -> tuple[dict, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model, _ = load_causal_lm(tiny_model_dir)
        swarm = lone_swarm(model, target_batch_size=6)
        try:
            config = TrainerConfig(micro_batch_samples=2, max_logprob_gap=0.5)
            row = Learner(model, swarm, config, temperature, 0).train_step(groups).row()
        finally:
            swarm.shutdown()
        return row, model.state_dict()

    mixed, mixed_weights = step([forged[0], honest[0], forged[1], honest[1]])
    alone, alone_weights = step(honest)
    nothing, _ = step(forged)  # every group rejected: no step, no error
    assert nothing["policy_version"] == 0 and not nothing["optimizer_stepped"]
    assert nothing["rejected_group_ids"] == ["altered-tokens", "zero-logprobs"]
    assert mixed["rejected_group_ids"] == ["altered-tokens", "zero-logprobs"]
    assert max(mixed["logprob_gaps"][g.group_id] for g in honest) < 1e-4
    assert min(mixed["logprob_gaps"][g.group_id] for g in forged) > 1.0
    assert mixed["charts/samples"] == 6 and mixed["charts/trained_samples"] == 6
    assert mixed["policy_version"] == alone["policy_version"] == 1
    for key, value in alone_weights.items():
        assert torch.equal(mixed_weights[key], value), key


def test_random_prompts_do_not_break_the_reward_check(tiny_model_dir: Path):
    """Hostile token ids (any id of the vocabulary) decode and are judged, never raise."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = arithmetic_task_from_id("d1:3+4", "arithmetic")
    assert task is not None
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        sample = protocol.Sample(
            prompt_ids=protocol.pack_ids(ids),
            completion_ids=protocol.pack_ids(ids),
            logprobs=protocol.pack_floats([0.0] * len(ids)),
            loss_mask=protocol.pack_mask([1] * len(ids)),
            reward=1.0,
            advantage=0.0,
            policy_version=0,
        )
        group = msgspec.structs.replace(make_group(), samples=[sample])
        assert reward_problem(group, task, tokenizer, ARITHMETIC) is not None
