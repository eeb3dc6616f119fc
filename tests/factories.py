"""Well-formed wire objects for tests; each test changes only what it is about."""

from __future__ import annotations

from typing import Any

from agentjet.protocol import Sample, TrajectoryGroup, pack_floats, pack_ids, pack_mask


def make_sample(**changes: Any) -> Sample:
    fields: dict[str, Any] = dict(
        prompt_ids=pack_ids([1, 2, 3]),
        completion_ids=pack_ids([4, 5]),
        logprobs=pack_floats([-0.5, -1.25]),
        loss_mask=pack_mask([1, 1]),
        reward=1.0,
        advantage=0.0,
        policy_version=0,
    )
    return Sample(**(fields | changes))


def make_group(
    group_id: str = "g1", version: int = 0, rewards: tuple[float, ...] = (1.0, 0.0)
) -> TrajectoryGroup:
    """A group of one sample per reward, all sampled at policy `version`."""
    return TrajectoryGroup(
        group_id=group_id,
        grant_id=group_id,
        node_id="test-node",
        task_id="t1",
        env="arithmetic",
        samples=[make_sample(reward=r, policy_version=version) for r in rewards],
        created_at=1.0,
    )
