"""The "env_class" environment: a TRL-style environment class (`environment_factory`) as
an agent on the episode's OpenAI endpoint (node/agents.py AgentEnv).

    config load: environment = "module:Class" imported (as agent modules are) ──▶ EnvClass:
                 the class, its tools' JSON schemas (signature + docstring "Args:",
                 transformers' get_json_schema, as TRL offers them), get_reward or not
    per episode: instance = Class(); observation = reset(**row)   (here, or in a sandbox)
       messages = the row's prompt, the observation appended to its last message
       ┌─▶ client.chat.completions.create(messages, tools=schemas) ──▶ reply
       │     no tool calls, or max_turns replies: done
       └── each tool call: instance.NAME(**arguments) ──▶ str(result), or "Error: ..." when
           the arguments are bad or the tool raised (the model is told; the episode goes on)
       reward = get_reward() (if the class has one) + Σ weight · f(row, final reply) (the
                env's `reward` / `rewards` terms): TRL's rule, every source summed and the
                weights applying to the functions only

Where the instance lives: here (`sandbox = false`), each call of a sync method in a
thread of its own, of an async one on the loop; or in a sandbox leased from the pool for
the episode (`sandbox = true`): each call is one run of sandboxes/envs/env_class_runner.py
there, the instance pickled in the sandbox's work dir between calls (a sandbox runs
programs to completion, so no process of the class can outlive a call; see that module).

The class is the user's code: every call is bounded by tool_timeout_s (the episode by
episode_timeout_s, AgentEnv). A tool that raises, or (in a sandbox, where it is killed)
runs past its time, is an error message to the model; the tool error kinds are counted
and logged once each. A class that raises in __init__ / reset / get_reward, returns junk
from them, runs past its time anywhere else (a thread cannot be stopped: the instance is
not trusted after), or cannot be pickled in a sandbox fails the episode (EnvClassError):
AgentEnv discards it, plays it again, and gives the task up after its attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import sys
import threading
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agentjet.agent_runner import load_callable
from agentjet.bridge import blocking, detached
from agentjet.config import EnvConfig
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from agentjet.task_files import task_row
from sandboxes.base import FAULT_OOM, FAULT_PIDS, ExecResult, Sandbox, SandboxError
from sandboxes.envs import env_class_runner
from sandboxes.envs.prompt import Rewards

log = logging.getLogger(__name__)

# Methods of the class that are not tools (TRL's reserved names).
RESERVED = ("reset", "get_reward")
# The OpenAI `model` the episodes ask for (without [[policies]] any name is the policy).
MODEL = "policy"
# The runner program's source, sent with each sandboxed call.
_RUNNER = Path(env_class_runner.__file__).read_text()


class EnvClassError(Exception):
    """The class failed where its episode cannot go on (see the module docstring)."""


@dataclass(frozen=True)
class EnvClass:
    """A loaded environment class: what its episodes offer and how they are scored."""

    spec: str
    cls: type
    tools: list[dict[str, Any]]
    has_reward: bool
    source: bytes  # the module's file, for sandboxes

    @property
    def tool_names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]


def load_env_class(spec: str) -> EnvClass:
    """`module:Class` imported and checked; ConfigError naming `environment` otherwise."""
    where = f"environment {spec!r}"
    cls = load_callable(spec, "environment")
    if not isinstance(cls, type):
        raise ConfigError(f"{where} is not a class (a {type(cls).__name__})")
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{where} has no reset method: TRL-style classes define reset(**row)")
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    source = Path(path).read_bytes() if path and Path(path).is_file() else b""
    has_reward = callable(getattr(cls, "get_reward", None))
    return EnvClass(spec, cls, tool_schemas(cls, where), has_reward, source)


def tool_schemas(cls: type, where: str = "the class") -> list[dict[str, Any]]:
    """The JSON schema of each tool of `cls` (its public methods but reset and get_reward,
    by name), as transformers builds one for TRL: type hints give the types, the Google
    docstring's summary the description and its "Args:" each argument's; an argument with
    a default is optional. ConfigError when a tool's signature or docstring cannot make one."""
    from transformers.utils import get_json_schema

    schemas = []
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in RESERVED:
            continue
        function = inspect.getattr_static(cls, name)
        if not isinstance(function, types.FunctionType):  # attributes, static/class methods
            continue
        # Bound to a stand-in: the schema leaves `self` out, as TRL's bound methods do.
        try:
            schemas.append(get_json_schema(types.MethodType(function, object())))
        except Exception as e:  # noqa: BLE001 - transformers' parse errors have no common base
            raise ConfigError(
                f"{where}: tool {name!r} cannot be offered to the model: {e}"
            ) from None
    return schemas


# ── where the instance lives ──────────────────────────────────────────────────────────


class Instance(Protocol):
    """One episode's instance of the class, here or in a sandbox."""

    async def reset(self, row: dict[str, Any]) -> str | None: ...

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool's result as text, or "Error: ..." when it raised (the model is told)."""
        ...

    async def reward(self) -> Any: ...

    async def close(self) -> None: ...


class LocalInstance:
    """The instance in this process: sync methods each in a thread of their own (a method
    may never return), async ones on the loop; each bounded by `timeout_s`."""

    def __init__(self, cls: type, timeout_s: float) -> None:
        self.cls = cls
        self.timeout_s = timeout_s
        self.instance: Any = None

    async def reset(self, row: dict[str, Any]) -> str | None:
        self.instance = await self._expect(self.cls, "the class's __init__")
        return _observation(await self._expect(self.instance.reset, "reset", **row))

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        try:
            value = await self._run(getattr(self.instance, name), name, **arguments)
        except EnvClassError:
            raise
        except Exception as e:  # noqa: BLE001 - the tool's own failure: the model is told
            return _error(f"{type(e).__name__}: {e}")
        return _text(value)

    async def reward(self) -> Any:
        return await self._expect(self.instance.get_reward, "get_reward")

    async def close(self) -> None:
        self.instance = None

    async def _expect(self, fn: Callable[..., Any], what: str, **kwargs: Any) -> Any:
        try:
            return await self._run(fn, what, **kwargs)
        except EnvClassError:
            raise
        except Exception as e:  # noqa: BLE001 - the class's failure ends the episode
            raise EnvClassError(f"{what} raised {type(e).__name__}: {e}") from None

    async def _run(self, fn: Callable[..., Any], what: str, **kwargs: Any) -> Any:
        """`fn(**kwargs)`, awaited if it is async; EnvClassError past `timeout_s`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                if inspect.iscoroutinefunction(fn):
                    return await fn(**kwargs)
                value = await detached(fn, **kwargs)
                return await value if inspect.isawaitable(value) else value
        except TimeoutError:
            raise EnvClassError(f"{what} ran past tool_timeout_s ({self.timeout_s:g} s)") from None


class SandboxedInstance:
    """The instance in a sandbox leased for the episode: each call one run of the runner
    program (sandboxes/envs/env_class_runner.py), bounded by `timeout_s` there."""

    def __init__(self, env: EnvClass, factory: Callable[[], Sandbox], timeout_s: float) -> None:
        self.env = env
        self.factory = factory
        self.timeout_s = timeout_s
        self.box: Sandbox | None = None
        # Held by each run and by the release: an episode cancelled mid-call (its timeout,
        # the node's stop) leaves the run going in its thread, and the sandbox must not go
        # back to the pool under it (the run ends within timeout_s).
        self._using = threading.Lock()

    async def reset(self, row: dict[str, Any]) -> str | None:
        box = self.factory()
        self.box = box
        try:
            await blocking(box.start)
            await blocking(box.put_file, env_class_runner.MODULE_FILE, self.env.source)
        except SandboxError as e:
            raise EnvClassError(f"no sandbox for the instance: {e}") from None
        outcome = await self._run({"op": "reset", "row": row}, "reset")
        return _observation(outcome.get("observation"))

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        outcome = await self._run({"op": "call", "name": name, "arguments": arguments}, name)
        if "raised" in outcome:
            return _error(str(outcome["raised"]))
        if "killed" in outcome:  # the state is the call's before: the episode may go on
            return _error(str(outcome["killed"]))
        return _text(outcome.get("content"))

    async def reward(self) -> Any:
        return (await self._run({"op": "reward"}, "get_reward")).get("reward")

    async def close(self) -> None:
        box, self.box = self.box, None
        if box is not None:
            await blocking(self._release, box)

    def _exec(self, box: Sandbox, code: str) -> ExecResult:
        with self._using:
            return box.exec(code, self.timeout_s)

    def _release(self, box: Sandbox) -> None:
        with self._using, contextlib.suppress(SandboxError):
            box.close()

    async def _run(self, request: dict[str, Any], what: str) -> dict[str, Any]:
        assert self.box is not None
        request = {**request, "class": self.env.cls.__name__}
        try:
            code = f"{_RUNNER}\nmain({json.dumps(request)!r})\n"
        except (TypeError, ValueError) as e:  # a row the task file made, not JSON: say so
            raise EnvClassError(f"{what}: its arguments are not JSON ({e})") from None
        try:
            result = await blocking(self._exec, self.box, code)
        except SandboxError as e:
            raise EnvClassError(f"{what}: the sandbox failed ({e})") from None
        if result.timed_out or result.fault in (FAULT_OOM, FAULT_PIDS):
            why = "ran past tool_timeout_s" if result.timed_out else f"was killed ({result.fault})"
            if request["op"] == "call":
                return {"killed": f"the tool {why} ({self.timeout_s:g} s); nothing it did is kept"}
            raise EnvClassError(f"{what} {why} in the sandbox ({self.timeout_s:g} s)")
        lines = result.stdout.strip().splitlines()
        try:
            outcome = json.loads(lines[-1]) if lines else None
        except ValueError:
            outcome = None
        if not isinstance(outcome, dict):
            tail = (result.error or result.stderr.strip() or result.fault).splitlines()[-1:]
            raise EnvClassError(f"{what}: the sandboxed runner failed ({''.join(tail)})")
        if "broken" in outcome:
            raise EnvClassError(str(outcome["broken"]))
        return outcome


# ── the agent ─────────────────────────────────────────────────────────────────────────


class EnvClassAgent:
    """`await agent(task, client) -> reward`: one episode of the class; see the module
    docstring."""

    def __init__(
        self,
        env: EnvClass,
        *,
        rewards: Rewards | None = None,
        max_turns: int = 3,
        tool_timeout_s: float = 5.0,
        sandbox_factory: Callable[[], Sandbox] | None = None,
    ) -> None:
        """`sandbox_factory`: the instances live in sandboxes from it, else here."""
        if not env.has_reward and rewards is None:
            raise ConfigError(
                f"environment {env.spec!r} has no get_reward() and the env gives no reward "
                "functions: nothing would score its episodes"
            )
        self.env = env
        self.rewards = rewards
        self.max_turns = max_turns
        self.tool_timeout_s = tool_timeout_s
        self.sandbox_factory = sandbox_factory
        self.tool_errors: Counter[str] = Counter()  # "tool: kind" -> calls it failed

    def instance(self) -> Instance:
        if self.sandbox_factory is not None:
            return SandboxedInstance(self.env, self.sandbox_factory, self.tool_timeout_s)
        return LocalInstance(self.env.cls, self.tool_timeout_s)

    async def __call__(self, task: Task, client: Any) -> float:
        row = task_row(task)
        instance = self.instance()
        try:
            messages = _prompt(task, await instance.reset(row))
            for _ in range(self.max_turns):
                response = await client.chat.completions.create(
                    model=MODEL, messages=messages, tools=self.env.tools or None
                )
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    text = await self._tool(instance, call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "name": call.function.name, "content": text})  # fmt: skip
            reward = _number(await instance.reward()) if self.env.has_reward else 0.0
        finally:
            await instance.close()
        return reward + await self._scored(task, messages)

    async def _tool(self, instance: Instance, name: str, arguments: str) -> str:
        """The tool message for one call; bad calls are the model's mistakes, told to it."""
        if name not in self.env.tool_names:
            return self._failed(name, "unknown tool", f"no tool named {name!r} "
                                f"(tools: {', '.join(self.env.tool_names) or 'none'})")  # fmt: skip
        try:
            parsed = json.loads(arguments or "{}")
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return self._failed(name, "bad arguments", "the arguments must be a JSON object")
        text = await instance.call(name, parsed)
        if text.startswith(_ERROR):
            self._count(name, text.removeprefix(_ERROR).split(":")[0])
        return text

    def _failed(self, name: str, kind: str, why: str) -> str:
        self._count(name, kind)
        return _error(why)

    def _count(self, name: str, kind: str) -> None:
        key = f"{name}: {kind}"
        if key not in self.tool_errors:
            log.warning("%s: tool %s (the model is told; logged once per kind)",
                        self.env.spec, key)  # fmt: skip
        self.tool_errors[key] += 1

    async def _scored(self, task: Task, messages: list[dict[str, Any]]) -> float:
        """The reward functions' weighted sum on the final reply (0 without functions)."""
        if self.rewards is None:
            return 0.0
        final: dict[str, Any] = next(
            (m for m in reversed(messages) if m.get("role") == "assistant"), {}
        )
        [scored] = await self.rewards.score(task, [str(final.get("content") or "")])
        if scored.error:
            raise EnvClassError(scored.error)
        return scored.reward


def env_class_agent(config: EnvConfig, sandbox_factory: Callable[[], Sandbox]) -> EnvClassAgent:
    """The agent of an "env_class" `[[envs]]` entry (node/agents.py make_agent_env)."""
    env = load_env_class(config.environment)
    if config.sandbox and not env.source:
        raise ConfigError(f"environment {config.environment!r} has no source file to sandbox")
    terms = config.reward_terms()
    return EnvClassAgent(
        env,
        rewards=Rewards.from_config(config, sandbox_factory) if terms else None,
        max_turns=config.max_turns,
        tool_timeout_s=config.tool_timeout_s,
        sandbox_factory=sandbox_factory if config.sandbox else None,
    )


# ── small parts ───────────────────────────────────────────────────────────────────────

# How a tool message that reports a failure begins.
_ERROR = "Error: "


def _error(why: str) -> str:
    return f"{_ERROR}{why}"


def _text(value: Any) -> str:
    """A tool's result as the model sees it: str(), as TRL does, bounded."""
    return str(value)[: env_class_runner.MAX_TEXT_CHARS]


def _observation(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EnvClassError(f"reset returned a {type(value).__name__}, not a string or None")
    return value


def _number(value: Any) -> float:
    """get_reward's value as a reward: a finite number (True and False are 1 and 0)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float) or not math.isfinite(value):
        shown = repr(value) if isinstance(value, float) else f"a {type(value).__name__}"
        raise EnvClassError(f"get_reward returned {shown}, not a finite number")
    return float(value)


def _prompt(task: Task, observation: str | None) -> list[dict[str, Any]]:
    """The row's prompt as messages, reset's observation appended to the last one (TRL
    appends it to the last message's text, as is)."""
    messages: list[dict[str, Any]] = list(task.messages())
    if observation:
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
    return messages
