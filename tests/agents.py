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


async def planner_and_solver_scored_apart(task: Task, client: Any) -> dict[str, float]:
    """`planner_and_solver`, rewarding each policy apart: the solver as `even_length`,
    the planner for a plan of an odd number of characters."""
    plan = await client.chat.completions.create(
        model="planner", messages=[{"role": "user", "content": f"Plan: {task.prompt}"}]
    )
    planned = plan.choices[0].message.content or ""
    answer = await client.chat.completions.create(
        model="solver", messages=[{"role": "user", "content": f"{task.prompt}\nPlan: {planned}"}]
    )
    solved = float(len(answer.choices[0].message.content or "") % 2 == 0)
    return {"planner": float(len(planned) % 2 == 1), "solver": solved}


async def rewards_a_policy_it_never_called(task: Task, client: Any) -> dict[str, float]:
    """A per-policy reward naming a policy the episode never called: refused."""
    await client.chat.completions.create(
        model="solver", messages=[{"role": "user", "content": str(task.prompt)}]
    )
    return {"solver": 1.0, "planner": 0.0}
