"""Timeline merging: calls that extend a context become one sequence, forks start new ones."""

from __future__ import annotations

import pytest

from agentjet.timeline import Call, merge_by_policy, merge_calls

pytestmark = pytest.mark.unit


def call(prompt: list[int], completion: list[int], version: int = 0) -> Call:
    return Call(prompt, completion, [-0.5] * len(completion), version)


def test_a_call_extending_the_context_continues_the_sequence() -> None:
    first = call([1, 2], [3, 4], version=5)
    second = call([1, 2, 3, 4, 8, 9], [7], version=4)
    [sequence] = merge_calls([first, second])
    assert sequence.prompt_ids == [1, 2]
    assert sequence.completion_ids == [3, 4, 8, 9, 7]
    assert sequence.loss_mask == [1, 1, 0, 0, 1]
    assert sequence.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert (sequence.calls, sequence.policy_version) == (2, 4)


def test_edited_history_starts_a_new_sequence() -> None:
    first = call([1, 2], [3, 4])
    edited = call([1, 2, 3, 5, 6], [7])  # changed the model's own turn
    summary = call([9], [10])
    sequences = merge_calls([first, edited, summary])
    assert [s.ids for s in sequences] == [[1, 2, 3, 4], [1, 2, 3, 5, 6, 7], [9, 10]]
    assert [s.loss_mask for s in sequences] == [[1, 1], [1], [1]]


def test_a_fork_from_an_earlier_point_of_a_merged_sequence_is_its_own() -> None:
    a = call([1], [2])
    b = call([1, 2, 3], [4])  # extends a
    c = call([1, 2, 5], [6])  # extends a, not a+b: a branch
    sequences = merge_calls([a, b, c])
    assert [s.ids for s in sequences] == [[1, 2, 3, 4], [1, 2, 5, 6]]


def test_the_longest_matching_sequence_is_extended() -> None:
    short = call([1], [2])
    other = call([7], [8])
    long = call([1, 2, 3], [4])
    nxt = call([1, 2, 3, 4, 5], [6])
    sequences = merge_calls([short, other, long, nxt])
    assert [s.ids for s in sequences] == [[1, 2, 3, 4, 5, 6], [7, 8]]


def test_unmerged_every_call_is_a_sequence_and_trains_the_shared_prefix_again() -> None:
    calls = [call([1, 2], [3]), call([1, 2, 3, 4], [5]), call([1, 2, 3, 4, 5, 6], [7])]
    merged = merge_calls(calls)
    unmerged = merge_calls(calls, merge=False)
    assert len(merged) == 1 and len(unmerged) == 3
    assert sum(s.tokens for s in merged) == 7
    assert sum(s.tokens for s in unmerged) == 3 + 5 + 7
    # the same model tokens are trained either way
    assert sum(sum(s.loss_mask) for s in merged) == sum(sum(s.loss_mask) for s in unmerged) == 3


def test_a_call_needs_one_logprob_per_token() -> None:
    with pytest.raises(ValueError, match="one logprob per completion id"):
        merge_calls([Call([1], [2, 3], [-0.1], 0)])


def test_an_episode_alternating_two_policies_gives_each_its_own_timeline() -> None:
    """A planner and a solver take turns in one conversation: each policy's sequence holds
    every token, and only its own completions are trained (the other's are context)."""
    turns = [
        ("planner", [1, 2], [10, 11]),
        ("solver", [1, 2, 10, 11, 3], [20]),
        ("planner", [1, 2, 10, 11, 3, 20, 4], [12]),
        ("solver", [1, 2, 10, 11, 3, 20, 4, 12, 5], [21, 22]),
    ]
    calls = [
        Call(prompt, completion, [-0.1 * (i + 1)] * len(completion), i, policy=policy)
        for i, (policy, prompt, completion) in enumerate(turns)
    ]
    merged = merge_by_policy(calls)
    assert list(merged) == ["planner", "solver"]
    [planner] = merged["planner"]
    [solver] = merged["solver"]
    assert planner.ids == [1, 2, 10, 11, 3, 20, 4, 12]
    assert planner.loss_mask == [1, 1, 0, 0, 0, 1]  # 10 11 | 3 20 4 | 12
    assert planner.logprobs == [-0.1, -0.1, 0.0, 0.0, 0.0, pytest.approx(-0.3)]
    assert solver.prompt_ids == [1, 2, 10, 11, 3]  # its first call's prompt
    assert solver.completion_ids == [20, 4, 12, 5, 21, 22]
    assert solver.loss_mask == [1, 0, 0, 0, 1, 1]
    assert (planner.calls, planner.policy_version) == (2, 0)
    assert (solver.calls, solver.policy_version) == (2, 1)
    # one policy (no names): the calls make one sequence, as before
    alone = merge_by_policy([Call(c.prompt_ids, c.completion_ids, c.logprobs, 0) for c in calls])
    assert list(alone) == [""] and alone[""][0].ids == [1, 2, 10, 11, 3, 20, 4, 12, 5, 21, 22]
    assert alone[""][0].loss_mask == [1, 1, 0, 1, 0, 1, 0, 1, 1]
