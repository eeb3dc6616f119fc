"""How long a trainer waits for its peers' batches, and what it says when rounds keep
failing (node/rounds.py), with hand-computed figures."""

from __future__ import annotations

import pytest

from node.rounds import (
    MAX_ROUND_TIMEOUT_S,
    MAX_ROUND_WAIT_S,
    TROUBLE_AFTER_FAILURES,
    RoundPace,
    RoundTimeout,
    RoundTrouble,
    step_share,
)

pytestmark = pytest.mark.unit


def test_the_wait_for_peers_is_two_measured_cycles_at_least_the_floor() -> None:
    pace = RoundPace(floor_s=30.0)
    assert pace.wait_s == 30.0  # nothing measured yet
    pace.step_began(now=100.0)
    pace.step_began(now=140.0)  # one cycle of 40 s
    assert pace.cycle_s == 40.0 and pace.wait_s == 80.0
    pace.step_began(now=150.0)  # 10 s: 0.3 x 10 + 0.7 x 40 = 31
    assert pace.cycle_s == pytest.approx(31.0) and pace.wait_s == pytest.approx(62.0)
    for t in (160.0, 170.0, 180.0, 190.0, 200.0, 210.0, 220.0, 230.0):
        pace.step_began(now=t)  # fast steps: the wait falls back to the floor
    assert pace.wait_s == 30.0


def test_the_wait_is_bounded() -> None:
    pace = RoundPace(floor_s=30.0)
    pace.step_began(now=0.0)
    pace.step_began(now=10_000.0)
    assert pace.wait_s == MAX_ROUND_WAIT_S


def test_a_round_may_take_three_measured_rounds_at_least_the_floor() -> None:
    timeout = RoundTimeout(floor_s=30.0)
    assert timeout.s == 30.0  # nothing measured yet
    timeout.succeeded(4.0)  # an idle box's all-reduce: the floor holds
    assert timeout.s == 30.0
    timeout.succeeded(24.0)  # 0.3 x 24 + 0.7 x 4 = 10: three of them
    assert timeout.round_s == pytest.approx(10.0) and timeout.s == pytest.approx(30.0)
    timeout.succeeded(44.0)  # 0.3 x 44 + 0.7 x 10 = 20.2
    assert timeout.s == pytest.approx(60.6)


def test_a_round_out_of_time_stretches_the_next_until_one_succeeds() -> None:
    timeout = RoundTimeout(floor_s=30.0)
    timeout.timed_out()
    assert timeout.s == 45.0
    timeout.timed_out()
    assert timeout.s == 67.5
    for _ in range(20):
        timeout.timed_out()
    assert timeout.s == MAX_ROUND_TIMEOUT_S
    timeout.succeeded(12.0)  # 36 s measured: the stretch ends with a success
    assert timeout.s == 36.0


def test_rounds_failing_in_a_row_are_said_once_with_the_setting_to_change() -> None:
    trouble = RoundTrouble()
    reason = "no gradient round formed, but 1 other trainers are live"
    said = [trouble.failed(reason) for _ in range(TROUBLE_AFTER_FAILURES + 3)]
    warnings = [w for w in said if w is not None]
    assert len(warnings) == 1 and said.index(warnings[0]) == TROUBLE_AFTER_FAILURES - 1
    assert "swarm.averaging_timeout_s" in warnings[0] and reason in warnings[0]
    assert trouble.problem.startswith(f"{TROUBLE_AFTER_FAILURES + 3} gradient rounds failed")
    trouble.succeeded()
    assert trouble.problem == ""
    # a new streak is said again
    said = [trouble.failed("50.0% of the average gradient never came") for _ in range(3)]
    assert said[-1] is not None and "answers too slowly" in said[-1]
    trouble.succeeded()
    stalled = "TimeoutError('no round within 30 s, still looking for group')"
    said = [trouble.failed(stalled) for _ in range(3)]
    assert said[-1] is not None and "swarm.matchmaking_time_s" in said[-1]


def test_one_failure_now_and_then_is_not_trouble() -> None:
    trouble = RoundTrouble()
    for _ in range(10):
        assert trouble.failed("TimeoutError()") is None
        trouble.succeeded()
    assert trouble.problem == ""


def test_a_step_is_shared_between_the_live_trainers() -> None:
    assert [step_share(8, n) for n in (1, 2, 3, 4, 8, 16)] == [8, 4, 3, 2, 1, 1]
    assert step_share(8, 0) == 8  # (never fewer than this trainer)
