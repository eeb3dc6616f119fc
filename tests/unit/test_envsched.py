"""EnvSched's pure decisions, checked against numbers worked out by hand.

Most examples use groups of 2 (2 samples, 2 ordered pairs per group) so the sums stay small:
one group [1, 1] gives samples 2, reward 2, pairs 2, pair products 2.
"""

from __future__ import annotations

import random
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from agentjet.cli import format_status
from agentjet.config import (
    Config,
    CoordinatorConfig,
    EnvConfig,
    EnvSchedConfig,
    config_from_dict,
    to_toml,
)
from agentjet.errors import ConfigError
from agentjet.protocol import CoordinatorStatus, GroupReport, SchedulerRow, Task
from agentjet.tasks import generate_tasks, write_task_file
from coordinator import envsched
from coordinator.envsched import (
    MIN_ENV_HEALTH,
    Beta,
    Cell,
    EnvSched,
    EnvSource,
    Moments,
    Node,
    Statistics,
    Sums,
    apportion,
    beta_from_moments,
    candidate_weight,
    coverage_bonus,
    decay_factor,
    env_health,
    group_sums,
    mixed_probability,
    pick,
    prior_moments,
    relation_weight,
    relative_cost,
    shrink,
    status_table,
    updated,
    updated_beta,
    weighted_sample,
    weights_at,
    within_variance,
)
from coordinator.scheduler import UniformScheduler, draw_rng, make_scheduler
from coordinator.store import Accepted, Store

pytestmark = pytest.mark.unit

# Evidence that never ages, for examples whose numbers are worked out without decay.
NO_DECAY = EnvSchedConfig(half_life_groups=1e18)


def task(env: str = "arithmetic", op: str = "+", difficulty: int = 2, id: str = "") -> Task:
    return Task(
        id=id or f"d{difficulty}:1{op}1", env=env, prompt="", answer=2, op=op, difficulty=difficulty
    )


def report(rewards: list[float], failed: bool = False, tokens: int = 0) -> GroupReport:
    return GroupReport(
        node_id="n", grant_id="g", rewards=rewards, failed=failed, completion_tokens=tokens
    )


# ── sums and decay ────────────────────────────────────────────────────────────────────────


def test_a_group_adds_its_samples_pairs_and_whether_it_was_mixed() -> None:
    sums = group_sums(report([1.0, 0.0, 1.0, 1.0], tokens=40))
    # Σr = 3, Σr² = 3, pairs 4·3 = 12, Σ_{i≠j} r_i r_j = 3² − 3 = 6 (the 3·2 ordered right pairs)
    assert sums == Sums(
        reports=1, tokens=40, groups=1, mixed=1, samples=4, reward=3, reward_sq=3, pairs=12,
        pair_products=6,
    )  # fmt: skip
    assert group_sums(report([1.0, 1.0])).mixed == 0
    assert group_sums(report([2.0, -1.0])).reward == 1.0  # clipped to [0, 1]


def test_a_failed_group_counts_as_a_failure_and_teaches_nothing_about_rewards() -> None:
    assert group_sums(report([0.0, 0.0], failed=True, tokens=7)) == Sums(
        reports=1, failed=1, tokens=7
    )


def test_evidence_halves_every_half_life() -> None:
    assert decay_factor(0, 256) == 1.0
    assert decay_factor(256, 256) == 0.5
    assert decay_factor(512, 256) == 0.25
    one = Sums(groups=1.0, samples=2.0)
    node = updated(None, one, tick=0, half_life=256)
    later = updated(node, one, tick=256, half_life=256)
    assert later == Node(Sums(groups=1.5, samples=3.0), tick=256, visits=2)


def test_statistics_age_with_every_report_anywhere() -> None:
    stats = Statistics(EnvSchedConfig(half_life_groups=4), group_size=2)
    stats.observe(task(op="+"), report([1.0, 0.0]))
    for _ in range(4):
        stats.observe(task(op="*"), report([1.0, 1.0]))
    cell = stats.cell_view(Cell("arithmetic", "+", 2))
    assert cell.sums.groups == pytest.approx(0.5)  # one group, one half-life ago
    assert stats.cells[Cell("arithmetic", "+", 2)].visits == 1  # visits do not decay


# ── the Beta model ────────────────────────────────────────────────────────────────────────


def test_prior_moments_are_those_of_the_beta() -> None:
    assert prior_moments(1, 1) == pytest.approx(Moments(0.5, 1 / 3))
    # Beta(2, 6): mean 2/8, E[p²] = 2·3 / (8·9)
    assert prior_moments(2, 6) == pytest.approx(Moments(0.25, 1 / 12))


def test_shrinkage_beta_and_mixed_probability_by_hand() -> None:
    one_right_pair = group_sums(report([1.0, 1.0]))
    moments = shrink(one_right_pair, prior_moments(1, 1), prior_groups=1, group_size=2)
    # mean = (2 + 2·0.5) / (2 + 2); E[p²] = (2 + 2·1/3) / (2 + 2)
    assert moments == pytest.approx(Moments(0.75, 2 / 3))
    beta = beta_from_moments(moments)
    # Var(p) = 2/3 − 0.5625 = 0.10417 of 0.75·0.25 = 0.1875: ρ = 5/9, a + b = 9/5 − 1 = 0.8
    assert beta == pytest.approx(Beta(0.6, 0.2))
    # P(mixed of 2) = 2ab / ((a+b)(a+b+1)) = 0.24 / 1.44
    assert mixed_probability(beta, 2) == pytest.approx(1 / 6)
    assert within_variance(beta) == pytest.approx(0.12 / 1.44)


def test_mixed_probability_of_a_group_of_eight() -> None:
    # Uniform prior: P(all 8 right) = 1/9, so P(mixed) = 1 − 2/9.
    assert mixed_probability(Beta(1, 1), 8) == pytest.approx(7 / 9)
    # All tasks alike at p = 0.5 (no spread): the point-mass formula 1 − 2·0.5^8.
    alike = beta_from_moments(Moments(0.5, 0.25))
    assert mixed_probability(alike, 8) == pytest.approx(1 - 2 * 0.5**8, abs=1e-5)
    # Same mean, but every task is always right or always wrong: never a mixed group.
    split = beta_from_moments(Moments(0.5, 0.5))
    assert mixed_probability(split, 8) == pytest.approx(0.0, abs=1e-5)
    assert mixed_probability(Beta(1, 1), 1) == 0.0
    assert within_variance(Beta(1, 1)) == pytest.approx(1 / 6)  # E[p] − E[p²] = 1/2 − 1/3


def test_a_tasks_posterior_is_its_cells_beta_updated_by_its_rewards() -> None:
    posterior = updated_beta(Beta(0.6, 0.2), group_sums(report([1.0, 1.0, 0.0, 1.0])))
    assert posterior == pytest.approx(Beta(3.6, 1.2))
    stats = Statistics(NO_DECAY, group_size=2)
    seen = task(id="d2:1+1")
    stats.observe(seen, report([1.0, 0.0]))
    # Its cell holds only this task's group, which is left out: the prior is the root
    # Beta(1, 1), updated by one right and one wrong: Beta(2, 2).
    assert stats.task_beta(seen) == pytest.approx(Beta(2, 2))
    # P(mixed of 2) = 1 − 2·E[p²] = 1 − 2·(2·3)/(4·5)
    assert mixed_probability(stats.task_beta(seen), 2) == pytest.approx(0.4)


def test_only_strangers_are_evidence_about_their_cell() -> None:
    stats = Statistics(NO_DECAY, group_size=2)
    favourite = task(id="d2:1+1")
    stats.observe(favourite, report([1.0, 0.0]))
    stats.observe(favourite, report([1.0, 0.0]))  # chosen again for its own record
    cell = stats.cell_view(Cell("arithmetic", "+", 2))
    assert cell.sums.groups == 1.0
    assert stats.cells[Cell("arithmetic", "+", 2)].visits == 2
    stats.observe(task(id="d2:2+2"), report([1.0, 1.0]))  # a stranger
    assert stats.cell_view(Cell("arithmetic", "+", 2)).sums.groups == 2.0


# ── the graph ─────────────────────────────────────────────────────────────────────────────


def test_relations_between_cells() -> None:
    cell = Cell("python_tool", "+", 2)
    assert relation_weight(cell, Cell("arithmetic", "+", 2), 1.0, 0.25) == 1.0  # family
    assert relation_weight(cell, Cell("arithmetic", "*", 2), 1.0, 0.25) == 0.25  # difficulty
    assert relation_weight(cell, Cell("python_tool", "*", 2), 1.0, 0.25) == 0.25
    assert relation_weight(cell, Cell("arithmetic", "+", 3), 1.0, 0.25) == 0.0
    assert relation_weight(cell, cell, 1.0, 0.25) == 0.0
    featureless = Cell("arithmetic", "", 0)
    assert relation_weight(featureless, Cell("python_tool", "", 0), 1.0, 0.25) == 0.0


def test_rarely_seen_cells_borrow_from_related_cells() -> None:
    stats = Statistics(NO_DECAY, group_size=2)
    stats.observe(task(env="arithmetic", op="+"), report([1.0, 1.0]))
    # Same op and difficulty in another environment: the pooled group counts fully, so the
    # parent is the worked example above, and a cell without data of its own is its parent.
    family = stats.cell_view(Cell("python_tool", "+", 2))
    assert family.parent == pytest.approx(Moments(0.75, 2 / 3))
    assert family.beta == pytest.approx(Beta(0.6, 0.2))
    # Same difficulty, other op: a quarter of a group. mean = (0.5 + 2·0.5) / (0.5 + 2),
    # E[p²] = (0.5 + 2/3) / (0.5 + 2).
    cousin = stats.cell_view(Cell("python_tool", "*", 2))
    assert cousin.parent == pytest.approx(Moments(0.6, (0.5 + 2 / 3) / 2.5))
    # A cell never borrows from itself: the reported cell's parent is the prior.
    own = stats.cell_view(Cell("arithmetic", "+", 2))
    assert own.parent == pytest.approx(prior_moments(1, 1))


def test_coverage_bonus_shrinks_with_visits_and_grows_back_with_age() -> None:
    assert coverage_bonus(0.0, 0.1) == pytest.approx(0.1)
    assert coverage_bonus(3.0, 0.1) == pytest.approx(0.05)
    stats = Statistics(EnvSchedConfig(half_life_groups=2), group_size=2)
    for _ in range(3):
        stats.observe(task(op="+", id="d2:1+1"), report([1.0, 0.0]))
    fresh = stats.cell_view(Cell("arithmetic", "+", 2)).sums.groups
    for _ in range(6):
        stats.observe(task(op="*"), report([1.0, 0.0]))
    aged = stats.cell_view(Cell("arithmetic", "+", 2)).sums.groups
    assert aged == pytest.approx(fresh / 8)
    assert coverage_bonus(aged, 0.1) > coverage_bonus(fresh, 0.1)


def test_cost_is_relative_to_the_environment_and_clipped() -> None:
    env = Sums(reports=10, tokens=1000)  # 100 tokens per group
    # (400 + 2·100) / (2 + 2) = 150 tokens: 1.5 times the environment's mean
    assert relative_cost(Sums(reports=2, tokens=400), env, 2.0) == pytest.approx(1.5)
    assert relative_cost(Sums(reports=100, tokens=1e6), env, 2.0) == envsched.MAX_COST_RATIO
    assert relative_cost(Sums(reports=2, tokens=400), Sums(reports=3), 2.0) == 1.0


def test_failing_environments_lose_their_share_but_keep_probes() -> None:
    assert env_health(Sums(reports=4, failed=3), 2.0) == pytest.approx(1 - 3 / 6)
    assert env_health(Sums(), 2.0) == 1.0
    assert env_health(Sums(reports=1000, failed=1000), 2.0) == MIN_ENV_HEALTH


def test_candidate_weight_is_signal_per_cost_plus_exploration() -> None:
    assert candidate_weight(0.5, 2.0, 0.1, 0.01) == pytest.approx(0.25 + 0.11)


# ── allocation ────────────────────────────────────────────────────────────────────────────


def test_ratio_targets_follow_the_schedule() -> None:
    base = {"arithmetic": 3.0, "python_tool": 1.0}
    at, schedule = [100, 500], {"python_tool": [2.0, 0.0]}
    assert weights_at(base, at, schedule, 99) == base
    assert weights_at(base, at, schedule, 100) == {"arithmetic": 3.0, "python_tool": 2.0}
    assert weights_at(base, at, schedule, 10_000) == {"arithmetic": 3.0, "python_tool": 0.0}
    assert weights_at(base, [], {}, 10) == base


def test_apportion_holds_ratios_in_every_batch() -> None:
    weights = {"arithmetic": 3.0, "python_tool": 1.0}
    for seed in range(50):
        counts = apportion(8, weights, {}, random.Random(seed))
        assert counts == {"arithmetic": 6, "python_tool": 2}
        odd = apportion(7, weights, {}, random.Random(seed))  # quotas 5.25 and 1.75
        assert odd["arithmetic"] in (5, 6) and sum(odd.values()) == 7
    singles = Counter(
        env
        for seed in range(4000)
        for env, n in apportion(1, weights, {}, random.Random(seed)).items()
        if n
    )
    assert singles["arithmetic"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_apportion_respects_capacity() -> None:
    weights = {"arithmetic": 3.0, "python_tool": 1.0}
    rng = random.Random(0)
    assert apportion(8, weights, {"arithmetic": 1}, rng) == {"arithmetic": 1, "python_tool": 7}
    assert apportion(8, weights, {"arithmetic": 1, "python_tool": 2}, rng) == {
        "arithmetic": 1,
        "python_tool": 2,
    }
    assert apportion(8, {"arithmetic": 1.0, "python_tool": 0.0}, {}, rng) == {
        "arithmetic": 8,
        "python_tool": 0,
    }
    assert apportion(0, weights, {}, rng) == {"arithmetic": 0, "python_tool": 0}


def test_weighted_sampling_without_replacement() -> None:
    rng = random.Random(0)
    assert sorted(weighted_sample([1.0, 1.0, 1.0], 3, rng)) == [0, 1, 2]
    firsts = Counter(weighted_sample([3.0, 1.0], 1, rng)[0] for _ in range(4000))
    assert firsts[0] / 4000 == pytest.approx(0.75, abs=0.03)
    assert sorted(pick([1.0, 2.0], 5, rng)) in ([0, 0, 1, 1, 1], [0, 0, 0, 1, 1])
    assert pick([], 3, rng) == []


# ── the scheduler ─────────────────────────────────────────────────────────────────────────


def teach(scheduler: EnvSched, rounds: int = 30) -> None:
    """1-digit tasks are always right, 3-digit always wrong, 2-digit tasks right half the time."""
    rng = random.Random(1)
    for i in range(rounds):
        for t in scheduler.choose(8, rng, grants_issued=8 * i):
            rewards = {1: [1.0] * 8, 2: [1.0, 0.0] * 4, 3: [0.0] * 8}[t.difficulty]
            scheduler.observe(t, report(rewards))


def test_envsched_sends_work_where_groups_are_mixed() -> None:
    scheduler = EnvSched([EnvConfig()], EnvSchedConfig(), group_size=8)
    teach(scheduler)
    chosen = Counter(t.difficulty for t in scheduler.choose(400, random.Random(2)))
    assert chosen[2] / 400 > 0.8
    assert chosen[1] > 0 and chosen[3] > 0  # exploration floor: nothing starves
    uniform = Counter(t.difficulty for t in UniformScheduler([EnvConfig()]).choose(400))
    assert uniform[2] / 400 == pytest.approx(1 / 3, abs=0.08)


def test_envsched_offers_tasks_whose_last_group_was_mixed_again() -> None:
    scheduler = EnvSched([EnvConfig(difficulties=[3])], EnvSchedConfig(), group_size=8)
    for op in "+-*":  # fresh 3-digit tasks are hopeless...
        for i in range(10):
            scheduler.observe(task(op=op, difficulty=3, id=f"d3:{i}{op}0"), report([0.0] * 8))
    known = task(op="*", difficulty=3, id="d3:123*456")  # ...but this one is within reach
    scheduler.observe(known, report([1.0, 0.0] * 4))
    assert known.id in scheduler.frontiers["arithmetic"]
    picks = [t.id for i in range(20) for t in scheduler.choose(8, random.Random(i))]
    assert picks.count(known.id) >= 10  # a fresh 3-digit task repeats with chance ~0
    scheduler.observe(known, report([1.0] * 8))
    assert known.id not in scheduler.frontiers["arithmetic"]
    off = EnvSched([EnvConfig()], EnvSchedConfig(frontier_size=0), group_size=8)
    off.observe(known, report([1.0, 0.0] * 4))
    assert not off.frontiers["arithmetic"]


def test_frontier_tasks_of_an_older_config_are_not_offered(tmp_path: Path) -> None:
    # Restarted with 1-digit tasks only, a 3-digit task of the history stays out.
    scheduler = EnvSched([EnvConfig(difficulties=[1])], EnvSchedConfig(), group_size=8)
    old = task(op="*", difficulty=3, id="d3:123*456")
    scheduler.observe(old, report([1.0, 0.0] * 4))
    picks = [t for i in range(20) for t in scheduler.choose(8, random.Random(i))]
    assert old not in picks and {t.difficulty for t in picks} == {1}
    task_file = tmp_path / "tasks.jsonl"
    write_task_file(generate_tasks(3, seed=1), task_file)
    entry = EnvSource.of(EnvConfig(task_file=str(task_file)))
    assert all(entry.can_draw(t) for t in generate_tasks(3, seed=1))
    assert not entry.can_draw(old)


def test_envsched_keeps_env_ratios_capacity_and_schedule() -> None:
    envs = [EnvConfig(name="arithmetic", weight=3.0), EnvConfig(name="python_tool", weight=1.0)]
    params = EnvSchedConfig(
        max_open={"python_tool": 3},
        ratio_at_grants=[1000],
        ratio_weights={"arithmetic": [1.0], "python_tool": [3.0]},
    )
    scheduler = EnvSched(envs, params, group_size=8)
    counts = Counter(t.env for t in scheduler.choose(8, random.Random(0)))
    assert counts == {"arithmetic": 6, "python_tool": 2}
    full = scheduler.choose(8, random.Random(0), open_by_env={"python_tool": 3})
    assert Counter(t.env for t in full) == {"arithmetic": 8}
    later = scheduler.choose(
        8, random.Random(0), open_by_env={"python_tool": 0}, grants_issued=1000
    )
    assert Counter(t.env for t in later) == {"arithmetic": 5, "python_tool": 3}  # 6 hits the cap


def test_envsched_keeps_difficulty_quotas_within_an_environment() -> None:
    # Taught that 1-digit groups are the mixed ones, EnvSched alone would fill batches with
    # them; a difficulty quota keeps each batch's split and chooses by score within it.
    params = EnvSchedConfig(difficulty_weights=[0.5, 0.375, 0.125])
    scheduler = EnvSched([EnvConfig()], params, group_size=8)
    for i in range(30):
        scheduler.observe(
            task(op="+", difficulty=1, id=f"d1:{i % 10}+{i // 10}"), report([1.0, 0.0] * 4)
        )
        scheduler.observe(task(op="+", difficulty=2, id=f"d2:{10 + i}+10"), report([0.0] * 8))
    frontier = scheduler.frontiers["arithmetic"]
    assert len(frontier) == 30 and {t.difficulty for t in frontier.values()} == {1}
    for seed in range(20):
        batch = scheduler.choose(8, random.Random(seed))
        assert Counter(t.difficulty for t in batch) == {1: 4, 2: 3, 3: 1}
    assert scheduler.difficulty_targets("arithmetic") == {1: 0.5, 2: 0.375, 3: 0.125}
    # Weights past a source's difficulties are ignored; one difficulty needs no quota.
    two = EnvSched([EnvConfig(difficulties=[1, 2])], params, group_size=8)
    assert two.difficulty_targets("arithmetic") == {1: 0.5, 2: 0.375}
    one = EnvSched([EnvConfig(difficulties=[3])], params, group_size=8)
    assert one.difficulty_targets("arithmetic") == {}
    assert {t.difficulty for t in one.choose(8, random.Random(0))} == {3}
    unset = EnvSched([EnvConfig()], EnvSchedConfig(), group_size=8)
    assert unset.difficulty_targets("arithmetic") == {}


def test_a_task_file_is_drawn_at_a_difficulty(tmp_path: Path) -> None:
    task_file = tmp_path / "tasks.jsonl"
    write_task_file(generate_tasks(30, seed=1), task_file)
    source = EnvSource.of(EnvConfig(task_file=str(task_file))).source
    assert source.drawn_difficulties() == {1, 2, 3}
    rng = random.Random(0)
    assert {source.sample(rng, 2).difficulty for _ in range(20)} == {2}
    params = EnvSchedConfig(difficulty_weights=[0.0, 1.0])
    scheduler = EnvSched([EnvConfig(task_file=str(task_file))], params, group_size=8)
    assert {t.difficulty for t in scheduler.choose(8, random.Random(0))} == {2}


def test_envsched_steers_away_from_a_failing_environment() -> None:
    envs = [EnvConfig(name="arithmetic"), EnvConfig(name="python_tool")]
    scheduler = EnvSched(envs, NO_DECAY, group_size=8)
    for _ in range(40):
        scheduler.observe(task(env="python_tool"), report([], failed=True))
    targets = scheduler.target_weights(0)
    assert targets["arithmetic"] == 1.0
    assert targets["python_tool"] == pytest.approx(max(MIN_ENV_HEALTH, 1 - 40 / 42))
    chosen = Counter(t.env for i in range(50) for t in scheduler.choose(8, random.Random(i)))
    assert chosen["python_tool"] / 400 < 0.1


def test_uniform_stays_selectable_and_measures_without_learning() -> None:
    uniform = make_scheduler(Config())
    assert isinstance(uniform, UniformScheduler)
    before = uniform.choose(8, draw_rng(3, 0))
    uniform.observe(before[0], report([1.0, 0.0] * 4))
    assert uniform.statistics.tick == 1
    assert make_scheduler(Config()).choose(8, draw_rng(3, 0)) == before
    envsched_config = Config(coordinator=CoordinatorConfig(scheduler="envsched"))
    assert isinstance(make_scheduler(envsched_config), EnvSched)


def test_config_rejects_what_envsched_cannot_use() -> None:
    def load(envsched_table: dict[str, object]) -> Config:
        return config_from_dict(
            {"coordinator": {"scheduler": "envsched", "envsched": envsched_table}}
        )

    assert load({"half_life_groups": 64}).coordinator.envsched.half_life_groups == 64
    with pytest.raises(ConfigError, match=r"coordinator\.envsched\.half_life: unknown key"):
        load({"half_life": 64})
    with pytest.raises(ConfigError, match=r"max_open\.python_tool: no such environment"):
        load({"max_open": {"python_tool": 4}})
    with pytest.raises(ConfigError, match="one per step"):
        load({"ratio_at_grants": [0, 100], "ratio_weights": {"arithmetic": [1.0]}})
    with pytest.raises(ConfigError, match="strictly increasing"):
        load({"ratio_at_grants": [100, 100], "ratio_weights": {"arithmetic": [1.0, 2.0]}})
    with pytest.raises(ConfigError, match="every environment has weight 0"):
        load({"ratio_at_grants": [10], "ratio_weights": {"arithmetic": [0.0]}})
    with pytest.raises(ConfigError, match="every difficulty has weight 0"):
        load({"difficulty_weights": [0.0, 0.0]})
    with pytest.raises(ConfigError, match="difficulty_weights"):
        load({"difficulty_weights": [1.0, 1.0, 1.0, 1.0]})
    with pytest.raises(ConfigError, match="coordinator.scheduler"):
        config_from_dict({"coordinator": {"scheduler": "greedy"}})


def test_envsched_config_survives_the_resolved_config_file() -> None:
    config = config_from_dict(
        {
            "envs": [{"name": "arithmetic"}, {"name": "python_tool"}],
            "coordinator": {
                "scheduler": "envsched",
                "envsched": {
                    "max_open": {"python_tool": 4},
                    "ratio_at_grants": [0, 100],
                    "ratio_weights": {"python_tool": [1.0, 3.0]},
                    "difficulty_weights": [0.6, 0.4],
                },
            },
        }
    )
    assert config_from_dict(tomllib.loads(to_toml(config))) == config


# ── restart and status ────────────────────────────────────────────────────────────────────


def test_replaying_stored_reports_rebuilds_the_same_statistics(tmp_path: Path) -> None:
    envs = [EnvConfig(name="arithmetic", weight=3.0), EnvConfig(name="python_tool", weight=1.0)]
    params = EnvSchedConfig(half_life_groups=16)
    live = EnvSched(envs, params, group_size=4)
    store = Store(tmp_path / "coordinator.sqlite", lease_s=60.0)
    rng = random.Random(0)
    for round_ in range(12):
        grants = store.grant(
            "node-a", 4, float(round_), 4, lambda k, issued: live.choose(k, draw_rng(0, issued))
        )
        for g in grants:
            outcome = GroupReport(
                node_id="node-a",
                grant_id=g.grant_id,
                rewards=[float(rng.random() < 0.4) for _ in range(4)],
                failed=g.task.env == "python_tool" and round_ % 3 == 0,
                completion_tokens=rng.randint(10, 90),
            )
            accepted = store.complete(outcome, float(round_))
            assert isinstance(accepted, Accepted)
            live.observe(accepted.task, outcome)
    store.close()

    reopened = Store(tmp_path / "coordinator.sqlite", lease_s=60.0)
    restarted = EnvSched(envs, params, group_size=4)
    for t, r in reopened.accepted_reports():
        restarted.observe(t, r)
    reopened.close()
    a, b = live.statistics, restarted.statistics
    assert (a.tick, a.envs, a.cells, a.tasks) == (b.tick, b.envs, b.cells, b.tasks)
    assert live.frontiers == restarted.frontiers
    assert live.choose(16, draw_rng(0, 48)) == restarted.choose(16, draw_rng(0, 48))


def test_status_table_rows() -> None:
    stats = Statistics(EnvSchedConfig(), group_size=8)
    mixed, solved = task(op="+", id="d2:1+1"), task(op="*", id="d2:1*1")
    for _ in range(2):
        stats.observe(mixed, report([1.0, 0.0] * 4, tokens=10))
        stats.observe(solved, report([1.0] * 8, tokens=10))
    stats.observe(task(env="python_tool"), report([], failed=True))
    recent = [mixed, mixed, solved, task(env="python_tool")]
    rows = status_table(stats, recent, {"arithmetic": 3.0, "python_tool": 1.0})
    envs = {row.name: row for row in rows if row.level == "env"}
    assert envs["arithmetic"].visits == 4 and envs["arithmetic"].grant_share == 0.75
    assert envs["arithmetic"].target_share == 0.75 and envs["arithmetic"].failure_rate == 0.0
    assert envs["python_tool"].failure_rate == 1.0 and envs["python_tool"].mean_reward is None
    cells = {row.name: row for row in rows if row.level == "cell"}
    assert cells["arithmetic d2 +"].grant_share == 0.5 and cells["arithmetic d2 +"].visits == 2
    assert cells["arithmetic d2 +"].score > cells["arithmetic d2 *"].score  # type: ignore[operator]
    # Never reported with rewards, python_tool's cell borrows arithmetic's and is unexplored.
    assert max(rows, key=lambda row: row.score or 0.0).name == "python_tool d2 +"
    tasks = {row.name: row for row in rows if row.level == "task"}
    assert tasks["arithmetic d2:1+1"].visits == 2
    assert tasks["arithmetic d2:1+1"].mixed > tasks["arithmetic d2:1*1"].mixed  # type: ignore[operator]


def test_agentjet_status_renders_counters_and_aligned_rows() -> None:
    status = CoordinatorStatus(
        grants_issued=10, grants_completed=8, grants_expired=1, leases_open=2,
        nodes={"node-a": 1.25}, rejected_messages=0, scheduler="envsched", recent_grants=10,
        table=[
            SchedulerRow(level="env", name="arithmetic", visits=8, mean_reward=0.5,
                         variance=0.125, mixed=0.5, grant_share=1.0, target_share=1.0,
                         failure_rate=0.0),
            SchedulerRow(level="cell", name="arithmetic d2 +", visits=3, mean_reward=0.4,
                         variance=0.2, mixed=0.75, grant_share=0.3, score=0.8),
        ],
    )  # fmt: skip
    lines = format_status(status).splitlines()
    assert lines[0] == (
        "scheduler envsched: 10 grants issued, 8 completed, 1 expired, 2 leases open, "
        "0 queued for re-grant, 0 messages rejected, "
        "0 connections without the swarm's keys refused"
    )
    assert lines[1] == "nodes: node-a (1.2 s ago)"
    env_header, env_row = lines[3], lines[4]
    assert env_header.split() == [
        "environment", "(observed)", "visits", "reward", "variance", "P(mixed)", "target",
        "failed", "last", "10",
    ]  # fmt: skip
    assert env_row.split() == ["arithmetic", "8", "0.500", "0.125", "0.50", "1.00", "0.00", "100%"]
    assert len(env_header) == len(env_row)  # numbers right-aligned under their headers
    assert lines[7].split() == [
        "arithmetic",
        "d2",
        "+",
        "3",
        "0.400",
        "0.200",
        "0.75",
        "0.800",
        "30%",
    ]
    assert "top tasks" not in format_status(status)
