"""A Taskset whose reward misbehaves on every other row (odd `idx`), in turn each kind
`bad` lists: "raise" raises, "nan" returns NaN, "junk" returns a string, "hang" never
returns. Even rows score the reply's length being even, so a run has groups to train."""

from __future__ import annotations

import asyncio
import math

import verifiers.v1 as vf


class FaultyConfig(vf.TasksetConfig):
    bad: list[str] = ["raise"]
    count: int = 6


class FaultyData(vf.TaskData):
    bad: str = ""


class FaultyTask(vf.Task[FaultyData]):
    @vf.reward
    async def flaky(self, task: FaultyData, trace: vf.Trace) -> object:
        if task.bad == "raise":
            raise RuntimeError("the reward broke")
        if task.bad == "nan":
            return math.nan
        if task.bad == "junk":
            return "not a number"
        if task.bad == "hang":
            await asyncio.sleep(3600)
        return float(len(trace.last_reply) % 2 == 0)


class FaultyTaskset(vf.Taskset[FaultyTask, FaultyConfig]):
    def load(self):  # type: ignore[no-untyped-def]
        for i in range(self.config.count):
            kinds = self.config.bad
            bad = kinds[(i // 2) % len(kinds)] if i % 2 else ""
            yield FaultyTask(FaultyData(prompt=f"Say something ({i}).", bad=bad), self.config.task)


__all__ = ["FaultyTaskset"]
