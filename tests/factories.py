"""Well-formed wire objects and stand-in policies for tests; each test changes only what
it is about."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from agentjet.episode import Completion, SamplingParams
from agentjet.identity import NodeKeys, encode_certificate
from agentjet.protocol import (
    Hello,
    Sample,
    TrajectoryGroup,
    pack_floats,
    pack_ids,
    pack_mask,
    unpack_floats,
    unpack_ids,
)


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


def tiny_trainer_settings(
    model_dir: Path, endpoint: str, keys_file: Path, run_dir: Path
) -> list[str]:
    """`load_config` settings of a trainer of the tiny model at `endpoint` (an ipc path
    under a short temporary folder), with the swarm keys in `keys_file`, writing to
    `run_dir`."""
    return [
        f'model.name="{model_dir}"',
        f'net.trainer_endpoint="{endpoint}"',
        f'net.keys="{keys_file}"',
        f'run.dir="{run_dir}"',
    ]


def member_hello(keys: NodeKeys, role: str = "rollout") -> Hello:
    """The Hello a node with `keys` says first: its name and certificate."""
    certificate = encode_certificate(keys.identity.certificate)
    return Hello(node_id=keys.name, role=role, certificate=certificate)  # type: ignore[arg-type]


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


class RuleGenerator:
    """A Generator that answers every context by a rule: `reply(text)` gets the decoded
    context (prompt and turns so far) and returns the next model turn. For tests of whole
    episodes at scale, where scripting each engine call would be longer than the test."""

    def __init__(self, tokenizer: Any, reply: Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.policy_version = 0
        self.calls = 0

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        self.calls += 1
        out = []
        for prompt in prompts:
            text = self.reply(self.tokenizer.decode(prompt))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids.append(self.tokenizer.eos_token_id)
            out.append([Completion(ids, [-0.5] * len(ids), "stop") for _ in range(n)])
        return out


def forge(
    group: TrajectoryGroup,
    group_id: str,
    *,
    logprobs: Callable[[np.ndarray], np.ndarray] = lambda lp: lp,
    tokens: Callable[[np.ndarray], np.ndarray] = lambda ids: ids,
    node_id: str = "forger",
) -> TrajectoryGroup:
    """`group` as a forger would send it: every sample's sampler logprobs and completion ids
    passed through `logprobs` and `tokens`, under a new id from node `node_id`."""
    samples = [
        msgspec.structs.replace(
            s,
            logprobs=pack_floats(logprobs(unpack_floats(s.logprobs).copy())),
            completion_ids=pack_ids(tokens(unpack_ids(s.completion_ids).copy())),
        )
        for s in group.samples
    ]
    return msgspec.structs.replace(
        group, group_id=group_id, grant_id=group_id, node_id=node_id, samples=samples
    )


def groups_from_samples(
    prompts: list[list[int]], sampled: list[list[Completion]], tag: str
) -> list[TrajectoryGroup]:
    """One single-turn group per prompt from an engine's completions of it, rewards 1, 0, 1,
    0, ... so that every sample carries gradient (a learner forwards and checks each one)."""
    from agentjet.episode import Episode
    from agentjet.protocol import Task, WorkGrant
    from node.rollout_produce import build_group

    groups = []
    for i, (prompt, samples) in enumerate(zip(prompts, sampled, strict=True)):
        episodes = []
        for j, completion in enumerate(samples):
            episode = Episode(prompt_ids=prompt, reward=float(j % 2 == 0))
            episode.add_model_turn(completion)
            episodes.append(episode)
        task = Task(id=f"{tag}-t{i}", env="arithmetic", prompt="")
        grant = WorkGrant(grant_id=f"{tag}-{i}", task=task, group_size=len(samples), lease_s=60.0)
        groups.append(build_group(grant, episodes, tag, 0.0))
    return groups
