"""Agents choosing a policy per call (issue 26): the OpenAI endpoint's `model` field names
a [[policies]] entry; an episode that calls two policies yields one group per policy, each
on its own timeline. The real endpoint, the real openai client, the torch engine on the
tiny model with two policies' adapters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from agentjet.config import ModelConfig
from agentjet.episode import SamplingParams
from agentjet.protocol import Task, WorkGrant, unpack_ids
from node.agents import AgentEnv
from node.lora import random_adapters
from node.policy_sync import PolicyView
from node.rollout_produce import build_groups
from node.torch_engine import TorchEngine
from tests.agents import (
    planner_and_solver,
    planner_and_solver_scored_apart,
    rewards_a_policy_it_never_called,
)

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(max_new_tokens=6)
VERSIONS = {"planner": 3, "solver": 5}
TASKS = [Task(id=f"t{i}", env="agent", prompt=f"What is {i} + 1?", answer=i + 1) for i in range(2)]


def test_an_episode_calling_two_policies_trains_each_on_its_own_calls(
    tiny_model_dir: Path, one_torch_thread: None
) -> None:
    engine = TorchEngine(tiny_model_dir, seed=0)

    async def scenario() -> None:
        lora = ModelConfig(lora_rank=4)
        for seed, (policy, version) in enumerate(VERSIONS.items()):
            adapters = random_adapters(engine.model, lora, seed=seed)
            await engine.load_adapters(policy, adapters, lora, version)
        env = AgentEnv("agent", planner_and_solver, policies=list(VERSIONS))
        try:
            # A grant of the solver: its episodes' calls go to the solver unless the
            # agent's `model` names another policy.
            episodes = await env.run_group(PolicyView(engine, "solver"), TASKS, 2, PARAMS)
            server = env.server
            assert server is not None
            for i, (task, eps) in enumerate(zip(TASKS, episodes, strict=True)):
                assert len(eps) == 2
                for episode in eps:
                    by_policy = {seq.policy: seq for seq in episode.sequences}
                    assert sorted(by_policy) == ["planner", "solver"]
                    for policy, seq in by_policy.items():
                        assert seq.policy_version == VERSIONS[policy] and seq.calls == 1
                    # the planner's reply is context (never trained) in the solver's prompt
                    plan = by_policy["planner"].completion_ids
                    assert sum(by_policy["solver"].loss_mask) == len(
                        by_policy["solver"].completion_ids
                    )
                    assert len(plan) > 0
                grant = WorkGrant(
                    grant_id=f"g{i}", task=task, group_size=2, lease_s=1.0, policy="solver"
                )
                lineages = {"planner": "lp", "solver": "ls"}
                groups = build_groups(grant, eps, "node", 1.0, lineages)
                assert [(g.group_id, g.grant_id, g.policy, g.lineage) for g in groups] == [
                    (f"g{i}", f"g{i}", "solver", "ls"),
                    (f"g{i}-planner", f"g{i}", "planner", "lp"),
                ]
                for group in groups:
                    assert len(group.samples) == 2
                    assert {s.policy_version for s in group.samples} == {VERSIONS[group.policy]}
                    assert [s.reward for s in group.samples] == [e.reward for e in eps]
                solver = groups[0].samples[0]
                assert (
                    unpack_ids(solver.completion_ids).tolist() == eps[0].sequences[1].completion_ids
                )

            # The endpoint lists the policies; a model it does not serve is a 404, counted.
            async with httpx.AsyncClient(base_url=server.base_url) as http:
                episode = server.hub.open(TASKS[0], training=True, policy="solver")
                auth = {"Authorization": f"Bearer {episode.key}"}
                models = (await http.get("/v1/models", headers=auth)).json()
                assert [m["id"] for m in models["data"]] == ["planner", "solver"]
                body = {"model": "critic", "messages": [{"role": "user", "content": "hi"}]}
                refused = await http.post("/v1/chat/completions", json=body, headers=auth)
                assert refused.status_code == 404
                error = refused.json()["error"]
                assert error["code"] == "model_not_found" and "planner, solver" in error["message"]
                assert server.unknown_models == 1
                body["model"] = "planner"
                answered = await http.post("/v1/chat/completions", json=body, headers=auth)
                assert answered.status_code == 200 and answered.json()["model"] == "planner"
                del body["model"]  # no model: the episode's own policy
                answered = await http.post("/v1/chat/completions", json=body, headers=auth)
                assert answered.json()["model"] == "solver"
                assert [r.call.policy for r in episode.calls] == ["planner", "solver"]
                server.hub.forget(episode)
        finally:
            await env.close()

    asyncio.run(scenario())


def test_an_agent_may_reward_each_policy_apart_but_only_policies_it_called(
    tiny_model_dir: Path, one_torch_thread: None
) -> None:
    engine = TorchEngine(tiny_model_dir, seed=0)

    async def scenario() -> None:
        apart = AgentEnv("agent", planner_and_solver_scored_apart, policies=list(VERSIONS))
        stray = AgentEnv(
            "agent", rewards_a_policy_it_never_called, policies=list(VERSIONS), attempts=1
        )
        try:
            [eps] = await apart.run_group(PolicyView(engine, "solver"), TASKS[:1], 4, PARAMS)
            for episode in eps:
                assert set(episode.policy_rewards) == {"planner", "solver"}
                assert episode.reward == episode.policy_rewards["solver"]  # its grant's
            grant = WorkGrant(grant_id="g", task=TASKS[0], group_size=4, lease_s=1.0,
                              policy="solver")  # fmt: skip
            groups = build_groups(grant, eps, "node", 1.0, {})
            for group in groups:
                expected = [e.policy_rewards[group.policy] for e in eps]
                assert [s.reward for s in group.samples] == expected
            # A reward for a policy the episode never called: the episode fails.
            assert await stray.run_group(PolicyView(engine, "solver"), TASKS[:1], 2, PARAMS) == [[]]
        finally:
            await apart.close()
            await stray.close()

    asyncio.run(scenario())
