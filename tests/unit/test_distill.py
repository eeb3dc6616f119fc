"""On-policy distillation: the reverse-KL advantage against hand-computed values, the
teacher's scores of the student's own tokens, and a student that moves toward its teacher
with no reward signal at all (agentjet/rl.py, node/teacher.py, node/learner.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from agentjet import protocol
from agentjet.config import EnvConfig, ModelConfig, TrainerConfig
from agentjet.episode import Episode, SamplingParams
from agentjet.errors import ModelError
from agentjet.rl import distill_advantages, policy_loss, teacher_kl
from agentjet_app.cli_status import format_swarm
from node.learner import Learner
from node.model import build_tiny_model, load_causal_lm, load_tokenizer
from node.rollout_produce import build_group
from node.teacher import LocalTeachers, TeacherCheck, scores_problem
from node.torch_engine import TorchEngine
from tests.unit.test_trainer_logic import lone_optimizer

pytestmark = pytest.mark.unit

TEMPERATURE = 0.7


def test_the_teacher_term_is_the_teachers_logprob_less_the_samplers_per_trained_token():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    teacher = torch.tensor([[-0.5, -2.5, -4.0], [-0.1, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards_adv = torch.tensor([1.0, 0.0])
    coef = torch.tensor([2.0, 0.5])
    got = distill_advantages(rewards_adv, sampler, teacher, mask, coef)
    # sample 0: 1 + 2 x (0.5, -0.5, masked) ; sample 1: 0 + 0.5 x (0, 2, -8)
    torch.testing.assert_close(got, torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, -4.0]]))
    # a sample without a teacher (coef 0) keeps its reward advantage on every token
    alone = distill_advantages(rewards_adv, sampler, teacher, mask, torch.zeros(2))
    assert alone.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # reverse KL, mu's view: mean of (sampler - teacher) over the 5 trained tokens
    expected = ((-0.5) + 0.5 + 0.0 + (-2.0) + 8.0) / 5
    assert teacher_kl(sampler, teacher, mask) == pytest.approx(expected)


def test_per_token_advantages_enter_the_clipped_loss_token_by_token():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.3, 0.9]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[2.0, -1.0, 7.0], [0.5, 0.5, -3.0]])
    # ratio 1: loss = -sum(mask * A_t) / N = -(2 - 1 + 0.5 + 0.5 - 3) / 5
    loss, _ = policy_loss(lp, lp.clone(), adv, mask, clip_eps=0.2, num_tokens=5)
    assert float(loss) == pytest.approx(1.0 / 5)
    # a per-sample advantage is the same as that value on each of its tokens
    per_sample, _ = policy_loss(lp, lp.clone(), torch.tensor([2.0, -1.0]), mask, 0.2, 5)
    per_token, _ = policy_loss(lp, lp.clone(), torch.tensor([[2.0] * 3, [-1.0] * 3]), mask, 0.2, 5)
    assert float(per_sample) == pytest.approx(float(per_token))


def _with_teacher(group: protocol.TrajectoryGroup, values: list[float]) -> protocol.TrajectoryGroup:
    sample = protocol.msgspec.structs.replace(
        group.samples[0], teacher_logprobs=protocol.pack_floats(values)
    )
    return protocol.msgspec.structs.replace(group, samples=[sample, *group.samples[1:]])


def test_a_group_with_malformed_teacher_logprobs_is_refused_with_its_reason():
    sample = protocol.Sample(
        prompt_ids=protocol.pack_ids([1, 2]),
        completion_ids=protocol.pack_ids([3, 4, 5]),
        logprobs=protocol.pack_floats([-0.1, -0.2, -0.3]),
        loss_mask=protocol.pack_mask([1, 1, 1]),
        reward=0.0,
        advantage=0.0,
        policy_version=0,
    )
    group = protocol.TrajectoryGroup(
        group_id="g", grant_id="g", node_id="n", task_id="t", env="arithmetic",
        samples=[sample], created_at=0.0,
    )  # fmt: skip
    assert protocol.check_group(_with_teacher(group, [-1.0, -2.0, -3.0]), 100, 64) is None
    for values, why in (
        ([-1.0, -2.0], "length differs"),
        ([-1.0, 0.5, -3.0], "finite and <= 0"),
        ([-1.0, float("nan"), -3.0], "finite and <= 0"),
        ([-1.0, float("-inf"), -3.0], "finite and <= 0"),
    ):
        problem = protocol.check_group(_with_teacher(group, values), 100, 64)
        assert problem is not None and why in problem, (values, problem)


def played_groups(
    engine: TorchEngine, rewards: tuple[float, ...]
) -> list[protocol.TrajectoryGroup]:
    """Two groups the engine just sampled (prompts of different lengths, one with a tool
    turn whose tokens are never trained), with the given rewards per sample."""
    prompts = [[1, 5, 9, 200], [1, 7, 300, 400, 500, 600, 700]]
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6)
    completions = asyncio.run(engine.generate(prompts, len(rewards), params))
    groups = []
    for i, (prompt, samples) in enumerate(zip(prompts, completions, strict=True)):
        episodes = []
        for completion, reward in zip(samples, rewards, strict=True):
            episode = Episode(prompt_ids=prompt)
            episode.add_model_turn(completion)
            if i == 1:
                episode.add_context([11, 12, 13])
                [[turn]] = asyncio.run(engine.generate([episode.context_ids], 1, params))
                episode.add_model_turn(turn)
            episode.reward = reward
            episodes.append(episode)
        task = protocol.Task(id=f"t{i}", env="arithmetic", prompt="", answer=0)
        grant = protocol.WorkGrant(grant_id=f"g{i}", task=task, group_size=3, lease_s=1.0)
        groups.append(build_group(grant, episodes, "n", 0.0))
    return groups


def _teachers(engine: TorchEngine, teacher: Path) -> LocalTeachers:
    envs = [EnvConfig(name="arithmetic", teacher=str(teacher)), EnvConfig(name="python_code")]
    return LocalTeachers(envs, ModelConfig(), engine.tokenizer, engine.device, TEMPERATURE)


def test_a_teacher_with_the_students_weights_scores_its_tokens_as_the_sampler_did(
    tiny_model_dir: Path, one_torch_thread: None
):
    engine = TorchEngine(tiny_model_dir, seed=1)
    teachers = _teachers(engine, tiny_model_dir)
    for group in played_groups(engine, (1.0, 0.0, 0.0)):
        scored, kl = teachers.score_now(group)
        assert kl == pytest.approx(0.0, abs=1e-4)
        assert protocol.check_group(scored, engine.vocab_size, 4096) is None
        for before, after in zip(group.samples, scored.samples, strict=True):
            mask = protocol.unpack_mask(after.loss_mask).astype(bool)
            teacher = protocol.unpack_floats(after.teacher_logprobs)
            sampler = protocol.unpack_floats(before.logprobs)
            np.testing.assert_allclose(teacher[mask], sampler[mask], atol=1e-4)
            assert not teacher[~mask].any()  # tool output: no score
            assert after.completion_ids == before.completion_ids
    # an environment without a teacher passes through untouched
    other = protocol.msgspec.structs.replace(group, env="python_code")
    assert teachers.score_now(other) == (other, 0.0)


def test_each_environment_is_scored_by_its_own_teacher(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
):
    """Multi-teacher distillation: two environments, two teachers (the student's weights and
    another model), each group scored by its environment's; a teacher named twice is loaded
    once."""
    other = build_tiny_model(tmp_path / "other-teacher", seed=3)
    engine = TorchEngine(tiny_model_dir, seed=1)
    envs = [
        EnvConfig(name="arithmetic", teacher=str(tiny_model_dir)),
        EnvConfig(name="python_code", teacher=str(other)),
        EnvConfig(name="shell", teacher=str(other)),
    ]
    teachers = LocalTeachers(envs, ModelConfig(), engine.tokenizer, engine.device, TEMPERATURE)
    assert teachers.by_env["python_code"] is teachers.by_env["shell"]
    assert teachers.by_env["arithmetic"] is not teachers.by_env["python_code"]
    [group, _] = played_groups(engine, (1.0, 0.0))
    own, own_kl = teachers.score_now(group)
    coded, coded_kl = teachers.score_now(protocol.msgspec.structs.replace(group, env="python_code"))
    assert own_kl == pytest.approx(0.0, abs=1e-4)  # the student's own weights
    assert coded_kl > 0.1  # a random model of other weights
    expected = teachers.by_env["python_code"].logprobs(group.samples, TEMPERATURE)
    for sample, want in zip(coded.samples, expected, strict=True):
        np.testing.assert_array_equal(protocol.unpack_floats(sample.teacher_logprobs), want)
    assert own.samples[0].teacher_logprobs != coded.samples[0].teacher_logprobs


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(
    tiny_model_dir: Path, tmp_path: Path
):
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=0)
    tokenizer = load_tokenizer(teacher_dir)
    tokenizer.add_tokens(["<a token the student has not>"])
    tokenizer.save_pretrained(teacher_dir)
    engine = TorchEngine(tiny_model_dir, seed=1)
    with pytest.raises(ModelError, match="has a tokenizer other than the model's") as err:
        _teachers(engine, teacher_dir)
    assert "\n" not in str(err.value)


def test_distillation_moves_the_student_toward_the_teacher_with_no_reward_signal(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
):
    """Every reward 0 (no RL signal): a learner without the teacher trains nothing, one with
    it brings its logprobs of the sampled tokens closer to the teacher's, step by step."""
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1)
    engine = TorchEngine(tiny_model_dir, seed=1)
    groups = [
        _teachers(engine, teacher_dir).score_now(g)[0] for g in played_groups(engine, (0.0,) * 3)
    ]
    teacher = torch.cat(
        [
            torch.from_numpy(protocol.unpack_floats(s.teacher_logprobs).copy())
            for g in groups
            for s in g.samples
        ]
    )
    model, _ = load_causal_lm(tiny_model_dir)
    optimizer = lone_optimizer(model, target_batch_size=6, lr=3e-3)
    plain = Learner(model, optimizer, TrainerConfig(micro_batch_samples=4), TEMPERATURE, 0)
    assert plain.train_step(groups).row()["charts/trained_samples"] == 0
    # The same samples, trained again as the student moves: off the logprob check.
    config = TrainerConfig(micro_batch_samples=4, max_logprob_gap=0.0)
    learner = Learner(model, optimizer, config, TEMPERATURE, 0, teacher_coefs={"arithmetic": 1.0})
    gaps = []
    for _ in range(4):
        rows = learner._rows(groups)
        with torch.no_grad():
            out = learner._forward(rows)
        trained = out.mask.bool()
        gaps.append(float((out.logprobs[trained] - teacher[_trained(groups)]).abs().mean()))
        row = learner.train_step(groups).row()
        assert row["charts/trained_samples"] == 6 and row["charts/teacher_samples"] == 6
    sampler = torch.cat(
        [
            torch.from_numpy(protocol.unpack_floats(s.logprobs).copy())
            for g in groups
            for s in g.samples
        ]
    )
    expected_kl = float((sampler - teacher)[_trained(groups)].mean())
    assert row["charts/teacher_kl"] == pytest.approx(expected_kl, rel=1e-4)
    assert gaps[-1] < 0.8 * gaps[0], gaps
    assert all(b < a for a, b in zip(gaps, gaps[1:], strict=False)), gaps


def test_a_trainer_that_rescores_teacher_logprobs_leaves_forged_ones_out_exactly(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
):
    """trainer.teacher_check_fraction: honest teacher scores pass; a group whose node claims
    its teacher was sure of every token, or that carries no teacher scores, is rejected
    with its gap, and the step is the one the honest groups alone make."""
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1)
    engine = TorchEngine(tiny_model_dir, seed=1)
    scorer = _teachers(engine, teacher_dir)
    honest = [scorer.score_now(g)[0] for g in played_groups(engine, (1.0, 0.0, 0.0))]

    def forged(group: protocol.TrajectoryGroup, name: str, scores: bytes | None):
        samples = [
            protocol.msgspec.structs.replace(
                s,
                teacher_logprobs=protocol.pack_floats([-0.01] * (len(s.logprobs) // 4))
                if scores is None
                else scores,
            )
            for s in group.samples
        ]
        return protocol.msgspec.structs.replace(group, group_id=name, samples=samples)

    sure = forged(honest[0], "teacher-sure-of-everything", None)
    missing = forged(honest[1], "no-teacher-scores", b"")
    check = TeacherCheck(scorer.by_env, 1.0, b"secret", TEMPERATURE)

    def step(groups: list[protocol.TrajectoryGroup], check: TeacherCheck | None):
        torch.manual_seed(0)
        model, _ = load_causal_lm(tiny_model_dir)
        optimizer = lone_optimizer(model, target_batch_size=6)
        config = TrainerConfig(micro_batch_samples=2, max_logprob_gap=0.5)
        coefs = {"arithmetic": 1.0}
        learner = Learner(
            model, optimizer, config, TEMPERATURE, 0, teacher_coefs=coefs, teacher_check=check
        )
        result = learner.train_step(groups)
        return result, model.state_dict()

    mixed, mixed_weights = step([sure, honest[0], missing, honest[1]], check)
    alone, alone_weights = step(honest, None)
    assert mixed.rejected == {"teacher-sure-of-everything", "no-teacher-scores"}
    assert max(mixed.teacher_gaps[g.group_id] for g in honest) < 1e-4
    assert mixed.teacher_gaps["teacher-sure-of-everything"] > 5
    assert mixed.teacher_gaps["no-teacher-scores"] == float("inf")
    row = mixed.row()
    assert row["rejected_group_ids"] == ["no-teacher-scores", "teacher-sure-of-everything"]
    assert row["charts/teacher_checked_groups"] == 4
    assert row["charts/trained_samples"] == alone.row()["charts/trained_samples"] == 6
    for key, value in alone_weights.items():
        assert torch.equal(mixed_weights[key], value), key
    # none picked: nothing re-scored, nothing rejected for it
    unchecked = TeacherCheck(scorer.by_env, 0.0, b"secret", TEMPERATURE)
    assert unchecked.gaps([sure, missing]) == {}


def _trained(groups: list[protocol.TrajectoryGroup]) -> torch.Tensor:
    """Which of the concatenated completion tokens of `groups` are trained."""
    return torch.cat(
        [
            torch.from_numpy(protocol.unpack_mask(s.loss_mask).astype(bool))
            for g in groups
            for s in g.samples
        ]
    )


def test_scores_from_a_teacher_node_are_taken_only_when_well_formed():
    """What a rollout node checks of a teacher node's reply before a group carries it."""
    samples = [
        protocol.TeacherInput(
            prompt_ids=protocol.pack_ids([1, 2]),
            completion_ids=protocol.pack_ids([3, 4, 5][:n]),
            loss_mask=protocol.pack_mask([1] * n),
        )
        for n in (3, 2)
    ]
    request = protocol.TeacherScoreRequest(
        node_id="r", teacher="t", temperature=1.0, samples=samples
    )

    def reply(*rows: list[float]) -> protocol.TeacherScores:
        return protocol.TeacherScores(logprobs=[protocol.pack_floats(r) for r in rows])

    assert scores_problem(reply([-1.0, -2.0, 0.0], [-0.5, -0.25]), request, 1000) is None
    for bad, why in (
        (reply([-1.0, -2.0, 0.0]), "1 samples scored of 2"),
        (reply([-1.0, -2.0], [-0.5, -0.25]), "sample 0: scores length differs"),
        (reply([-1.0, -2.0, 0.0], [-0.5, 3.0]), "sample 1: scores must be finite and <= 0"),
        (reply([-1.0, float("nan"), 0.0], [-0.5, -0.25]), "finite and <= 0"),
        (protocol.Welcome(), "a Welcome reply"),
    ):
        problem = scores_problem(bad, request, 1000)
        assert problem is not None and why in problem, (bad, problem)


def test_status_lists_teacher_nodes_with_their_teachers_and_load():
    records = [
        protocol.NodeRecord(node_id="t1", role="trainer", policy_version=3),
        protocol.NodeRecord(
            node_id="teach-1",
            role="teacher",
            endpoint="tcp://10.0.0.9:7300",
            queue=2,
            capacity=64,
            samples_per_s=41.5,
            teachers=["runs/a/teacher", "org/coder"],
        ),
    ]
    shown = format_swarm(records, now=0.0)
    assert shown.splitlines()[0] == "swarm: 0 coordinator, 1 trainer, 0 rollout, 1 teacher"
    [row] = [line for line in shown.splitlines() if line.startswith("teacher ")]
    assert row.split()[:6] == ["teacher", "teach-1", "tcp://10.0.0.9:7300", "-", "2/64", "41.50"]
    assert "teachers on teach-1: runs/a/teacher, org/coder" in shown
    # without teacher nodes the summary reads as before
    assert format_swarm(records[:1], now=0.0).splitlines()[0] == (
        "swarm: 0 coordinator, 1 trainer, 0 rollout"
    )
