"""EnvSched: grant (environment, task) work where GRPO learns, groups whose rewards differ,
by skipping predicted zero-variance work down to a target share, never below a floor (or,
with selection "nearest_half", by predicted success nearest 0.5, or "failing", by predicted
failure).

    GroupReport ──▶ Statistics.observe ──▶ decayed sums per node of the graph:
                      env ⊃ cell (env, op, difficulty) ⊃ task (cell, id)
                      cell ~ neighbours: same op and difficulty in another env (family),
                                         same difficulty with another op (difficulty)
                ──▶ Statistics.keep: per env, log(keep) += steer_rate × (target − zv)
                ──▶ EnvSched.frontiers: per env, the tasks whose last group was mixed
    choose(k) ──▶ envs: apportion(k, ratio target × health, capacity room)
              ──▶ per env: pool_factor × its count fresh draws + the newest
                  frontier_share(keep) of its frontier (the pool)
              ──▶ weight = max(floor, m + (1 − m) · keep), m = predicted P(mixed group)
              ──▶ sample its count without replacement ∝ weight

The model. A task's success rate p is drawn from its cell's distribution, Beta(a, b); a group
of n samples of that task is mixed (gives GRPO any signal) with probability
1 − E[p^n] − E[(1−p)^n], the Beta-binomial chance that not all n agree. A cell's (a, b) come
from two moments estimated from the reports: the mean reward (over samples) and E[p²] (over
ordered pairs of samples of one group: E[r_i r_j] = E[p²] for i ≠ j). The second moment is
what a per-sample Beta misses: a cell whose tasks are each always right or always wrong has
mean 0.5 but never a mixed group. (SmolLM2-135M's accuracies, 74% / 11% / 1.5% by digits,
would give 46% zero-variance groups if all tasks of a digit count were alike; uniform runs
measured 64%.) A task that was seen is its cell's Beta updated with its own rewards, so
repeated tasks (1-digit problems, task files) are scored by what they did.

Borrowing strength. Generated 2- and 3-digit tasks never repeat, so evidence lives in cells,
and a cell's moments are shrunk toward a parent pooled from its graph neighbours (weighted by
relation) and, below those, the prior Beta: rarely seen cells and new environments start
from what similar cells show. Only strangers (tasks chosen for what their cell promised,
not for their own record) are evidence about a cell, or cells would look as good as the
tasks picked from them. Rewards are read as success probabilities in [0, 1] (binary
verifiers; partial credit is a fractional success, and the same sums give the running mean
and variance).

The frontier. Without per-task features, nothing tells two fresh 2-digit tasks apart; a
task whose last group was mixed is within the policy's reach, so it may be offered again
beside the fresh candidates until a group of it comes back all-equal (learned, or out of
reach). It is weighed like any candidate, but being in the pool is its advantage: a full
frontier (up to `frontier_size` tasks) outnumbers an environment's fresh draws. So how much
of it joins the pool follows the same keep rate: none at keep = 1 (uniform sampling), all at
keep = floor (`frontier_share`). In the simulation (bench/sched_sim.py) the frontier is most
of EnvSched's gain: without it the zero-variance target is out of reach even at the floor.
On the real model, repeating tasks in reach taught the problems not seen less than distinct
tasks do (below): the target decides how far EnvSched goes down that road.

Allocation: skip, do not chase. An environment's pool is its frontier and `pool_factor` ×
its count fresh draws from its task sources, so the pool follows the task distribution;
EnvSched only decides which candidates to skip. A candidate predicted mixed with probability
m weighs m + (1 − m) · keep: a group predicted to teach is always wanted, one predicted
zero-variance with chance `keep` (GRESO's skipping of predicted zero-variance prompts, as a
sampling weight). At keep = 1 every candidate weighs 1: uniform sampling. Expected tokens
are not weighed in: dividing by them favoured cheap 1-digit problems even at keep = 1.

The target. Each environment's keep starts at 1 and is steered so that its share of
zero-variance groups tracks `zero_variance_target`: every report with rewards moves
log(keep) by steer_rate × (target − zv), zv = 1 when the group's rewards all agree, and keep
stays in [floor, 1]. It is a target, not a bound to beat: where uniform sampling already
gives fewer zero-variance groups, keep stays at 1 and EnvSched samples like uniform; where
even keep = floor gives more, keep rests at the floor. Zero-variance groups are not all
waste: in a trainer-bound run they cost nothing, and they are how uniform sampling finds the
mixed groups of hard problems (bench/LOG.md).

Nearest half (`selection = "nearest_half"`). Instead of skipping toward a zero-variance
target, a candidate weighs by how near its predicted success rate (its Beta's mean) is to
0.5: 1 − |2p − 1|, never under the floor (PCL's choice from a uniformly drawn pool; the
learning signal of a binary reward peaks at p = 0.5). No frontier is offered and keep is
not used. The trained mix then moves with the policy, toward the cells whose sampled
success is near 0.5, while solved and out-of-reach cells keep the floor's share; it gives
up keeping the mix near the task distribution. Measured on arithmetic (bench/LOG.md,
2026-12-07) it lost 4 held-out points in 5 minutes: at temperature 1 the cells near 0.5
stayed the 1-digit ones, which greedy decoding (what held-out accuracy scores) already
solves, and the 2- and 3-digit work held-out accuracy grows on got less.

Failing (`selection = "failing"`). A candidate weighs by the chance that a sample of it is
wrong and its group teaches, E[(1 − p) · 1{mixed}] under its Beta (`failing_and_mixed`),
never under the floor; no frontier, no keep. Held-out accuracy grows where the policy still
fails, but only a mixed group teaches: the weight peaks on tasks solved now and then (for
groups of 8, at p ≈ 0.15), and solved cells and cells out of reach (3-digit products,
always wrong) both fall to the floor. Against "nearest_half", which weighs p = 0.4 and
p = 0.6 alike, it prefers the task the policy gets wrong. Measured on arithmetic (bench/LOG.md,
2026-12-07 third) it lost too, 7 points at 5 minutes: early, the tasks wrong but sometimes
right at temperature 1 were mostly 1-digit ones again.

The floor: what is guaranteed. No candidate weighs less than `floor`, and none more than 1.
So after any history, each draw without replacement takes a given candidate still in the
pool with probability at least floor / N_left, N_left the candidates left: floor times its
chance under uniform sampling over the pool. Over a batch of c from a pool of N ≥ 8c
(pool_factor 8), a candidate is taken with probability at least 1 − (1 − floor/N)^c ≥
15/16 × floor × c/N, uniform's chance being c/N. Fresh draws ignore the history, so a task
becomes a candidate as often as under uniform sampling (a frontier's tasks are extra
candidates, which enlarge N). The same bound holds for a cell: its share of an
environment's grants is at least about floor times its share under uniform sampling, which
bounds how far the trained mix can move from uniform's.

Why, measured (bench/LOG.md, 2026-11-30 and 2026-12-01). Sampling candidates ∝ P(mixed) /
cost plus a coverage bonus cut zero-variance groups to 0.42× uniform's, but sent the work
to 1-digit arithmetic, which greedy decoding already solves (186 / 34 / 17 groups by digits
against uniform's 101 / 104 / 94), and trained a worse policy: held-out −3.0 ± 0.6 points.
A difficulty quota within each environment ([0.65, 0.33, 0.02] of each batch) lost the
zero-variance target (0.55×) and did not win held-out accuracy back: the trainer takes a
fixed number of mixed groups, and a share of grants is not a number of mixed 2-digit
groups. Weighting frontier tasks 50× on top met the target (0.48×) and lost 3.0 points:
repeating a few tasks teaches the problems not seen less than distinct tasks do.

Ageing. The policy changes, so every sum halves after `half_life_groups` further reports.
Time is counted in reports, not seconds, and keep moves once per report, so replaying the
stored reports in order rebuilds the same statistics, keep rates and frontiers bit for bit
after a restart.

Failures. Across environments each ratio target is scaled by the environment's health
(1 − shrunk rate of failed reports, floored so a broken environment is still probed and its
repair noticed); a failed report does not move keep. Lease expiries are not held against an
environment: a node that dies expires its leases whatever they were.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from agentjet.config import EnvConfig, EnvSchedConfig, RolloutConfig
from agentjet.protocol import GroupReport, Task
from agentjet.tasks import TaskSource

# Rewards are clipped into this range before they enter the statistics (success probabilities).
REWARD_MIN, REWARD_MAX = 0.0, 1.0
# Success rates are kept this far inside (0, 1) so Beta parameters stay finite and positive.
MIN_SUCCESS_RATE = 1e-9
# The share of reward variance between tasks is kept inside (this, 1 − this): a Beta needs it.
MIN_TASK_CORRELATION = 1e-6
# A task whose own evidence weighs less than this many groups is a stranger: its group is
# evidence about its cell (see Statistics.observe).
STRANGER_GROUPS = 0.5
# Statistics are kept for at most this many tasks; the least recently reported are dropped.
# At the default half-life their evidence has decayed to nothing long before.
MAX_TASK_NODES = 50_000
# A failing environment keeps this share of its ratio target as probes, so a repair is seen.
MIN_ENV_HEALTH = 0.05


# ── sums: decayed sufficient statistics of one node ──────────────────────────────────────


class Sums(NamedTuple):
    """What the reports of one node add up to (each term decayed with its age)."""

    reports: float = 0.0  # groups reported, failed or not
    failed: float = 0.0  # groups the node reported as failed (no rewards learned from them)
    tokens: float = 0.0  # completion tokens of those groups
    groups: float = 0.0  # groups with rewards
    mixed: float = 0.0  # groups whose rewards were not all equal
    samples: float = 0.0  # rewards
    reward: float = 0.0  # Σ r
    reward_sq: float = 0.0  # Σ r²
    pairs: float = 0.0  # ordered pairs of samples of one group: Σ n(n − 1)
    pair_products: float = 0.0  # Σ over those pairs of r_i r_j


def group_sums(report: GroupReport) -> Sums:
    """One report as sums. A failed group counts as a failure only: its rewards are the fault's."""
    if report.failed:
        return Sums(reports=1.0, failed=1.0, tokens=float(report.completion_tokens))
    rewards = [min(max(r, REWARD_MIN), REWARD_MAX) for r in report.rewards]
    n, total, total_sq = len(rewards), sum(rewards), sum(r * r for r in rewards)
    return Sums(
        reports=1.0,
        tokens=float(report.completion_tokens),
        groups=1.0 if n else 0.0,
        mixed=1.0 if n and max(rewards) != min(rewards) else 0.0,
        samples=float(n),
        reward=total,
        reward_sq=total_sq,
        pairs=float(n * (n - 1)),
        pair_products=total * total - total_sq,  # Σ_{i≠j} r_i r_j
    )


def scaled(sums: Sums, factor: float) -> Sums:
    return Sums(*(x * factor for x in sums))


def added(a: Sums, b: Sums, weight: float = 1.0) -> Sums:
    """a + weight · b, term by term."""
    return Sums(*(x + weight * y for x, y in zip(a, b, strict=True)))


def decay_factor(elapsed_reports: float, half_life_reports: float) -> float:
    """How much evidence that is `elapsed_reports` old still counts: it halves every half-life."""
    return 0.5 ** (elapsed_reports / half_life_reports)


class Node(NamedTuple):
    """A node of the graph: its sums as of report number `tick`, and its undecayed visits."""

    sums: Sums
    tick: int
    visits: int
    lent: Sums = Sums()  # tasks: the part of `sums` that is also their cell's evidence


def updated(
    node: Node | None,
    group: Sums,
    tick: int,
    half_life: float,
    *,
    evidence: bool = True,
    lent: bool = False,
) -> Node:
    """`node` aged to `tick` and visited once more; `group` joins its sums when `evidence`,
    and its lent part when `lent`."""
    node = node or Node(Sums(), tick, 0)
    factor = decay_factor(tick - node.tick, half_life)
    sums, lent_sums = scaled(node.sums, factor), scaled(node.lent, factor)
    return Node(
        added(sums, group) if evidence else sums,
        tick,
        node.visits + 1,
        added(lent_sums, group) if lent else lent_sums,
    )


# ── the Beta model ────────────────────────────────────────────────────────────────────────


class Moments(NamedTuple):
    """First and second moment of the success rate p of a task drawn from a node."""

    mean: float  # E[p]
    mean_sq: float  # E[p²]


class Beta(NamedTuple):
    alpha: float
    beta: float


def prior_moments(alpha: float, beta: float) -> Moments:
    """The moments of Beta(alpha, beta): where every node starts."""
    total = alpha + beta
    return Moments(alpha / total, alpha * (alpha + 1) / (total * (total + 1)))


def shrink(sums: Sums, prior: Moments, prior_groups: float, group_size: int) -> Moments:
    """A node's moments: its own evidence plus `prior_groups` groups' worth of `prior`.

    The mean is estimated from samples, E[p²] from within-group pairs, so each is weighted by
    its own count; a group of the configured size brings n samples and n(n − 1) pairs.
    """
    prior_samples = prior_groups * group_size
    prior_pairs = prior_groups * group_size * (group_size - 1)
    return Moments(
        (sums.reward + prior_samples * prior.mean) / (sums.samples + prior_samples),
        (sums.pair_products + prior_pairs * prior.mean_sq) / (sums.pairs + prior_pairs),
    )


def beta_from_moments(moments: Moments) -> Beta:
    """The Beta with these moments (method of moments), kept proper.

    ρ = Var(p) / (E[p](1 − E[p])) is the share of reward variance that lies between tasks
    (the intra-class correlation); the Beta's concentration a + b is 1/ρ − 1.
    """
    mean = min(max(moments.mean, MIN_SUCCESS_RATE), 1 - MIN_SUCCESS_RATE)
    correlation = (moments.mean_sq - mean * mean) / (mean * (1 - mean))
    correlation = min(max(correlation, MIN_TASK_CORRELATION), 1 - MIN_TASK_CORRELATION)
    concentration = 1 / correlation - 1
    return Beta(mean * concentration, (1 - mean) * concentration)


def updated_beta(prior: Beta, sums: Sums) -> Beta:
    """The Beta posterior of one task after its own (fractional) successes and failures."""
    return Beta(prior.alpha + sums.reward, prior.beta + sums.samples - sums.reward)


def failing_and_mixed(beta: Beta, group_size: int) -> float:
    """E[(1 − p) · 1{a group of `group_size` samples is mixed}], p ~ Beta: the chance that a
    sample is wrong and its group teaches. With E[p^n (1 − p)] = E[p^n] · b / (a + b + n) and
    E[(1 − p)^(n+1)] = E[(1 − p)^n] · (b + n) / (a + b + n), it is E[1 − p] less both."""
    a, b, n = beta.alpha, beta.beta, group_size
    all_right, all_wrong = _all_agree(beta, n)
    return max(0.0, b / (a + b) - all_right * b / (a + b + n) - all_wrong * (b + n) / (a + b + n))


def failing_weight(beta: Beta, group_size: int, floor: float) -> float:
    """The sampling weight of a candidate under "failing": `failing_and_mixed`, never under
    `floor`."""
    return max(floor, failing_and_mixed(beta, group_size))


def mixed_probability(beta: Beta, group_size: int) -> float:
    """P(a group of `group_size` samples is mixed) = 1 − E[p^n] − E[(1−p)^n], p ~ Beta.

    E[p^n] = Π_{i<n} (a + i) / (a + b + i); with a point mass at p this is 1 − p^n − (1−p)^n.
    """
    all_right, all_wrong = _all_agree(beta, group_size)
    return max(0.0, 1.0 - all_right - all_wrong)


def _all_agree(beta: Beta, group_size: int) -> tuple[float, float]:
    """(E[p^n], E[(1−p)^n]), p ~ Beta: the chances that a group of n is all right, all wrong."""
    all_right = all_wrong = 1.0
    total = beta.alpha + beta.beta
    for i in range(group_size):
        all_right *= (beta.alpha + i) / (total + i)
        all_wrong *= (beta.beta + i) / (total + i)
    return all_right, all_wrong


def within_variance(beta: Beta) -> float:
    """E[p(1 − p)]: the reward variance expected inside one group (what GRPO normalises)."""
    total = beta.alpha + beta.beta
    return beta.alpha * beta.beta / (total * (total + 1))


# ── the graph ─────────────────────────────────────────────────────────────────────────────


class Cell(NamedTuple):
    """Tasks of one environment that declare the same features."""

    env: str
    op: str  # "" when not declared
    difficulty: int  # 0 when not declared


def cell_of(task: Task) -> Cell:
    return Cell(task.env, task.op, task.difficulty)


def relation_weight(
    cell: Cell, other: Cell, family_weight: float, difficulty_weight: float
) -> float:
    """How much `other`'s evidence counts toward `cell`'s parent.

    Family: the same declared op and difficulty in another environment. Difficulty: the same
    declared difficulty with another op, in any environment. Undeclared features relate
    nothing, so featureless task files learn only from their own tasks.
    """
    if other == cell:
        return 0.0
    declared = bool(cell.op or cell.difficulty)
    if declared and (other.op, other.difficulty) == (cell.op, cell.difficulty):
        return family_weight
    if cell.difficulty and other.difficulty == cell.difficulty and other.op != cell.op:
        return difficulty_weight
    return 0.0


def env_health(env: Sums, prior_groups: float) -> float:
    """1 − the environment's rate of failed reports (shrunk toward none), floored."""
    return max(MIN_ENV_HEALTH, 1.0 - env.failed / (env.reports + prior_groups))


# ── a candidate's weight: the keep rate and the floor ─────────────────────────────────────


def candidate_weight(mixed: float, keep: float, floor: float) -> float:
    """The sampling weight of a candidate predicted mixed with probability `mixed`: a mixed
    group is always wanted, a zero-variance one with chance `keep`, and never less than
    `floor` (uniform sampling weighs every candidate 1)."""
    # m + (1 − m) · keep, written to be exactly 1 at keep = 1 (exactly uniform).
    return max(floor, keep + (1.0 - keep) * mixed)


def nearest_half_weight(success: float, floor: float) -> float:
    """The sampling weight of a candidate whose predicted success rate is `success`, under
    "nearest_half": 1 at 0.5, falling to `floor` toward 0 and 1."""
    return max(floor, 1.0 - abs(2.0 * success - 1.0))


def frontier_share(keep: float, floor: float) -> float:
    """How much of an environment's frontier joins its pool: none at keep = 1 (the pool is
    fresh draws, uniform sampling), all of it at keep = floor; the one controller that skips
    predicted zero-variance work also turns to tasks in reach."""
    if floor >= 1.0:
        return 0.0
    return min(max((1.0 - keep) / (1.0 - floor), 0.0), 1.0)


def steered_keep(keep: float, group: Sums, params: EnvSchedConfig) -> float:
    """An environment's keep rate after one report of it: log(keep) moves by steer_rate ×
    (zero_variance_target − zv), zv = 1 when the group's rewards all agree, within
    [floor, 1]. At equilibrium the environment's share of zero-variance groups is the target;
    a report without rewards (failed) leaves keep where it is."""
    if not group.groups:
        return keep
    zero_variance = 1.0 - group.mixed
    log_keep = math.log(keep) + params.steer_rate * (params.zero_variance_target - zero_variance)
    return min(1.0, max(params.floor, math.exp(log_keep)))


# ── allocation ────────────────────────────────────────────────────────────────────────────


def weights_at(
    base: Mapping[str, float],
    at_grants: Sequence[int],
    schedule: Mapping[str, Sequence[float]],
    grants_issued: int,
) -> dict[str, float]:
    """The ratio targets in force after `grants_issued` grants: the newest schedule step that
    has begun overrides the environments it names; the others keep their configured weight."""
    step = bisect.bisect_right(at_grants, grants_issued) - 1
    if step < 0:
        return dict(base)
    return {env: schedule[env][step] if env in schedule else w for env, w in base.items()}


def apportion(
    k: int, weights: Mapping[str, float], room: Mapping[str, int], rng: random.Random
) -> dict[str, int]:
    """Split `k` slots among environments in proportion to `weights`, within capacity.

    Systematic sampling: each environment gets the floor or the ceiling of its quota, the
    expectation exactly, so ratios hold in every batch and a batch of one still reaches every
    environment over time. An environment absent from `room` has no limit; one that hits its
    room gives the slots it cannot take to the others. Fewer than `k` are handed out only
    when every environment is full.
    """
    counts = dict.fromkeys(weights, 0)
    remaining = k
    while remaining > 0:
        open_envs = sorted(
            env for env, w in weights.items() if w > 0 and counts[env] < room.get(env, k + 1)
        )
        if not open_envs:
            break
        total = sum(weights[env] for env in open_envs)
        offset = rng.random()
        start = 0.0
        for i, env in enumerate(open_envs):
            end = remaining if i == len(open_envs) - 1 else start + remaining * weights[env] / total
            counts[env] += math.floor(end + offset) - math.floor(start + offset)
            start = end
        remaining = 0
        for env, limit in room.items():
            if env in counts and counts[env] > limit:
                remaining += counts[env] - limit
                counts[env] = limit
    return counts


def weighted_sample(weights: Sequence[float], k: int, rng: random.Random) -> list[int]:
    """`k` distinct indices drawn without replacement with probability ∝ weight (all > 0).

    Efraimidis–Spirakis: the k largest keys log(u)/w, u ~ U(0, 1].
    """
    keys = [math.log(1.0 - rng.random()) / w for w in weights]
    return sorted(range(len(weights)), key=lambda i: keys[i], reverse=True)[:k]


def pick(weights: Sequence[float], k: int, rng: random.Random) -> list[int]:
    """`k` indices ∝ weight, distinct while there are enough (a small task file repeats)."""
    chosen: list[int] = []
    while len(chosen) < k and weights:
        chosen += weighted_sample(weights, min(k - len(chosen), len(weights)), rng)
    return chosen


class EnvSource(NamedTuple):
    """One `envs` entry as EnvSched draws from it."""

    source: TaskSource
    weight: float

    @classmethod
    def of(cls, env: EnvConfig) -> EnvSource:
        return cls(TaskSource.from_config(env), env.weight)

    def can_draw(self, task: Task) -> bool:
        """Whether this entry could draw `task` (a task of an older config is not offered)."""
        return self.source.covers(task)


# ── the statistics ────────────────────────────────────────────────────────────────────────


class CellView(NamedTuple):
    """A cell's statistics as the weights need them, computed once per batch."""

    sums: Sums
    parent: Moments  # pooled from the graph neighbours and the prior
    beta: Beta  # the cell's distribution of task success rates


class Statistics:
    """Online, decaying reward statistics over the (env, task) graph, fed one report at a time.

    Both schedulers keep one: uniform only measures (so the baseline's table can be compared,
    its keep rates saying how far it is from the zero-variance target), EnvSched chooses by it.
    """

    def __init__(self, params: EnvSchedConfig, group_size: int) -> None:
        self.params = params
        self.group_size = group_size
        self.tick = 0  # reports observed so far: the clock of decay (a new group is at age 0)
        self.envs: dict[str, Node] = {}
        self.cells: dict[Cell, Node] = {}
        self.tasks: OrderedDict[tuple[Cell, str], Node] = OrderedDict()  # (cell, task id)
        self._views: dict[Cell, CellView] = {}
        self.root = prior_moments(params.prior_alpha, params.prior_beta)
        # Per env: the keep rate of candidates predicted zero-variance (see steered_keep).
        self.keep: dict[str, float] = {}

    def observe(self, task: Task, report: GroupReport) -> None:
        """Add one report. Its group is evidence about the cell only if the task was a stranger
        (chosen for what its cell promised): a task chosen for its own record is no random
        draw from the cell, and counting it would make cells look as good as their best."""
        self.tick += 1
        group, tick, half_life = group_sums(report), self.tick, self.params.half_life_groups
        self.envs[task.env] = updated(self.envs.get(task.env), group, tick, half_life)
        self.keep[task.env] = steered_keep(self.keep_rate(task.env), group, self.params)
        cell, key = cell_of(task), (cell_of(task), task.id)
        stranger = self.now(self.tasks.get(key)).groups < STRANGER_GROUPS
        self.cells[cell] = updated(self.cells.get(cell), group, tick, half_life, evidence=stranger)
        self.tasks[key] = updated(self.tasks.get(key), group, tick, half_life, lent=stranger)
        self.tasks.move_to_end(key)
        if len(self.tasks) > MAX_TASK_NODES:
            self.tasks.popitem(last=False)
        self._views.clear()

    def now(self, node: Node | None) -> Sums:
        """A node's sums aged to the current tick (zero for a node never reported)."""
        if node is None:
            return Sums()
        return scaled(node.sums, decay_factor(self.tick - node.tick, self.params.half_life_groups))

    def now_lent(self, node: Node) -> Sums:
        """The part of a task's sums that its cell counts, aged to the current tick."""
        return scaled(node.lent, decay_factor(self.tick - node.tick, self.params.half_life_groups))

    def env_sums(self, env: str) -> Sums:
        return self.now(self.envs.get(env))

    def keep_rate(self, env: str) -> float:
        """The environment's keep rate now: 1 (nothing skipped) until its reports say more."""
        return self.keep.get(env, 1.0)

    def cell_view(self, cell: Cell) -> CellView:
        view = self._views.get(cell)
        if view is None:
            p = self.params
            pooled = Sums()
            for other, node in self.cells.items():
                weight = relation_weight(cell, other, p.family_weight, p.difficulty_weight)
                if weight > 0:
                    pooled = added(pooled, self.now(node), weight)
            parent = shrink(pooled, self.root, p.prior_groups, self.group_size)
            sums = self.now(self.cells.get(cell))
            beta = beta_from_moments(shrink(sums, parent, p.shrink_groups, self.group_size))
            view = self._views[cell] = CellView(sums, parent, beta)
        return view

    def task_beta(self, task: Task, view: CellView | None = None) -> Beta:
        """A task's Beta: its cell's (without the task's own evidence) updated by its rewards."""
        view = view or self.cell_view(cell_of(task))
        node = self.tasks.get((cell_of(task), task.id))
        if node is None:
            return view.beta
        own = self.now(node)
        others = added(view.sums, self.now_lent(node), -1.0)
        others = Sums(*(max(0.0, x) for x in others))  # decayed floats may dip below zero
        prior = beta_from_moments(
            shrink(others, view.parent, self.params.shrink_groups, self.group_size)
        )
        return updated_beta(prior, own)


# ── the scheduler ─────────────────────────────────────────────────────────────────────────


class EnvSched:
    """Samples each environment's task pool, skipping predicted zero-variance candidates as
    far as its zero-variance target asks and never below the floor, within env ratios."""

    def __init__(
        self,
        envs: Sequence[EnvConfig],
        params: EnvSchedConfig | None = None,
        group_size: int = RolloutConfig().group_size,
        seed: int = 0,
    ) -> None:
        if not envs:
            raise ValueError("EnvSched needs at least one environment")
        self.params = params or EnvSchedConfig()
        self.statistics = Statistics(self.params, group_size)
        # Entries that share a name are one environment; its candidates come from each entry
        # in proportion to the entry's weight.
        self.sources: dict[str, list[EnvSource]] = {}
        for env in envs:
            self.sources.setdefault(env.name, []).append(EnvSource.of(env))
        self.base_weights = {
            name: sum(entry.weight for entry in entries) for name, entries in self.sources.items()
        }
        # Per env: tasks whose last group was mixed, oldest first (see frontier_size).
        self.frontiers: dict[str, OrderedDict[str, Task]] = {}
        self.rng = random.Random(seed)  # used only when the caller passes no rng

    def observe(self, task: Task, report: GroupReport) -> None:
        self.statistics.observe(task, report)
        frontier = self.frontiers.setdefault(task.env, OrderedDict())
        frontier.pop(task.id, None)
        if group_sums(report).mixed and self.params.frontier_size:
            frontier[task.id] = task
            if len(frontier) > self.params.frontier_size:
                frontier.popitem(last=False)

    def target_weights(self, grants_issued: int) -> dict[str, float]:
        """Each environment's ratio target at this point of the run, scaled by its health."""
        p = self.params
        targets = weights_at(self.base_weights, p.ratio_at_grants, p.ratio_weights, grants_issued)
        return {
            env: w * env_health(self.statistics.env_sums(env), p.shrink_groups)
            for env, w in targets.items()
        }

    def choose(
        self,
        k: int,
        rng: random.Random | None = None,
        open_by_env: Mapping[str, int] | None = None,
        grants_issued: int = 0,
    ) -> list[Task]:
        """Up to `k` tasks (fewer only when every environment is at its `max_open`)."""
        rng = rng or self.rng
        open_by_env = open_by_env or {}
        room = {
            env: max(0, cap - open_by_env.get(env, 0)) for env, cap in self.params.max_open.items()
        }
        counts = apportion(k, self.target_weights(grants_issued), room, rng)
        tasks: list[Task] = []
        for env in sorted(counts):
            tasks += self._choose_in(env, counts[env], rng)
        return tasks

    def candidates(self, env: str, count: int, rng: random.Random) -> list[Task]:
        """The pool `count` tasks of `env` are chosen from: `pool_factor` × `count` fresh
        draws (entries by weight) and the newest of its frontier tasks its entries can still
        draw, as many as `frontier_share` says; distinct."""
        entries = self.sources[env]
        frontier = [
            task
            for task in self.frontiers.get(env, {}).values()
            if any(entry.can_draw(task) for entry in entries)
        ]
        share = frontier_share(self.statistics.keep_rate(env), self.params.floor)
        if self.params.selection != "skip":
            share = 0.0
        offered = frontier[len(frontier) - round(share * len(frontier)) :]
        pool = {task.id: task for task in offered}
        weights = [entry.weight for entry in entries]
        for entry in rng.choices(entries, weights=weights, k=self.params.pool_factor * count):
            task = entry.source.sample(rng)
            pool.setdefault(task.id, task)
        return list(pool.values())

    def _choose_in(self, env: str, count: int, rng: random.Random) -> list[Task]:
        """`count` tasks of `env`, sampled from its pool ∝ weight."""
        if count == 0:
            return []
        pool = self.candidates(env, count, rng)
        weights = [self.weight(task) for task in pool]
        return [pool[i] for i in pick(weights, count, rng)]

    def weight(self, task: Task) -> float:
        """The sampling weight of a candidate task: candidate_weight, nearest_half_weight or
        failing_weight, by `selection`."""
        stats = self.statistics
        if self.params.selection == "nearest_half":
            beta = stats.task_beta(task)
            return nearest_half_weight(beta.alpha / (beta.alpha + beta.beta), self.params.floor)
        if self.params.selection == "failing":
            return failing_weight(stats.task_beta(task), stats.group_size, self.params.floor)
        mixed = mixed_probability(stats.task_beta(task), stats.group_size)
        return candidate_weight(mixed, stats.keep_rate(task.env), self.params.floor)
