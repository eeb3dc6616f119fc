"""A multi-turn tool Taskset: add two numbers, with a Python function `add` offered as a
tool (a Toolset's `@vf.tool`). The reward is 1 when the last reply holds the sum; a
second reward, the reply's length being even, lets the tiny random model's groups vary."""

from __future__ import annotations

import verifiers.v1 as vf
from pydantic_config import BaseConfig


class CalcConfig(BaseConfig):
    pass


class Calculator(vf.Toolset[CalcConfig]):
    TOOL_PREFIX = None  # the tool is offered as `add`, not `calculator_add`

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(CalcConfig())]

    @vf.reward(weight=1.0)
    async def right_sum(self, task: SumData, trace: vf.Trace) -> float:
        return float(str(task.answer) in trace.last_reply)

    @vf.reward(weight=1.0)
    async def even_length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) % 2 == 0)


class SumConfig(vf.TasksetConfig):
    count: int = 6


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):  # type: ignore[no-untyped-def]
        for i in range(self.config.count):
            a, b = 3 + i, 40 + 2 * i
            data = SumData(prompt=f"What is {a} + {b}? Use the add tool.", answer=a + b)
            yield SumTask(data, self.config.task)


__all__ = ["SumTaskset"]
