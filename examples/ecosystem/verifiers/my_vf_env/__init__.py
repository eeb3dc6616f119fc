"""An example verifiers (0.4.x, v1 API) environment: add two numbers, with a Python
function offered as a tool. Install it (`pip install -e .` here) or put this folder on
PYTHONPATH, and name it in an agentjet config: `verifiers_env = "my_vf_env"`."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf
from pydantic_config import BaseConfig


class CalculatorConfig(BaseConfig):
    pass


class Calculator(vf.Toolset[CalculatorConfig]):
    TOOL_PREFIX = None  # offered to the model as `add`

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(CalculatorConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == task.answer)


class SumConfig(vf.TasksetConfig):
    count: int = 200
    digits: int = 1
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> Iterator[SumTask]:
        rng = random.Random(self.config.seed)
        high = 10**self.config.digits - 1
        for i in range(self.config.count):
            a, b = rng.randint(0, high), rng.randint(0, high)
            yield SumTask(
                SumData(
                    id=f"s{self.config.seed}-{i}",
                    prompt=f"What is {a} + {b}? Answer with just the number.",
                    answer=a + b,
                ),
                self.config.task,
            )


__all__ = ["SumTaskset"]
