"""The agent of "verifiers" environments: a verifiers Taskset's task played on the episode's
OpenAI endpoint, scored by the task's own rewards (agentjet/verifiers_envs.py holds every
use of the verifiers package).

    AgentEnv episode ── await VerifiersAgent(task, client) ──▶ reward
        vf_task = the row's verifiers Task (rebuilt from task.fields)
        messages = system prompt + prompt; tools = its toolsets' @vf.tool methods
        up to max_turns: client.chat.completions.create(messages, tools)  (the endpoint
            records every call: the training sequences are its token ids, as for any agent)
            a reply with tool calls: each tool called in-process, its result appended
            a reply without: the conversation is over
        score(vf_task, messages): the weighted sum of its @vf.reward functions

This loop stands in for verifiers' `null` harness (a chat program with MCP tools), which
verifiers runs as a uv script in a Runtime; here it runs in the rollout node, on the
node's loop. A reward or toolset that raises or gives no finite number raises
VerifiersError, and a hang is cut by the environment's episode_timeout_s: either way
AgentEnv counts the episode failed and plays it again; the run goes on.
"""

from __future__ import annotations

from typing import Any

from agentjet.config import EnvConfig
from agentjet.protocol import Task
from agentjet.verifiers_envs import Tools, VerifiersTaskset, opening, score


class VerifiersAgent:
    """`await agent(task, client) -> reward` for one verifiers environment entry."""

    def __init__(self, taskset: VerifiersTaskset, max_turns: int, model: str = "policy") -> None:
        self.taskset = taskset
        self.max_turns = max_turns
        self.model = model

    async def __call__(self, task: Task, client: Any) -> float:
        vf_task = self.taskset.vf_task(task)
        messages = opening(vf_task)
        opened = len(messages)
        stop = "max_turns"
        async with Tools.open(self.taskset, vf_task) as tools:
            for _ in range(self.max_turns):
                extra = {"tools": tools.schemas} if tools.schemas else {}
                response = await client.chat.completions.create(
                    model=self.model, messages=messages, **extra
                )
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    stop = "no_tool_calls"
                    break
                for call in message.tool_calls:
                    result = await tools.call(call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "name": call.function.name, "content": result})  # fmt: skip
        return await score(vf_task, messages, opened, stop)


def verifiers_agent(config: EnvConfig) -> VerifiersAgent:
    """The agent of a "verifiers" `[[envs]]` entry (node/agents.py make_agent_env)."""
    return VerifiersAgent(VerifiersTaskset.of(config), config.max_turns)
