"""Timeline merging: an episode's model calls, as sampled, become training sequences.

    call 1: [prompt₁][completion₁]
    call 2: [prompt₁ completion₁ │ new context][completion₂]      extends call 1
    call 3: [other prompt][completion₃]                            forks: a new sequence
        ──▶ sequence A: prompt₁ │ completion₁ (loss 1) new context (loss 0) completion₂ (loss 1)
            sequence B: other prompt │ completion₃ (loss 1)

A call whose prompt ids start with everything an earlier sequence holds (its prompt, the
model's tokens and the context between them) continues that sequence: the tokens in
between are context (loss mask 0), the new completion is the model's own (mask 1, with
its sampler logprobs). Any other call (edited history, a summary, another agent's private
view) starts a sequence of its own. The comparison is by token ids, so nothing is ever
re-tokenized; the OpenAI endpoint keeps ids continuous for clients that send history back
(see node/openai_api.py for how it matches re-formatted history by text).

Unmerged, every call is its own sequence, and a k-turn conversation trains its shared
prefix k times.

Several policies in one episode (a planner and a solver, two players): each call names its
policy, and `merge_by_policy` merges each policy's calls on a timeline of their own, so
another policy's tokens in a prompt are context there (loss mask 0), never trained as its.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    """One model call as sampled: the exact prompt ids it saw and what it produced."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the sampler's, one per completion id
    policy_version: int
    finish_reason: str = "stop"
    policy: str = ""  # the policy that sampled it ("": the swarm's only one)


@dataclass
class Sequence:
    """One training sequence: `prompt_ids`, then `completion_ids` with a mask and logprobs."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    policy_version: int = 0  # the oldest version that sampled any of its tokens
    calls: int = 0  # model calls merged into it
    finish_reason: str = ""
    policy: str = ""  # the policy of its calls (`merge_by_policy` keeps policies apart)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def add(self, context: list[int], call: Call) -> None:
        """Append `context` (never trained) and the call's completion (trained)."""
        self.completion_ids += context + call.completion_ids
        self.logprobs += [0.0] * len(context) + call.logprobs
        self.loss_mask += [0] * len(context) + [1] * len(call.completion_ids)
        first = self.calls == 0
        self.policy_version = (
            call.policy_version if first else min(self.policy_version, call.policy_version)
        )
        self.calls += 1
        self.finish_reason = call.finish_reason


def merge_calls(calls: Iterable[Call], *, merge: bool = True) -> list[Sequence]:
    """The training sequences of one episode's calls, in the order the calls were made.

    With `merge`, a call extends the longest sequence whose ids its prompt starts with;
    without, every call is a sequence of its own."""
    sequences: list[Sequence] = []
    for call in calls:
        if len(call.logprobs) != len(call.completion_ids):
            raise ValueError("a call needs one logprob per completion id")
        parent = _longest_prefix(sequences, call.prompt_ids) if merge else None
        if parent is None:
            parent = Sequence(prompt_ids=list(call.prompt_ids), policy=call.policy)
            sequences.append(parent)
            parent.add([], call)
        else:
            parent.add(call.prompt_ids[parent.tokens :], call)
    return sequences


def merge_by_policy(calls: Iterable[Call], *, merge: bool = True) -> dict[str, list[Sequence]]:
    """Each policy's training sequences of one episode: its own calls, in the order they
    were made, merged as `merge_calls` does (policies in the order they first called)."""
    by_policy: dict[str, list[Call]] = {}
    for call in calls:
        by_policy.setdefault(call.policy, []).append(call)
    return {policy: merge_calls(own, merge=merge) for policy, own in by_policy.items()}


def _longest_prefix(sequences: list[Sequence], prompt_ids: list[int]) -> Sequence | None:
    best: Sequence | None = None
    for sequence in sequences:
        n = sequence.tokens
        longer = best is None or n > best.tokens
        if longer and n <= len(prompt_ids) and prompt_ids[:n] == sequence.ids:
            best = sequence
    return best
