"""The react environment's agent: arithmetic with a Python tool, written as any user would
write an agent, against the official `openai` client and its function calling.

    messages ──client.chat.completions.create(tools=[python])──▶ reply
       ├─ tool_calls: run each `python` call in the episode's sandbox, append the output
       ├─ "Answer: N": done, reward = (N == answer)
       └─ anything else: remind the format, go on — up to max_turns model calls

The answer must come as "Answer: <integer>" on a turn without tool calls; the strict format
makes the conversation multi-turn for a model that does not follow it at first. Sandbox
calls cross the one bridge to a thread (agentjet/bridge.py). This module imports neither
torch nor the rollout node: the same agent runs in-process or in
an `agentjet agent` process on another machine.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from typing import Any

from agentjet.bridge import blocking
from agentjet.protocol import Task
from sandboxes.base import Sandbox, SandboxError
from sandboxes.envs.chat import task_messages
from sandboxes.envs.sandboxed import tool_feedback
from sandboxes.process import ProcessSandbox

REACT_SYSTEM_PROMPT = (
    "Solve the problem. You may call the python tool to compute. "
    "End with a line 'Answer: <number>'."
)
REMINDER = "Reply with a line 'Answer: <number>', or call the python tool."
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and see what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        },
    },
}
_ANSWER = re.compile(r"Answer:\s*(-?\d[\d,]*)", re.IGNORECASE)


class ReactAgent:
    """`await agent(task, client) -> reward`; see the module docstring."""

    def __init__(
        self,
        *,
        max_turns: int = 6,
        tool_timeout_s: float = 5.0,
        sandbox_factory: Callable[[], Sandbox] = ProcessSandbox,
        model: str = "policy",
    ) -> None:
        self.max_turns = max_turns
        self.tool_timeout_s = tool_timeout_s
        self.sandbox_factory = sandbox_factory
        self.model = model

    async def __call__(self, task: Task, client: Any) -> float:
        messages: list[dict[str, Any]] = list(task_messages(task, REACT_SYSTEM_PROMPT))
        sandbox: Sandbox | None = None
        try:
            for _ in range(self.max_turns):
                response = await client.chat.completions.create(
                    model=self.model, messages=messages, tools=[PYTHON_TOOL]
                )
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if message.tool_calls:
                    for call in message.tool_calls:
                        if sandbox is None:
                            sandbox = self.sandbox_factory()
                            await blocking(sandbox.start)
                        output = await blocking(self._run, sandbox, call.function.arguments)
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "content": output}
                        )
                    continue
                if _ANSWER.search(message.content or ""):
                    return react_judge(task, messages)
                messages.append({"role": "user", "content": REMINDER})
            return 0.0
        finally:
            if sandbox is not None:
                await blocking(_close, sandbox)

    def _run(self, sandbox: Sandbox, arguments: str) -> str:
        try:
            code = json.loads(arguments).get("code", "")
        except (json.JSONDecodeError, AttributeError):
            return "Error: the arguments must be JSON with a code string"
        if not isinstance(code, str) or not code.strip():
            return "Error: no code given"
        try:
            result = sandbox.exec(code, self.tool_timeout_s)
        except SandboxError as e:
            return f"Error: the code could not be run ({e})"
        return tool_feedback(result, self.tool_timeout_s).removeprefix("Output:\n")


def react_judge(task: Task, messages: list[dict[str, Any]]) -> float:
    """1.0 when the last assistant message says "Answer: <task.answer>", else 0.0."""
    last: dict[str, Any] = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
    answer = _ANSWER.search(str(last.get("content") or ""))
    return 1.0 if answer and int(answer.group(1).replace(",", "")) == task.answer else 0.0


# For `agentjet agent --agent sandboxes.envs.react:run_episode` (process sandboxes).
run_episode = ReactAgent()


def _close(sandbox: Sandbox) -> None:
    with contextlib.suppress(SandboxError):
        sandbox.close()
