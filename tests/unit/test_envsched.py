"""EnvSched's pure decisions, checked against numbers worked out by hand.

Most examples use groups of 2 (2 samples, 2 ordered pairs per group) so the sums stay small:
one group [1, 1] gives samples 2, reward 2, pairs 2, pair products 2.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from collections import Counter
from pathlib import Path

import pytest

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
from agentjet_app.cli_status import format_status
from bench import sched_sim
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
    decay_factor,
    env_health,
    failing_and_mixed,
    failing_weight,
    group_sums,
    mixed_probability,
    nearest_half_weight,
    pick,
    prior_moments,
    relation_weight,
    shrink,
    steered_keep,
    updated,
    updated_beta,
    weighted_sample,
    weights_at,
    within_variance,
)
from coordinator.envsched_status import cell_mix, status_table
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


def test_failing_environments_lose_their_share_but_keep_probes() -> None:
    assert env_health(Sums(reports=4, failed=3), 2.0) == pytest.approx(1 - 3 / 6)
    assert env_health(Sums(), 2.0) == 1.0
    assert env_health(Sums(reports=1000, failed=1000), 2.0) == MIN_ENV_HEALTH


# ── a candidate's weight: the keep rate and the floor ─────────────────────────────────────


def test_candidate_weight_keeps_mixed_groups_skips_zero_variance_ones_and_floors() -> None:
    # keep = 1: every candidate weighs 1, whatever it predicts (uniform sampling).
    assert candidate_weight(0.0, 1.0, 0.1) == 1.0
    assert candidate_weight(0.3, 1.0, 0.1) == 1.0  # exactly: m + (1 − m) · 1
    # keep = 0.2: m + (1 − m) · 0.2 = 0.5 + 0.1
    assert candidate_weight(0.5, 0.2, 0.1) == pytest.approx(0.6)
    # Predicted zero-variance at keep 0.05 weighs 0.05: floored at 0.1.
    assert candidate_weight(0.0, 0.05, 0.1) == 0.1
    assert candidate_weight(1.0, 0.1, 0.1) == 1.0  # the most any candidate weighs


def test_keep_moves_by_the_steer_rate_toward_the_target_within_floor_and_one() -> None:
    params = EnvSchedConfig(floor=0.1, zero_variance_target=0.4, steer_rate=0.05)
    all_right, mixed = group_sums(report([1.0] * 8)), group_sums(report([1.0, 0.0] * 4))
    # A zero-variance group: log(keep) += 0.05 · (0.4 − 1); a mixed one: += 0.05 · 0.4.
    assert steered_keep(0.5, all_right, params) == pytest.approx(0.5 * math.exp(-0.03))
    assert steered_keep(0.5, mixed, params) == pytest.approx(0.5 * math.exp(0.02))
    assert steered_keep(1.0, mixed, params) == 1.0
    assert steered_keep(0.1, all_right, params) == 0.1
    # A failed report says nothing about zero variance.
    assert steered_keep(0.5, group_sums(report([], failed=True)), params) == 0.5


def feed(scheduler: EnvSched, pattern: list[list[float]], rounds: int) -> list[float]:
    """Report `pattern`'s groups `rounds` times (fresh 2-digit tasks); keep after each."""
    keeps = []
    for i in range(rounds):
        for j, rewards in enumerate(pattern):
            scheduler.observe(task(id=f"d2:{i}+{j}"), report(rewards))
            keeps.append(scheduler.statistics.keep_rate("arithmetic"))
    return keeps


def test_keep_falls_to_the_floor_above_the_target_and_stays_at_one_below() -> None:
    mixed, wrong = [1.0, 0.0] * 4, [0.0] * 8
    above = EnvSched([EnvConfig()], EnvSchedConfig(), group_size=8)
    # 3 of 4 groups zero-variance against a target of 0.4: −0.07 per round of 4 in log(keep).
    keeps = feed(above, [wrong, wrong, mixed, wrong], rounds=50)
    assert keeps[3] == pytest.approx(math.exp(0.05 * (4 * 0.4 - 3)))
    assert keeps[-1] == EnvSchedConfig().floor
    # 1 of 4: each zero-variance group dips keep by e^−0.03, the mixed ones bring it back
    # to 1, where it stays (a target, not a bound: nothing is skipped below it).
    below = EnvSched([EnvConfig()], EnvSchedConfig(), group_size=8)
    keeps = feed(below, [wrong, mixed, mixed, mixed], rounds=50)
    assert set(keeps[3::4]) == {1.0}
    assert min(keeps) == pytest.approx(math.exp(-0.03))


def test_below_the_target_envsched_samples_uniformly_from_its_pool() -> None:
    # 1-digit groups all right (predicted zero-variance), 2-digit mixed: a quarter of the
    # groups are zero-variance, under the target, so nothing is skipped. Without a frontier,
    # the pool is the same fresh draws whatever the history, and every candidate weighs 1.
    params = EnvSchedConfig(frontier_size=0)
    taught = EnvSched([EnvConfig(difficulties=[1, 2])], params, group_size=8)
    for i in range(40):
        taught.observe(task(difficulty=1, id=f"d1:{i % 10}+{i // 10}"), report([1.0] * 8))
        for j in range(3):
            taught.observe(task(id=f"d2:{i}+{j}"), report([1.0, 0.0] * 4))
    assert taught.statistics.keep_rate("arithmetic") == 1.0
    predicted = {
        d: mixed_probability(taught.statistics.task_beta(task(difficulty=d)), 8) for d in (1, 2)
    }
    assert predicted[1] < 0.05 and predicted[2] > 0.95
    pool = taught.candidates("arithmetic", 8, random.Random(0))
    assert {t.difficulty for t in pool} == {1, 2}
    assert {taught.weight(t) for t in pool} == {1.0}
    untaught = EnvSched([EnvConfig(difficulties=[1, 2])], params, group_size=8)
    for seed in range(20):
        assert taught.choose(8, random.Random(seed)) == untaught.choose(8, random.Random(seed))


def test_the_floor_holds_after_adversarial_history() -> None:
    # 3-digit groups all wrong, many times over (m ≈ 0), 2-digit mixed; zero-variance far
    # above the target, so keep sits at the floor. No frontier (at the floor all of it would
    # join the fresh draws): uniform sampling gives each difficulty half of the slots.
    params = EnvSchedConfig(frontier_size=0)
    scheduler = EnvSched([EnvConfig(difficulties=[2, 3])], params, group_size=8)
    for i in range(100):
        scheduler.observe(task(id=f"d2:{i}+1"), report([1.0, 0.0] * 4))
        for j in range(3):
            scheduler.observe(task(difficulty=3, id=f"d3:{i}*{j}"), report([0.0] * 8))
            scheduler.observe(task(difficulty=3, id="d3:999*999"), report([0.0] * 8))
    assert scheduler.statistics.keep_rate("arithmetic") == params.floor
    hopeless = task(difficulty=3, id="d3:999*999")
    assert mixed_probability(scheduler.statistics.task_beta(hopeless), 8) < 1e-4
    assert scheduler.weight(hopeless) == pytest.approx(params.floor, abs=1e-4)
    pool = scheduler.candidates("arithmetic", 8, random.Random(0))
    assert min(scheduler.weight(t) for t in pool) >= params.floor
    slots = 250 * 8
    chosen = Counter(
        t.difficulty for seed in range(250) for t in scheduler.choose(8, random.Random(seed))
    )
    # Each draw takes a 3-digit candidate with chance ≥ floor × its uniform chance (1/2):
    # ≥ 100 of 2000 slots expected, 250 here (0.1 against about 0.9 per candidate). A
    # binomial count that low would be 10 standard deviations off.
    assert chosen[3] >= params.floor * slots / 2
    assert chosen[2] > 0.8 * slots


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


def play(
    scheduler: EnvSched,
    rng: random.Random,
    batches: int,
    rewards: dict[int, list[float]],
    batches_before: int = 0,
) -> list[int]:
    """`batches` batches of 8 chosen and reported, each task's group getting its difficulty's
    `rewards`; the difficulties chosen, in order."""
    chosen = []
    for i in range(batches_before, batches_before + batches):
        for t in scheduler.choose(8, rng, grants_issued=8 * i):
            scheduler.observe(t, report(rewards[t.difficulty]))
            chosen.append(t.difficulty)
    return chosen


def test_envsched_skips_predicted_zero_variance_work_down_to_the_target() -> None:
    # 1-digit tasks always right, 3-digit always wrong, 2-digit right half the time: uniform
    # sampling gives 2/3 zero-variance groups. Skipping settles where the share is the
    # target, 0.4: 1-digit and 3-digit candidates weigh keep, 2-digit ones 1, so the share
    # is 2·keep / (1 + 2·keep) and keep = 1/3. (No frontier, so the steering does it all.)
    params = EnvSchedConfig(frontier_size=0)
    scheduler = EnvSched([EnvConfig()], params, group_size=8)
    rng = random.Random(1)
    chosen = play(scheduler, rng, 100, {1: [1.0] * 8, 2: [1.0, 0.0] * 4, 3: [0.0] * 8})
    late = Counter(chosen[-400:])
    assert (late[1] + late[3]) / 400 == pytest.approx(params.zero_variance_target, abs=0.05)
    assert scheduler.statistics.keep_rate("arithmetic") == pytest.approx(1 / 3, abs=0.1)
    assert min(late[1], late[3]) / 400 > params.floor / 3  # nothing starves
    uniform = Counter(t.difficulty for t in UniformScheduler([EnvConfig()]).choose(400))
    assert uniform[2] / 400 == pytest.approx(1 / 3, abs=0.08)


def test_nearest_half_moves_the_mix_to_the_cells_the_policy_half_solves() -> None:
    # 1-digit always right, 2-digit right half the time, 3-digit always wrong: "nearest_half"
    # weighs 2-digit candidates 1 and the others the floor, so about 1/(1 + 2·0.1) of the
    # picks are 2-digit once the cells are known; none starves; no frontier is offered.
    params = EnvSchedConfig(selection="nearest_half", floor=0.1)
    scheduler = EnvSched([EnvConfig()], params, group_size=8)
    rng = random.Random(2)
    chosen = play(scheduler, rng, 60, {1: [1.0] * 8, 2: [1.0, 0.0] * 4, 3: [0.0] * 8})
    late = Counter(chosen[-240:])
    assert late[2] / 240 == pytest.approx(1 / 1.2, abs=0.08)
    assert min(late[1], late[3]) > 0
    assert scheduler.frontiers["arithmetic"]  # mixed tasks are remembered...
    pool = scheduler.candidates("arithmetic", 8, random.Random(3))
    assert len(pool) <= params.pool_factor * 8  # ...but never offered: fresh draws only
    # The policy moves on: 2-digit solved, 3-digit half right; the mix follows.
    chosen += play(scheduler, rng, 120, {1: [1.0] * 8, 2: [1.0] * 8, 3: [1.0, 0.0] * 4}, 60)
    assert Counter(chosen[-240:])[3] / 240 > 0.7


def test_nearest_half_weight_peaks_at_a_half_and_never_falls_under_the_floor() -> None:
    assert nearest_half_weight(0.5, 0.1) == 1.0
    assert nearest_half_weight(0.25, 0.1) == pytest.approx(0.5)
    assert nearest_half_weight(0.75, 0.1) == pytest.approx(0.5)
    assert nearest_half_weight(0.0, 0.1) == nearest_half_weight(1.0, 0.1) == 0.1


def test_failing_moves_the_mix_to_what_the_policy_gets_wrong_and_can_learn() -> None:
    # 1-digit always right, 2-digit right half the time, 3-digit always wrong: "failing"
    # weighs 2-digit candidates about 0.5 and the solved and hopeless ones the floor, so
    # most picks are 2-digit once the cells are known; none starves; no frontier is offered.
    params = EnvSchedConfig(selection="failing", floor=0.1)
    scheduler = EnvSched([EnvConfig()], params, group_size=8)
    rng = random.Random(2)
    chosen = play(scheduler, rng, 60, {1: [1.0] * 8, 2: [1.0, 0.0] * 4, 3: [0.0] * 8})
    late = Counter(chosen[-240:])
    assert late[2] / 240 > 0.6
    assert min(late[1], late[3]) > 0
    pool = scheduler.candidates("arithmetic", 8, random.Random(3))
    assert len(pool) <= params.pool_factor * 8  # fresh draws only
    # The policy moves on: 2-digit solved, 3-digit right now and then; the mix follows.
    chosen += play(scheduler, rng, 120, {1: [1.0] * 8, 2: [1.0] * 8, 3: [1.0] + [0.0] * 7}, 60)
    assert Counter(chosen[-240:])[3] / 240 > 0.6


def test_failing_weight_is_a_wrong_sample_in_a_mixed_group() -> None:
    # Against a point mass (a huge Beta), E[(1 - p) 1{mixed}] = (1 - p)(1 - p^n - (1 - p)^n).
    for p in (0.0, 0.15, 0.5, 0.9, 1.0):
        beta = Beta(p * 1e7 + 1e-9, (1 - p) * 1e7 + 1e-9)
        expected = (1 - p) * (1 - p**8 - (1 - p) ** 8)
        assert failing_and_mixed(beta, 8) == pytest.approx(expected, abs=1e-5)
    # Against the uniform prior Beta(1, 1), the integral of (1 - p)(1 - p^8 - (1 - p)^8):
    # 1/2 - 1/90 - 1/10.
    assert failing_and_mixed(Beta(1.0, 1.0), 8) == pytest.approx(0.5 - 1 / 90 - 1 / 10)
    # Solved and hopeless tasks weigh the floor; one right now and then weighs most.
    solved, hopeless, rare = Beta(1e6, 1e-3), Beta(1e-3, 1e6), Beta(15.0, 85.0)
    assert failing_weight(solved, 8, 0.1) == failing_weight(hopeless, 8, 0.1) == 0.1
    assert failing_weight(rare, 8, 0.1) > failing_weight(Beta(60.0, 40.0), 8, 0.1) > 0.1


def test_envsched_offers_tasks_whose_last_group_was_mixed_again() -> None:
    scheduler = EnvSched([EnvConfig(difficulties=[3])], EnvSchedConfig(), group_size=8)
    for op in "+-*":  # fresh 3-digit tasks are hopeless (and skipped, keep at the floor)...
        for i in range(40):
            scheduler.observe(task(op=op, difficulty=3, id=f"d3:{i}{op}0"), report([0.0] * 8))
    known = task(op="*", difficulty=3, id="d3:123*456")  # ...but this one is within reach
    scheduler.observe(known, report([1.0, 0.0] * 4))
    assert known.id in scheduler.frontiers["arithmetic"]
    assert scheduler.statistics.keep_rate("arithmetic") < 0.11
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
    with pytest.raises(ConfigError, match=r"coordinator\.envsched\.floor: expected `float` > 0"):
        load({"floor": 0.0})
    with pytest.raises(ConfigError, match=r"coordinator\.envsched\.floor: expected `float` <= 1"):
        load({"floor": 1.5})
    with pytest.raises(ConfigError, match=r"zero_variance_target: expected `float` < 1"):
        load({"zero_variance_target": 1.0})
    with pytest.raises(ConfigError, match=r"zero_variance_target: expected `float` >= 0"):
        load({"zero_variance_target": -0.1})
    with pytest.raises(ConfigError, match=r"steer_rate: expected `float` > 0"):
        load({"steer_rate": 0.0})
    with pytest.raises(ConfigError, match=r"coordinator\.envsched\.epsilon: unknown key"):
        load({"epsilon": 0.01})  # replaced by the floor
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
                    "floor": 0.2,
                    "zero_variance_target": 0.3,
                    "steer_rate": 0.1,
                },
            },
        }
    )
    assert config_from_dict(tomllib.loads(to_toml(config))) == config


def test_envsched_tracks_the_zero_variance_target_under_a_drifting_policy() -> None:
    # bench/sched_sim.py's world: success rates that drift up everywhere and rise where
    # groups were mixed. Arithmetic's uniform share (about 0.7) is above the target, which
    # skipping reaches; python_tool's frontier alone takes it below, where keep stays high.
    params = EnvSchedConfig()
    target = params.zero_variance_target
    envsched_run = sched_sim.simulate("envsched", 1200, seed=0, params=params)
    uniform_run = sched_sim.simulate("uniform", 1200, seed=0)

    def second_half(played: sched_sim.Played, env: str) -> float:
        return sched_sim.zero_variance_share([r for r in played.reports[600:] if r[0].env == env])

    assert second_half(uniform_run, "arithmetic") > target + 0.2
    assert second_half(envsched_run, "arithmetic") == pytest.approx(target, abs=0.1)
    assert second_half(envsched_run, "python_tool") < target + 0.1
    assert envsched_run.keep["arithmetic"] < 0.5 < envsched_run.keep["python_tool"]
    assert all(params.floor <= keep <= 1.0 for keep in envsched_run.keep.values())
    # The floor: every difficulty keeps at least about floor × its uniform share (a third).
    for env, levels in cell_mix(envsched_run.reports).items():
        for d in ("1", "2", "3"):
            assert levels[d]["share"] > params.floor / 3, (env, d)


def test_cell_mix_counts_groups_and_mixed_groups_by_env_and_difficulty() -> None:
    mixed, right, wrong = [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]
    reports = [
        (task(difficulty=1), report(right)),
        (task(difficulty=1), report(mixed)),
        (task(difficulty=2), report(mixed)),
        (task(difficulty=2), report(mixed)),
        (task(difficulty=3), report(wrong)),
        (task(difficulty=3), report(wrong, failed=True)),  # trains nothing: left out
        (task(env="python_tool", difficulty=2), report(mixed)),
        (task(env="python_tool", difficulty=2), report(right)),
        (task(env="python_tool", difficulty=2), report(right)),
        (task(env="python_tool", difficulty=2), report(right)),
    ]
    assert cell_mix(reports) == {
        "arithmetic": {
            "1": {"groups": 2, "mixed": 1, "share": 0.4, "mixed_share": 1 / 3, "mixed_rate": 0.5},
            "2": {"groups": 2, "mixed": 2, "share": 0.4, "mixed_share": 2 / 3, "mixed_rate": 1.0},
            "3": {"groups": 1, "mixed": 0, "share": 0.2, "mixed_share": 0.0, "mixed_rate": 0.0},
            "all": {"groups": 5, "mixed": 3, "share": 5 / 9, "mixed_share": 0.75,
                    "mixed_rate": 0.6},
        },
        "python_tool": {
            "2": {"groups": 4, "mixed": 1, "share": 1.0, "mixed_share": 1.0, "mixed_rate": 0.25},
            "all": {"groups": 4, "mixed": 1, "share": 4 / 9, "mixed_share": 0.25,
                    "mixed_rate": 0.25},
        },
    }  # fmt: skip
    assert json.loads(json.dumps(cell_mix(reports))) == cell_mix(reports)
    assert cell_mix([]) == {}


def test_observing_the_same_reports_twice_gives_the_same_keep_and_choices() -> None:
    params = EnvSchedConfig(zero_variance_target=0.2)
    envs = [EnvConfig(name="arithmetic", weight=3.0), EnvConfig(name="python_tool", weight=1.0)]
    rng = random.Random(5)
    reports = [
        (
            task(env=rng.choice(["arithmetic", "python_tool"]), id=f"d2:{i}+{i}"),
            report([float(rng.random() < 0.8) for _ in range(8)], tokens=rng.randint(5, 50)),
        )
        for i in range(300)
    ]
    first, second = (EnvSched(envs, params, group_size=8) for _ in range(2))
    for scheduler in (first, second):
        for t, r in reports:
            scheduler.observe(t, r)
    assert first.statistics.keep == second.statistics.keep
    assert first.statistics.keep["arithmetic"] < 1.0
    for seed in range(5):
        assert first.choose(16, random.Random(seed)) == second.choose(16, random.Random(seed))


# ── restart and status ────────────────────────────────────────────────────────────────────


def test_replaying_stored_reports_rebuilds_the_same_statistics(tmp_path: Path) -> None:
    envs = [EnvConfig(name="arithmetic", weight=3.0), EnvConfig(name="python_tool", weight=1.0)]
    # A low target, so that keep moves (a quarter of these groups are zero-variance).
    params = EnvSchedConfig(half_life_groups=16, zero_variance_target=0.1)
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
    assert a.keep == b.keep and min(a.keep.values()) < 1.0  # bit for bit, and it moved
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
    # Half of arithmetic's groups agreed, above the 0.4 target: its keep rate fell from 1.
    assert envs["arithmetic"].keep == stats.keep_rate("arithmetic") < 1.0
    assert envs["python_tool"].keep == 1.0  # a failed report moves nothing
    cells = {row.name: row for row in rows if row.level == "cell"}
    assert cells["arithmetic d2 +"].grant_share == 0.5 and cells["arithmetic d2 +"].visits == 2
    assert cells["arithmetic d2 +"].score > cells["arithmetic d2 *"].score  # type: ignore[operator]
    # Never reported with rewards, python_tool skips nothing yet (keep 1): its cell weighs 1.
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
                         failure_rate=0.0, keep=0.25),
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
        "failed", "keep", "last", "10",
    ]  # fmt: skip
    assert env_row.split() == [
        "arithmetic", "8", "0.500", "0.125", "0.50", "1.00", "0.00", "0.25", "100%",
    ]  # fmt: skip
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


def test_the_frontier_joins_the_pool_as_keep_falls_none_at_one_all_at_the_floor() -> None:
    from coordinator.envsched import frontier_share

    assert frontier_share(1.0, 0.1) == 0.0 and frontier_share(0.1, 0.1) == 1.0
    assert frontier_share(0.55, 0.1) == pytest.approx(0.5)
    scheduler = EnvSched([EnvConfig(difficulties=[3])], EnvSchedConfig(), group_size=8)
    known = task(op="*", difficulty=3, id="d3:123*456")
    scheduler.observe(known, report([1.0, 0.0] * 4))  # mixed: below the target, keep = 1
    assert scheduler.statistics.keep_rate("arithmetic") == 1.0
    pools = [scheduler.candidates("arithmetic", 8, random.Random(i)) for i in range(20)]
    assert all(known.id not in {t.id for t in pool} for pool in pools)  # uniform sampling
