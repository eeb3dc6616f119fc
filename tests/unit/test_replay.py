"""Replay (node/replay.py): the buffer's bounds (uses, lag, groups, bytes), fresh groups'
priority, what is never replayed, and the learner's importance ratios of a replayed group
against ones computed here by hand."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from agentjet import protocol, rl
from agentjet.config import ReplayConfig, TrainerConfig, load_config
from agentjet.episode import Episode, SamplingParams
from agentjet.errors import ConfigError
from node.learner import Learner
from node.model import load_causal_lm
from node.replay import Replay, group_bytes
from node.rollout_produce import build_group
from node.torch_engine import TorchEngine
from tests.factories import make_group
from tests.unit.test_trainer_logic import lone_optimizer

pytestmark = pytest.mark.unit

ROOT = protocol.Lineage()


def replay(**settings: float) -> Replay:
    """A replay of 4-group steps, half of each replays by default."""
    config = {"share": 0.5, "max_uses": 2, "max_lag": 2, **settings}
    return Replay(TrainerConfig(groups_per_step=4, replay=ReplayConfig(**config)))


def ids(groups: list[protocol.TrajectoryGroup]) -> list[str]:
    return [g.group_id for g in groups]


def test_off_by_default_a_step_waits_for_all_its_fresh_groups_and_keeps_nothing():
    off = Replay(TrainerConfig(groups_per_step=4))
    off.add([make_group("a")])
    assert len(off) == 0 and off.fresh_needed(0, ROOT) == 4 and off.take(0, 0, ROOT) == []


def test_replays_fill_a_steps_share_and_fresh_groups_keep_priority():
    buffer = replay()
    assert buffer.fresh_needed(0, ROOT) == 4  # nothing to replay yet
    buffer.add([make_group("a"), make_group("b"), make_group("c")])
    # half a step of 4 can be replays: the step waits for 2 fresh groups
    assert buffer.fresh_needed(0, ROOT) == 2
    assert ids(buffer.take(2, 0, ROOT)) == ["a", "b"]
    assert ids(buffer.take(3, 0, ROOT)) == ["a"]  # the rest of the batch
    assert buffer.take(4, 0, ROOT) == []  # a full fresh batch holds no replay


def test_extra_replays_join_every_step_however_full_its_fresh_batch():
    buffer = replay(share=0.0, extra=2)
    assert buffer.on and buffer.fresh_needed(0, ROOT) == 4  # a step still waits for 4 fresh
    buffer.add([make_group("a"), make_group("b"), make_group("c")])
    assert buffer.fresh_needed(0, ROOT) == 4
    assert ids(buffer.take(4, 0, ROOT)) == ["a", "b"]  # on top of a full fresh batch
    both = replay(share=0.5, extra=1)
    both.add([make_group("a"), make_group("b"), make_group("c"), make_group("d")])
    assert ids(both.take(2, 0, ROOT)) == ["a", "b", "c"]  # the rest of the batch, and 1 more
    assert ids(both.take(4, 0, ROOT)) == ["a"]


def test_a_group_is_trained_at_most_max_uses_times():
    buffer = replay(max_uses=3)
    buffer.add([make_group("a"), make_group("b")])  # first use: the fresh step
    stats = buffer.used(["a"], version=1)
    assert stats.groups == 1 and stats.uses_mean == 2
    # least-used first
    assert ids(buffer.take(2, 1, ROOT)) == ["b", "a"]
    buffer.used(["a"], version=1)
    assert ids(buffer.take(2, 1, ROOT)) == ["b"] and len(buffer) == 1  # a: 3 uses, gone


def test_a_group_is_replayed_only_within_the_lag_bound():
    buffer = replay(max_lag=2)
    buffer.add([make_group("v0", version=0), make_group("v1", version=1)])
    # freshest first at equal uses
    assert ids(buffer.take(2, 2, ROOT)) == ["v1", "v0"]
    stats = buffer.used(["v0", "v1"], version=2)
    assert stats.samples == 4 and stats.lag_mean == 1.5 and stats.lag_max == 2
    buffer = replay(max_lag=2, max_uses=3)
    buffer.add([make_group("v0", version=0), make_group("v1", version=1)])
    assert ids(buffer.take(2, 3, ROOT)) == ["v1"]  # v0 is 3 versions old at a step at 3
    assert len(buffer) == 1  # and never eligible again: it left


def test_the_buffer_is_bounded_in_groups_and_bytes_oldest_sampled_first():
    buffer = replay(max_groups=2)
    buffer.add([make_group("v2", version=2), make_group("v0", version=0)])
    buffer.add([make_group("v1", version=1)])
    assert sorted(ids(buffer.take(2, 2, ROOT))) == ["v1", "v2"] and len(buffer) == 2
    one = group_bytes(make_group("x"))
    assert one > 0
    buffer = replay(max_mb=2.5 * one / 1e6)
    buffer.add([make_group("v0", version=0), make_group("v1", version=1)])
    buffer.add([make_group("v2", version=2)])
    assert len(buffer) == 2 and buffer.nbytes == 2 * one
    assert sorted(ids(buffer.take(2, 2, ROOT))) == ["v1", "v2"]
    # a teacher's scores count too (a top 16 is 128 bytes a token: more than the rest)
    taught = make_group("t")
    taught.samples = [
        protocol.msgspec.structs.replace(
            s,
            teacher_logprobs=s.logprobs,
            teacher_top_ids=s.completion_ids * 16,
            teacher_top_logprobs=s.logprobs * 16,
        )
        for s in taught.samples
    ]
    extra = sum(len(s.logprobs) + 32 * len(s.completion_ids) for s in taught.samples)
    assert group_bytes(taught) == one + extra


def test_nothing_untrainable_is_replayed():
    buffer = replay(max_uses=4)
    same = make_group("same", rewards=(1.0, 1.0))  # no gradient: never kept
    bad = make_group("bad-node")
    bad.node_id = "quarantined-node"
    buffer.add([same, bad, make_group("a"), make_group("b")])
    assert len(buffer) == 3
    assert buffer.forget_node("quarantined-node") == 1  # a node quarantined later
    buffer.drop(["a"])  # a replay over the logprob gap bound
    assert ids(buffer.take(0, 0, ROOT)) == ["b"]
    # weights of another lineage: the base's groups are not its to train at version 5
    other = protocol.Lineage(id="L2", ancestors={"": 3})
    buffer.add([make_group("c", version=4)])
    assert ids(buffer.take(2, 5, other)) == []
    buffer.clear()
    assert len(buffer) == 0 and buffer.nbytes == 0


def test_replay_settings_are_checked(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text("[trainer]\nmax_policy_lag = 2\n[trainer.replay]\nshare = 0.5\nmax_lag = 3\n")
    with pytest.raises(ConfigError, match="trainer.replay.max_lag: 3 is more than"):
        load_config(path)
    # replay off: its lag bound is not checked (the default 2 with a lag bound of 1)
    path.write_text("[trainer]\nmax_policy_lag = 1\n")
    assert load_config(path).trainer.replay.share == 0
    path.write_text("[trainer]\nmax_policy_lag = 1\n[trainer.replay]\nextra = 2\n")
    with pytest.raises(ConfigError, match="trainer.replay.max_lag: 2 is more than"):
        load_config(path)
    for bad in ("share = 1.0", "max_uses = 1", "max_groups = 0", "extra = -1"):
        path.write_text(f"[trainer.replay]\n{bad}\n")
        with pytest.raises(ConfigError, match="replay"):
            load_config(path)


def test_a_replayed_groups_ratios_are_against_its_sampler(
    tiny_model_dir: Path, one_torch_thread: None
):
    """A group trained once, then replayed at the next version: the learner's importance
    ratios are exp(log pi_theta - log mu) of the moved weights against the sampler's
    logprobs, as computed here by a plain forward; its gap over the bound drops it with
    no mark against its node."""
    temperature = 0.7
    engine = TorchEngine(tiny_model_dir, seed=3)
    params = SamplingParams(temperature=temperature, max_new_tokens=6)
    prompt = [1, 5, 9, 200]
    [samples] = asyncio.run(engine.generate([prompt], 3, params))
    episodes = []
    for j, completion in enumerate(samples):
        episode = Episode(prompt_ids=prompt, reward=float(j == 0))
        episode.add_model_turn(completion)
        episodes.append(episode)
    task = protocol.Task(id="t", env="arithmetic", prompt="")
    grant = protocol.WorkGrant(grant_id="g", task=task, group_size=3, lease_s=1.0)
    group = build_group(grant, episodes, "n", 0.0)

    model, _ = load_causal_lm(tiny_model_dir)
    # (a smaller step than lone_optimizer's default: the moved policy stays within the gap bound)
    optimizer = lone_optimizer(model, target_batch_size=3, lr=1e-4)
    # one micro-batch: the statistics are means over all trained tokens
    config = TrainerConfig(micro_batch_samples=8, max_logprob_gap=0.5)
    learner = Learner(model, optimizer, config, temperature, 0)
    first = learner.train_step([group]).row()
    assert first["losses/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    # by hand: the moved weights' logprobs of the sampled tokens, per trained token
    ratios, binds = [], []
    advantages = rl.sample_advantages([s.reward for s in group.samples], [-1, -1, -1])
    with torch.no_grad():
        for sample, advantage in zip(group.samples, advantages, strict=True):
            completion = protocol.unpack_ids(sample.completion_ids).tolist()
            mu = protocol.unpack_floats(sample.logprobs)
            ids_ = torch.tensor([prompt + completion])
            logits = model(input_ids=ids_).logits[0].float() / temperature
            logp = torch.log_softmax(logits, dim=-1)
            for t, token in enumerate(completion):
                pi = float(logp[len(prompt) - 1 + t, token])
                ratio = math.exp(pi - float(mu[t]))
                ratios.append(ratio)
                # the clip binds where the ratio left 1 ± 0.2 the advantage's way
                binds.append(ratio > 1.2 if advantage > 0 else ratio < 0.8)
    assert max(abs(r - 1) for r in ratios) > 1e-3, "the step did not move the policy"
    replayed = learner.train_step([], replays=[group])
    row = replayed.row()
    assert row["losses/ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), abs=1e-4)
    assert row["losses/clip_frac"] == pytest.approx(sum(binds) / len(binds), abs=1e-6)
    assert row["charts/samples"] == 0 and row["charts/trained_samples"] == 3
    assert row["policy_version"] == 2 and not replayed.rejected
    # a bound the moved policy exceeds: the replay is dropped, its node not blamed
    learner.config = TrainerConfig(micro_batch_samples=8, max_logprob_gap=1e-6)
    tight = learner.train_step([], replays=[group])
    assert tight.replays_dropped == {"g"} and not tight.rejected
    assert tight.row()["policy_version"] == 2
