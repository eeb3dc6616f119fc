"""The "prompt" environment: one model turn on your task file, scored by your reward function.

    task row ──chat template──▶ prompt ids ──await generate(n)──▶ n completions (text)
        └─ as a dict (id, prompt, answer, your fields) ──▶ Rewards.score(task, texts)
              each term: fn(task, completion) -> float, sync (a bridge thread of its own)
              or async (on the loop), or all in one sandbox when reward_sandbox = true
           ──▶ reward = Σ weight · term; per-term values on the episode (the metrics' means)

A reward function is the user's code: one that raises, hangs past REWARD_TIMEOUT_S (async
or sandboxed), or returns something that is not a finite number (True and False count as
1 and 0) scores that sample 0 and marks it (`Episode.error`), counted per kind and logged
once per kind; the run goes on. The same `Rewards` re-scores groups on trainers
(node/verify.py) when `verify_rewards` is on and the function is not sandboxed, a re-check
bounded as a whole, sync functions too, by trainer.reward_check_timeout_s.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentjet.agent_runner import load_callable
from agentjet.bridge import blocking, detached
from agentjet.config import EnvConfig, RewardTerm
from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from agentjet.roles import wait_for
from agentjet.task_files import task_row
from sandboxes.base import Sandbox
from sandboxes.envs.chat import scored_single_turn

log = logging.getLogger(__name__)

# Wall-clock limit of scoring one sample with an async function, and of scoring one group
# in a sandbox. (A sync function runs in a thread, which cannot be stopped: keep it quick.
# A trainer's re-check gives up on one after trainer.reward_check_timeout_s, its thread
# left running: agentjet/bridge.py `detached`.)
REWARD_TIMEOUT_S = 30.0
# How `Episode.error` begins when the reward function failed for that sample.
REWARD_ERROR = "reward "
# The reward module's file name inside a scoring sandbox, and the program that runs it.
_MODULE_FILE = "agentjet_reward_module.py"
_SANDBOX_SCORER = f"""
import asyncio, importlib.util, inspect, json, math
spec = importlib.util.spec_from_file_location("reward_module", {_MODULE_FILE!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
job = json.load(open("agentjet_reward_input.json"))
out = []
for completion in job["completions"]:
    row = {{}}
    for name, attribute in job["terms"]:
        try:
            value = getattr(module, attribute)(job["task"], completion)
            if inspect.isawaitable(value):
                value = asyncio.run(value)
            row[name] = value if isinstance(value, (int, float, bool)) else repr(value)[:80]
        except Exception as e:
            row[name] = {{"raised": type(e).__name__ + ": " + str(e)[:200]}}
    out.append(row)
print(json.dumps(out))
"""


@dataclass
class Scored:
    """One completion's reward: the weighted sum, each term's value, and what went wrong
    (`timed_out`: a function ran past its time, which says nothing of the completion)."""

    reward: float = 0.0
    terms: dict[str, float] = field(default_factory=dict)
    error: str = ""
    timed_out: bool = False


class Rewards:
    """A "prompt" environment's reward: named, weighted functions of (task row, completion)."""

    def __init__(
        self,
        terms: Sequence[RewardTerm],
        sandbox_factory: Callable[[], Sandbox] | None = None,
        timeout_s: float = REWARD_TIMEOUT_S,
    ) -> None:
        """`sandbox_factory`: score in a sandbox from it (reward_sandbox) instead of here."""
        if not terms:
            raise ConfigError("a reward needs at least one function")
        self.terms = [(t.name, t.weight, t.function) for t in terms]
        self.functions = {t.name: load_callable(t.function, "reward") for t in terms}
        self.sandbox_factory = sandbox_factory
        self._source = b""  # the module's file, copied into each scoring sandbox
        if sandbox_factory is not None:
            modules = {t.function.partition(":")[0] for t in terms}
            if len(modules) != 1:
                raise ConfigError("sandboxed reward terms must all come from one module")
            self._source = _module_source(modules.pop())
        self.timeout_s = timeout_s
        self.errors: Counter[str] = Counter()  # kind of failure -> samples it failed

    @classmethod
    def from_config(
        cls, env: EnvConfig, sandbox_factory: Callable[[], Sandbox] | None = None
    ) -> Rewards:
        return cls(env.reward_terms(), sandbox_factory if env.reward_sandbox else None)

    async def score(self, task: Task, completions: Sequence[str]) -> list[Scored]:
        """Every completion of `task` scored; never raises for what the functions do."""
        row = task_row(task)
        if self.sandbox_factory is not None:
            raw = await self._in_sandbox(row, completions)
        else:
            raw = await self._here(row, completions)
        return [self._combine(values) for values in raw]

    # ── where the functions run ───────────────────────────────────────────────────────

    async def _here(self, row: dict[str, Any], completions: Sequence[str]) -> list[dict[str, Any]]:
        """Sync terms across the bridge (one call for the group, in a thread of its own: a
        user's function may never return), async ones on the loop, all at once; each call
        gets its own copy of the row (a function may change it)."""
        values: list[dict[str, Any]] = [{} for _ in completions]
        sync = [n for n, f in self.functions.items() if not _is_async(f)]

        def run_sync() -> None:
            for i, completion in enumerate(completions):
                for name in sync:
                    values[i][name] = _call(self.functions[name], copy.deepcopy(row), completion)

        async def run_async(i: int, name: str) -> None:
            try:
                call = self.functions[name](copy.deepcopy(row), completions[i])
                values[i][name] = await wait_for(call, self.timeout_s)
            except TimeoutError:
                values[i][name] = _Failed(f"ran past {self.timeout_s:g} s", timed_out=True)
            except Exception as e:  # noqa: BLE001 - the user's function failed
                values[i][name] = _Failed(f"raised {type(e).__name__}", str(e))

        calls = [run_async(i, n) for n in self.functions if n not in sync
                 for i in range(len(completions))]  # fmt: skip
        await asyncio.gather(*calls, *([detached(run_sync)] if sync else []))
        return values

    async def _in_sandbox(
        self, row: dict[str, Any], completions: Sequence[str]
    ) -> list[dict[str, Any]]:
        assert self.sandbox_factory is not None
        attributes = [(name, spec.partition(":")[2]) for name, _, spec in self.terms]
        source = self._source
        job = json.dumps({"task": row, "completions": list(completions), "terms": attributes})
        timeout_s = self.timeout_s

        def run() -> list[dict[str, Any]]:
            box = self.sandbox_factory()  # type: ignore[misc]
            try:
                box.start()
                box.put_file(_MODULE_FILE, source)
                box.put_file("agentjet_reward_input.json", job.encode())
                result = box.exec(_SANDBOX_SCORER, timeout_s)
            finally:
                box.close()
            if not result.ok:
                why = result.fault or result.error or result.stderr.strip().splitlines()[-1:]
                failed = _Failed(f"the sandboxed scorer failed ({why})")
                return [{name: failed for name, _ in attributes} for _ in completions]
            return [
                {k: _Failed("raised", v["raised"]) if isinstance(v, dict) else v
                 for k, v in out.items()}
                for out in json.loads(result.stdout)
            ]  # fmt: skip

        try:
            return await blocking(run)
        except (OSError, ValueError) as e:  # the sandbox, or junk printed by the module
            failed = _Failed(f"the sandboxed scorer failed ({type(e).__name__})", str(e))
            return [{name: failed for name, _, _ in self.terms} for _ in completions]

    # ── combining ───────────────────────────────────────────────────────────────────

    def _combine(self, values: dict[str, Any]) -> Scored:
        scored = Scored()
        for name, weight, _ in self.terms:
            value = values.get(name)
            if isinstance(value, _Failed):
                return self._failed(name, value.kind, value.detail, value.timed_out)
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, int | float) or not math.isfinite(value):
                return self._failed(name, f"returned {_describe(value)}", "")
            scored.terms[name] = float(value)
            scored.reward += weight * float(value)
        return scored

    def _failed(self, term: str, kind: str, detail: str, timed_out: bool = False) -> Scored:
        key = f"{term}: {kind}"
        if key not in self.errors:
            log.warning("reward %s %s%s (the sample scores 0; logged once per kind)",
                        term, kind, f": {detail}" if detail else "")  # fmt: skip
        self.errors[key] += 1
        return Scored(error=f"{REWARD_ERROR}{key}", timed_out=timed_out)

    def metrics(self) -> dict[str, int]:
        """Samples whose reward failed so far, overall."""
        return {"reward/errors": sum(self.errors.values())}


@dataclass(frozen=True)
class _Failed:
    kind: str
    detail: str = ""
    timed_out: bool = False


def _is_async(function: Callable[..., Any]) -> bool:
    """An `async def` function, or an object whose __call__ is one."""
    call = getattr(function, "__call__", None)  # noqa: B004 - the method, not callability
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


def _call(function: Callable[..., Any], row: dict[str, Any], completion: str) -> Any:
    try:
        return function(row, completion)
    except Exception as e:  # noqa: BLE001 - the user's function failed
        return _Failed(f"raised {type(e).__name__}", str(e))


def _describe(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return f"a {type(value).__name__}, not a number"


def _module_source(module_name: str) -> bytes:
    """The source file of the (already imported) reward module, to copy into a sandbox."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if path is None or not Path(path).is_file():
        raise ConfigError(f"reward module {module_name!r} has no source file to sandbox")
    return Path(path).read_bytes()


def rewards_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Each reward term's mean over the episodes that have it ("reward/<term>")."""
    sums: defaultdict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    for episode in episodes:
        for name, value in episode.reward_terms.items():
            sums[name] += value
            counts[name] += 1
    return {f"reward/{name}": sums[name] / counts[name] for name in sums}


class PromptEnv:
    """Single-turn: the task's prompt (text or chat messages), one answer, your reward."""

    name = "prompt"

    def __init__(self, rewards: Rewards, system_prompt: str | None = None) -> None:
        """`system_prompt=None` keeps the chat template's default system message (a task
        whose prompt has a system message keeps its own)."""
        self.rewards = rewards
        self.system_prompt = system_prompt

    async def run_group(
        self, generator: Generator, tasks: list[Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        groups, scores = await scored_single_turn(
            generator, self.system_prompt, tasks, n, params, self.rewards.score
        )
        for group, scored in zip(groups, scores, strict=True):
            for episode, score in zip(group, scored, strict=True):
                episode.reward, episode.reward_terms = score.reward, score.terms
                episode.error = score.error
        return groups

    def metrics(self) -> dict[str, int]:
        return self.rewards.metrics()
