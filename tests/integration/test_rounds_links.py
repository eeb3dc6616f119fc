"""Gradient rounds over a slow link (docs/links.md, "Gradient rounds"): a swarm in network
namespaces, every link limited to 20 Mbit/s each way, trains in local-steps mode with
fp16 pseudo-gradients, and a trainer SIGKILLed while a round is on the wire loses nothing
and trains nothing twice in the weights that go on (the fault suite's accounting)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.integration.test_swarm import (
    Swarm,
    check_every_group_accounted_for,
    kill_trainer_b_and_go_on,
    leftovers,
    start_swarm_on_hosts,
    swarm_factory,
    trained_in_the_weights_that_go_on,
)
from tests.netns import Node, Swarmnet, require_netns

pytestmark = pytest.mark.netns
__all__ = ["swarm_factory"]  # the fixture, used by name

RATE_MBIT = 20
# Both trainers sent this much in one poll: a round is on the wire (the tiny model's
# pseudo-gradient is ~6 MB in fp16, 2-3 s at 20 Mbit/s; a version or a group is one
# trainer's bytes, not both at once).
ROUND_BYTES = 150_000
POLL_S = 0.2
ROUND_WAIT_S = 240.0


def wait_for_a_round_on_the_wire(swarm: Swarm, a: Node, b: Node) -> None:
    """Poll both trainers' links until both send ROUND_BYTES within one POLL_S."""
    deadline = time.monotonic() + ROUND_WAIT_S
    before = a.tx_bytes(), b.tx_bytes()
    while time.monotonic() < deadline:
        time.sleep(POLL_S)  # a sampling period of the counters, not a wait for an event
        now = a.tx_bytes(), b.tx_bytes()
        if min(n - p for n, p in zip(now, before, strict=True)) >= ROUND_BYTES:
            return
        before = now
        dead = {n: p.returncode for n, p in swarm.procs.items() if p.poll() is not None}
        assert not dead, f"{dead}\n{swarm.logs()}"
    raise AssertionError(f"no round seen on the wire in {ROUND_WAIT_S:.0f} s\n{swarm.logs()}")


def test_a_trainer_killed_mid_round_at_20_mbit_loses_nothing(
    swarm_factory: Callable[..., Swarm],
) -> None:
    require_netns()
    swarm = swarm_factory(
        "net.map_local=false", "swarm.local_steps=2", "swarm.grad_compression=fp16"
    )
    with Swarmnet() as net:
        hosts = start_swarm_on_hosts(swarm, net, limit_mbit=RATE_MBIT)

        def trained(name: str) -> bool:
            return any(r["trained_group_ids"] for r in swarm.steps(name))

        swarm.wait_for(
            "both trainers to train", lambda: trained("trainer-a") and trained("trainer-b")
        )
        wait_for_a_round_on_the_wire(swarm, hosts["ta"], hosts["tb"])
        kill_trainer_b_and_go_on(swarm, versions=2)
        codes = swarm.stop()
        assert codes == {"coordinator": 0, "trainer-a": 0, "rollout": 0}, swarm.logs()
        counts = check_every_group_accounted_for(
            swarm, ["trainer-a", "trainer-b"], duplicates_allowed=True
        )
        assert counts["trained"] > 0
        kept = trained_in_the_weights_that_go_on(swarm, "trainer-a", "trainer-b")
        assert len(kept) == len(set(kept)), "a group is in the weights twice"
    assert leftovers(swarm) == {}
