"""Distillation from a teacher's top k (envs[].teacher_top_k): the loss against hand-computed
values and gradients, the teacher's top k against its own full distribution, what the wire
refuses, the learner's loss against one built independently, a student that moves toward
its teacher with no reward signal, and the trainer's check of a forged top k
(agentjet/rl.py `topk_distill_loss`, node/teacher.py, node/learner.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from agentjet import protocol
from agentjet.config import EnvConfig, ModelConfig, TrainerConfig
from agentjet.rl import topk_distill_loss, topk_kl
from node.learner import Learner
from node.model import build_tiny_model, load_causal_lm
from node.teacher import LocalTeachers, TeacherCheck, scores_problem
from node.torch_engine import TorchEngine
from tests.factories import make_group, make_sample
from tests.unit.test_distill import TEMPERATURE, played_groups
from tests.unit.test_trainer_logic import lone_optimizer

pytestmark = pytest.mark.unit


def test_the_topk_loss_is_the_cross_entropy_to_the_teachers_top_k_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    student = torch.log_softmax(logits, -1)
    ids = torch.tensor([[0, 2], [3, 1]])
    teacher = torch.log(torch.tensor([[0.5, 0.3], [0.6, 0.1]]))
    coef = torch.tensor([2.0, 0.5])
    loss = topk_distill_loss(student.gather(1, ids), teacher, coef)
    z = math.log(math.exp(2) + math.exp(1) + 1 + math.exp(-1))
    row0 = -(0.5 * (2 - z) + 0.3 * (0 - z))
    row1 = -(0.6 + 0.1) * math.log(0.25)
    assert float(loss.detach()) == pytest.approx(2.0 * row0 + 0.5 * row1, rel=1e-6)
    # d/dz_j of -sum_K q_v log p_v is (sum_K q) p_j - q_j: mass toward the teacher's tokens
    loss.backward()
    p = torch.softmax(logits.detach(), -1)
    q = torch.zeros(2, 4)
    q[0, 0], q[0, 2], q[1, 3], q[1, 1] = 0.5, 0.3, 0.6, 0.1
    expected = coef[:, None] * (q.sum(-1, keepdim=True) * p - q)
    torch.testing.assert_close(logits.grad, expected)
    # the metric: sum_K q (log q - log p), per position, averaged
    kl0 = 0.5 * (math.log(0.5) - (2 - z)) + 0.3 * (math.log(0.3) - (0 - z))
    kl1 = 0.6 * (math.log(0.6) - math.log(0.25)) + 0.1 * (math.log(0.1) - math.log(0.25))
    got = topk_kl(student.detach().gather(1, ids), teacher)
    assert got == pytest.approx((kl0 + kl1) / 2, rel=1e-5)


def _local(engine: TorchEngine, envs: list[EnvConfig]) -> LocalTeachers:
    return LocalTeachers(envs, ModelConfig(), engine.tokenizer, engine.device, TEMPERATURE)


def _full_logprobs(model_dir: Path, sample: protocol.Sample) -> torch.Tensor:
    """log softmax(logits / T) of the model at each completion token, [n, vocab], one
    plain forward of the whole sequence (no batching, no padding)."""
    model, _ = load_causal_lm(model_dir)
    prompt = protocol.unpack_ids(sample.prompt_ids).astype(np.int64)
    completion = protocol.unpack_ids(sample.completion_ids).astype(np.int64)
    ids = torch.from_numpy(np.concatenate([prompt, completion]))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / TEMPERATURE, -1)


def test_the_teachers_top_k_is_its_likeliest_tokens_with_their_logprobs(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
):
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=2)
    engine = TorchEngine(tiny_model_dir, seed=1)
    envs = [EnvConfig(name="arithmetic", teacher=str(teacher_dir), teacher_top_k=5)]
    teachers = _local(engine, envs)
    for group in played_groups(engine, (1.0, 0.0, 0.0)):
        scored, _ = teachers.score_now(group)
        assert protocol.check_group(scored, engine.vocab_size, 4096) is None
        for sample in scored.samples:
            n = len(sample.loss_mask)
            mask = protocol.unpack_mask(sample.loss_mask).astype(bool)
            ids = protocol.unpack_ids(sample.teacher_top_ids).reshape(n, 5)
            values = protocol.unpack_floats(sample.teacher_top_logprobs).reshape(n, 5)
            full = _full_logprobs(teacher_dir, sample)
            want_values, want_ids = full[torch.from_numpy(mask)].topk(5, -1)
            np.testing.assert_array_equal(ids[mask], want_ids.numpy())
            np.testing.assert_allclose(values[mask], want_values.numpy(), atol=1e-5)
            assert (np.diff(values[mask], axis=1) <= 0).all()  # likeliest first
            assert not ids[~mask].any() and not values[~mask].any()  # tool output: none
    # `at`: the logprobs of named tokens, what the trainer's check reads
    sample = scored.samples[0]
    n = len(sample.loss_mask)
    named = np.full((n, 2), 7, dtype=np.int32)
    named[:, 1] = 11
    [score] = teachers.by_env["arithmetic"].scores([sample], TEMPERATURE, at=[named])
    mask = protocol.unpack_mask(sample.loss_mask).astype(bool)
    full = _full_logprobs(teacher_dir, sample)[torch.from_numpy(mask)]
    assert score.top_logprobs is not None
    np.testing.assert_allclose(score.top_logprobs[mask][:, 0], full[:, 7].numpy(), atol=1e-5)
    np.testing.assert_allclose(score.top_logprobs[mask][:, 1], full[:, 11].numpy(), atol=1e-5)


def _sample(ids: bytes, logprobs: bytes) -> protocol.TrajectoryGroup:
    """A group of one sample of 3 completion tokens (the last not the model's), with the
    teacher's top k `ids` and `logprobs`."""
    sample = make_sample(
        completion_ids=protocol.pack_ids([3, 4, 5]),
        logprobs=protocol.pack_floats([-0.1, -0.2, -0.3]),
        loss_mask=protocol.pack_mask([1, 1, 0]),
        teacher_logprobs=protocol.pack_floats([-1.0, -2.0, 0.0]),
        teacher_top_ids=ids,
        teacher_top_logprobs=logprobs,
    )
    return protocol.msgspec.structs.replace(make_group("g"), samples=[sample])


def test_a_malformed_top_k_is_refused_with_its_reason():
    ids = protocol.pack_ids([3, 9, 1, 2, 0, 0])  # k = 2 at 3 completion tokens
    values = protocol.pack_floats([-0.1, -2.0, -0.5, -1.0, 0.0, 0.0])
    assert protocol.check_group(_sample(ids, values), 100, 64) is None
    too_many = protocol.MAX_TOP_K + 1
    for group, why in (
        (_sample(ids[:-4], values[:-4]), "not k x 3 token ids"),
        (_sample(b"", values), "not k x 3 token ids"),
        (_sample(ids, b""), "differ in length"),
        (_sample(protocol.pack_ids([0] * 3 * too_many), b"\0" * 12 * too_many), "k x 3"),
        (_sample(protocol.pack_ids([3, 100, 1, 2, 0, 0]), values), "outside the vocabulary"),
        (_sample(protocol.pack_ids([3, -1, 1, 2, 0, 0]), values), "outside the vocabulary"),
        (_sample(ids, protocol.pack_floats([-0.1, 2.0, -0.5, -1, 0, 0])), "finite and <= 0"),
        (_sample(ids, protocol.pack_floats([-0.1, math.nan, -0.5, -1, 0, 0])), "finite"),
    ):
        problem = protocol.check_group(group, 100, 64)
        assert problem is not None and why in problem, problem


def test_a_teacher_nodes_top_k_is_taken_only_as_asked_for():
    samples = [
        protocol.TeacherInput(
            prompt_ids=protocol.pack_ids([1, 2]),
            completion_ids=protocol.pack_ids([3, 4]),
            loss_mask=protocol.pack_mask([1, 1]),
        )
    ]
    request = protocol.TeacherScoreRequest(
        node_id="r", teacher="t", temperature=1.0, samples=samples, top_k=2
    )

    def reply(ids: list[int], values: list[float], tops: int = 1) -> protocol.TeacherScores:
        return protocol.TeacherScores(
            logprobs=[protocol.pack_floats([-1.0, -2.0])],
            top_ids=[protocol.pack_ids(ids)] * tops,
            top_logprobs=[protocol.pack_floats(values)] * tops,
        )

    assert scores_problem(reply([5, 6, 7, 8], [-0.1, -1, -0.2, -3]), request, 50) is None
    for bad, why in (
        (reply([5, 6, 7, 8], [-0.1, -1, -0.2, -3], tops=0), "top k of 0 and 0 samples"),
        (reply([5, 6], [-0.1, -1]), "a top 1 for a top 2 request"),
        (reply([5, 6, 7, 50], [-0.1, -1, -0.2, -3]), "outside the vocabulary"),
        (reply([5, 6, 7, 8], [-0.1, -1, 0.2, -3]), "finite and <= 0"),
    ):
        problem = scores_problem(bad, request, 50)
        assert problem is not None and why in problem, problem
    # a top k nobody asked for is refused too
    plain = protocol.msgspec.structs.replace(request, top_k=0)
    problem = scores_problem(reply([5, 6, 7, 8], [-0.1, -1, -0.2, -3]), plain, 50)
    assert problem is not None and "for a top 0 request" in problem


def _scored(
    engine: TorchEngine, teacher_dir: Path, rewards: tuple[float, ...]
) -> list[protocol.TrajectoryGroup]:
    """played_groups's two groups, the first on arithmetic scored with a top 4, the second
    on python_code with a top 2 (several environments, several k)."""
    envs = [
        EnvConfig(name="arithmetic", teacher=str(teacher_dir), teacher_top_k=4),
        EnvConfig(name="python_code", teacher=str(teacher_dir), teacher_top_k=2),
    ]
    teachers = _local(engine, envs)
    first, second = played_groups(engine, rewards)
    second = protocol.msgspec.structs.replace(second, env="python_code")
    return [teachers.score_now(first)[0], teachers.score_now(second)[0]]


COEFS = {"arithmetic": 1.0, "python_code": 0.5}


def test_the_learners_topk_loss_is_the_one_built_from_plain_forwards(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
):
    """The learner shares prompts, pads rows and k, and projects only trained positions:
    its top-k loss is still rl.topk_distill_loss over each sample's own forward, and the
    sampled-token advantage term is off for rows with a top k."""
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=2)
    engine = TorchEngine(tiny_model_dir, seed=1)
    groups = _scored(engine, teacher_dir, (1.0, 0.0, 0.0))
    model, _ = load_causal_lm(tiny_model_dir)
    optimizer = lone_optimizer(model, target_batch_size=6)
    config = TrainerConfig(micro_batch_samples=8)
    learner = Learner(model, optimizer, config, TEMPERATURE, 0, teacher_coefs=COEFS)
    rows = learner._rows(groups)
    with torch.no_grad():
        out = learner._forward(rows)
    want = 0.0
    for group in groups:
        for sample in group.samples:
            n = len(sample.loss_mask)
            k = protocol.top_k_of(sample.teacher_top_ids, n)
            mask = torch.from_numpy(protocol.unpack_mask(sample.loss_mask).astype(bool))
            ids = torch.from_numpy(protocol.unpack_ids(sample.teacher_top_ids).reshape(n, k).copy())
            values = protocol.unpack_floats(sample.teacher_top_logprobs).reshape(n, k)
            student = _full_logprobs(tiny_model_dir, sample)
            at = student.gather(1, ids.long())[mask]
            coef = torch.full((int(mask.sum()),), COEFS[group.env])
            want += float(topk_distill_loss(at, torch.from_numpy(values.copy())[mask], coef))
    assert out.topk_loss is not None
    assert float(out.topk_loss) == pytest.approx(want, rel=1e-4)
    # reward advantages only (+-1.41 and -0.71 for rewards 1, 0, 0), no teacher term
    assert out.advantages.dim() == 1


def test_a_student_moves_toward_its_teachers_top_k_with_no_reward_signal(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
):
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1)
    engine = TorchEngine(tiny_model_dir, seed=1)
    groups = _scored(engine, teacher_dir, (0.0, 0.0, 0.0))
    model, _ = load_causal_lm(tiny_model_dir)
    optimizer = lone_optimizer(model, target_batch_size=6, lr=3e-3)
    kls = []
    config = TrainerConfig(micro_batch_samples=4, max_logprob_gap=0.0)
    learner = Learner(model, optimizer, config, TEMPERATURE, 0, teacher_coefs=COEFS)
    for _ in range(4):
        row = learner.train_step(groups).row()
        assert row["charts/trained_samples"] == 6 and row["charts/teacher_samples"] == 6
        kls.append(row["charts/teacher_topk_kl"])
    assert kls[-1] < 0.8 * kls[0], kls
    assert all(b < a for a, b in zip(kls, kls[1:], strict=False)), kls


def _each_sample(
    group: protocol.TrajectoryGroup, group_id: str, change: Callable[[protocol.Sample], dict]
) -> protocol.TrajectoryGroup:
    """`group` renamed `group_id`, each sample with the fields `change` gives it."""
    samples = [protocol.msgspec.structs.replace(s, **change(s)) for s in group.samples]
    return protocol.msgspec.structs.replace(group, group_id=group_id, samples=samples)


def test_the_trainers_check_rejects_a_forged_top_k(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
):
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1)
    engine = TorchEngine(tiny_model_dir, seed=1)
    honest, other = _scored(engine, teacher_dir, (1.0, 0.0, 0.0))
    # the teacher made sure of its top tokens: the sampled tokens' logprobs left honest
    forged = _each_sample(
        honest,
        "forged-top",
        lambda s: {
            "teacher_top_logprobs": protocol.pack_floats(
                np.minimum(0.0, protocol.unpack_floats(s.teacher_top_logprobs) + 3.0)
            )
        },
    )
    # some samples with a top k, one without: malformed
    partial = protocol.msgspec.structs.replace(
        honest,
        group_id="partial-top",
        samples=[
            protocol.msgspec.structs.replace(
                honest.samples[0], teacher_top_ids=b"", teacher_top_logprobs=b""
            ),
            *honest.samples[1:],
        ],
    )
    envs = [
        EnvConfig(name="arithmetic", teacher=str(teacher_dir)),
        EnvConfig(name="python_code", teacher=str(teacher_dir)),
    ]
    teachers = _local(engine, envs).by_env
    # a token past this teacher's vocabulary (the student's may be larger): not scorable
    vocab = teachers["arithmetic"].model.config.vocab_size
    beyond = _each_sample(
        honest,
        "beyond-vocab",
        lambda s: {
            "teacher_top_ids": protocol.pack_ids(np.full(len(s.teacher_top_ids) // 4, vocab))
        },
    )
    check = TeacherCheck(teachers, 1.0, b"secret", TEMPERATURE)
    gaps = check.gaps([honest, other, forged, partial, beyond])
    assert gaps["g0"] < 1e-4 and gaps["g1"] < 1e-4
    assert gaps["forged-top"] > 1.0
    assert gaps["partial-top"] == gaps["beyond-vocab"] == float("inf")
