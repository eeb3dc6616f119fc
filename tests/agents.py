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
