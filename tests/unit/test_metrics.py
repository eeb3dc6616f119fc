"""The rate shown in progress output and `agentjet status`."""

from __future__ import annotations

import pytest

from agentjet.metrics import Rate

pytestmark = pytest.mark.unit


def test_an_instant_step_does_not_show_thousands_of_samples_per_second() -> None:
    rate = Rate(window_s=60.0)
    for i in range(5):  # 32 samples every 6 s
        assert rate.add(6.0 * i, 6.0 * (i + 1), 32) == pytest.approx(32 / 6)
    # A batch of zero-variance groups: no gradient to compute, done in 4 ms.
    assert rate.add(30.0, 30.004, 32) == pytest.approx(6 * 32 / 30.004)


def test_the_rate_forgets_what_ended_before_its_window() -> None:
    rate = Rate(window_s=10.0)
    rate.add(0.0, 1.0, 1000)  # a fast start...
    rate.add(1.0, 20.0, 19)
    assert rate.add(20.0, 21.0, 1) == pytest.approx(20 / 20)  # ...is out of the window
    assert Rate(window_s=10.0).add(5.0, 5.0, 3) == 0.0  # no time, no rate


def test_an_idle_workers_rate_falls_to_zero() -> None:
    """A teacher node's heartbeat reads the rate at its own time, not at the last request."""
    rate = Rate(window_s=10.0)
    assert rate.add(0.0, 2.0, 20) == pytest.approx(10.0)
    assert rate.at(4.0) == pytest.approx(20 / 4)  # two idle seconds count
    assert rate.at(12.5) == 0.0  # the last request ended before the window
    assert rate.add(13.0, 14.0, 5) == pytest.approx(5.0)
