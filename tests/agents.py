"""Agents for tests of agent environments (`envs[].agent = "tests.agents:NAME"`)."""

from __future__ import annotations

from typing import Any

from agentjet.protocol import Task


async def even_length(task: Task, client: Any) -> float:
    """One model call; reward 1 when the reply has an even number of characters. The tiny
    random model earns it about half the time, so groups have mixed rewards and training
    has real gradients to average (arithmetic, which it never solves, has none)."""
    response = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task.prompt}]
    )
    return float(len(response.choices[0].message.content or "") % 2 == 0)


async def planner_and_solver(task: Task, client: Any) -> float:
    """Two policies in one episode ([[policies]] "planner" and "solver", named by the
    `model` field): the planner writes a plan, the solver answers with the plan in its
    prompt. Reward as `even_length`, on the solver's reply."""
    plan = await client.chat.completions.create(
        model="planner", messages=[{"role": "user", "content": f"Plan: {task.prompt}"}]
    )
    answer = await client.chat.completions.create(
        model="solver",
        messages=[
            {"role": "user", "content": f"{task.prompt}\nPlan: {plan.choices[0].message.content}"}
        ],
    )
    return float(len(answer.choices[0].message.content or "") % 2 == 0)
