"""verifiers environments (PrimeIntellect's `verifiers` 0.4.x, its v1 Taskset API): the one
module that imports the package; the rest of agentjet sees tasks, tool schemas and rewards.

    [[envs]] name = "verifiers", verifiers_env = "my_pkg", verifiers_args = {...}
        │ check_env (every config load): import my_pkg, find the vf.Taskset subclass its
        │ __all__ exports, refuse what agentjet cannot run (one ConfigError naming the key)
        ▼
    VerifiersTaskset.load(env): the taskset built with verifiers_args (its TasksetConfig)
        │ tasks() / eval_tasks(): its rows (at most verifiers_max_tasks) as agentjet Tasks:
        │     id, prompt (system prompt first), answer, fields = the row's own fields and
        │     "verifiers", the TaskData as JSON (so any process rebuilds the task from it)
        ▼   coordinator and rollout fallback (agentjet/tasks.py TaskSource), held-out eval
    rollout node, per episode (node/verifiers_env.py, on the episode's OpenAI endpoint):
        vf_task(task) ─▶ opening(vf_task) messages ─▶ Tools.open(vf_task): its Toolsets'
        @vf.tool methods, called in-process ─▶ chat loop ─▶ score(vf_task, messages): a
        verifiers Trace of the conversation scored by the task's @vf.reward functions
        (weighted sum; @vf.metric recorded, not summed)

Supported: verifiers 0.4.x Tasksets played by agentjet's own chat loop, which stands in
for verifiers' `null` harness (a system prompt, the prompt, tool calls until a reply
without one). Not supported, refused at config load: the v0 API (`load_environment()`
returning vf.SingleTurnEnv / MultiTurnEnv / ToolEnv: verifiers 0.4.0 no longer has it);
packages exporting their own Env (multi-agent, user simulators) or Harness; tasks that
need a Runtime (a container, setup/finalize hooks, rewards taking `runtime`), and @vf.stop
or @vf.intercept hooks. A reward that raises, hangs or returns a non-finite number fails
its episode (VerifiersError); agentjet's agent environment counts and retries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from agentjet.errors import AgentjetError, ConfigError
from agentjet.protocol import Message, Task

if TYPE_CHECKING:
    from agentjet.config_schema import EnvConfig

log = logging.getLogger(__name__)

SUPPORTED = "0.4."  # the verifiers releases whose v1 API this module is written against
INSTALL = "pip install 'agentjet[verifiers]'"


class VerifiersError(AgentjetError):
    """A verifiers environment misbehaved in one episode (its reward raised, returned junk,
    or a tool could not be set up): that episode fails, counted; the run goes on."""


def _verifiers(where: str) -> Any:
    """The `verifiers.v1` package, or one ConfigError naming `where` and what to install."""
    try:
        import verifiers
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError(f"{where}: needs the verifiers package: {INSTALL}") from None
    if not verifiers.__version__.startswith(SUPPORTED):
        raise ConfigError(
            f"{where}: verifiers {verifiers.__version__} is installed; agentjet supports "
            f"verifiers {SUPPORTED}x ({INSTALL})"
        )
    return vf


def taskset_class(module_name: str, where: str) -> type[Any]:
    """The vf.Taskset subclass `module_name` exports (verifiers' own rule: one, named in
    `__all__`), after the checks of what agentjet can run; ConfigError naming `where`."""
    vf = _verifiers(where)
    from verifiers.v1.utils.loaders import import_taskset

    try:
        module = import_taskset(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{where}: {module_name!r} cannot be imported: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - the user's package failing to import is their error
        raise ConfigError(
            f"{where}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from None
    exported = [getattr(module, name, None) for name in getattr(module, "__all__", [])]
    classes = [c for c in exported if isinstance(c, type)]
    tasksets = [c for c in classes if issubclass(c, vf.Taskset) and c is not vf.Taskset]
    if not tasksets:
        if hasattr(module, "load_environment"):
            raise ConfigError(
                f"{where}: {module_name!r} has load_environment(), the verifiers v0 API "
                "(vf.SingleTurnEnv, MultiTurnEnv, ToolEnv with a Rubric), which verifiers "
                f"{SUPPORTED}x no longer has; agentjet runs v1 environments: export a "
                "vf.Taskset subclass in the package's __all__"
            )
        raise ConfigError(
            f"{where}: {module_name!r} is no verifiers environment: its __all__ exports no "
            "vf.Taskset subclass"
        )
    if len(tasksets) > 1:
        names = ", ".join(c.__name__ for c in tasksets)
        raise ConfigError(f"{where}: {module_name!r} exports several Tasksets ({names}); one")
    for base, what in ((vf.Env, "its own Env"), (vf.Harness, "its own Harness")):
        if any(issubclass(c, base) for c in classes):
            raise ConfigError(
                f"{where}: {module_name!r} exports {what}; agentjet plays a taskset with its "
                "own chat loop (verifiers' `null` harness), one agent, no runtime"
            )
    taskset: type[Any] = tasksets[0]
    _check_task_class(taskset.task_type(), vf, where)
    return taskset


def _check_task_class(task_cls: type[Any], vf: Any, where: str) -> None:
    """Refuse tasks whose behaviour needs what agentjet does not run: a Runtime (container,
    setup/finalize hooks, rewards taking `runtime`) or hooks into the harness's loop."""
    name = task_cls.__name__
    if task_cls.NEEDS_CONTAINER:
        raise ConfigError(f"{where}: task {name} needs a container runtime (not supported)")
    for hook in ("setup", "finalize", "stage_verifier"):
        if getattr(task_cls, hook) is not getattr(vf.Task, hook):
            raise ConfigError(
                f"{where}: task {name} overrides {hook}(), which needs a verifiers Runtime "
                "(a sandbox or container); agentjet runs tasks without one (not supported)"
            )
    for attr in ("stop", "intercept"):
        if any(hasattr(fn, attr) for fn in vars(task_cls).values() if callable(fn)):
            raise ConfigError(f"{where}: task {name} has @vf.{attr} hooks (not supported)")
    for fn in vars(task_cls).values():
        if callable(fn) and (hasattr(fn, "reward") or hasattr(fn, "metric")):
            param = inspect.signature(fn).parameters.get("runtime")
            if param is not None and param.default is inspect.Parameter.empty:
                raise ConfigError(
                    f"{where}: {name}.{fn.__name__} takes a runtime, which agentjet does not "
                    "provide (not supported)"
                )


_TASKSETS: dict[bytes, VerifiersTaskset] = {}  # VerifiersTaskset.of's, by the entry's keys


def check_env(env: EnvConfig, i: int) -> None:
    """Config load: the package imports and holds a Taskset agentjet can run, and its
    config accepts verifiers_args and verifiers_eval_args (one ConfigError naming the key)."""
    where = f"config error at envs.{i}.verifiers_env"
    if not env.verifiers_env:
        raise ConfigError(f"{where}: a verifiers environment names its package")
    cls = taskset_class(env.verifiers_env, where)
    for key, args in (("verifiers_args", env.verifiers_args),
                      ("verifiers_eval_args", env.verifiers_eval_args)):  # fmt: skip
        _taskset_config(cls, env.verifiers_env, args, f"config error at envs.{i}.{key}")


def _taskset_config(cls: type[Any], module_name: str, args: dict[str, Any], where: str) -> Any:
    from pydantic import ValidationError
    from verifiers.v1.utils.generic import concrete_type

    vf = _verifiers(where)
    config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        return config_cls.model_validate({**args, "id": module_name})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ConfigError(f"{where}: {problems}") from None


class VerifiersTaskset:
    """One `[[envs]]` entry's taskset: its rows as Tasks, and its tasks rebuilt from them.
    `of(env)` makes it once per process: the task source, held-out evaluation and the agent
    all read the same one, and its rows are read once."""

    @classmethod
    def of(cls, env: EnvConfig) -> VerifiersTaskset:
        key = msgspec.json.encode(
            [env.name, env.verifiers_env, env.verifiers_args, env.verifiers_eval_args,
             env.verifiers_max_tasks]
        )  # fmt: skip
        if key not in _TASKSETS:
            _TASKSETS[key] = cls(env)
        return _TASKSETS[key]

    def __init__(self, env: EnvConfig) -> None:
        where = f"environment {env.name!r} (verifiers_env {env.verifiers_env!r})"
        self.env = env
        self.cls = taskset_class(env.verifiers_env, where)
        self.task_cls = self.cls.task_type()
        config = _taskset_config(self.cls, env.verifiers_env, env.verifiers_args, where)
        self.taskset = self.cls(config)
        self.skipped = 0  # rows left out: no prompt, a duplicate id, a prompt we cannot show
        self._tasks: list[Task] | None = None
        self._eval_tasks: list[Task] | None = None

    def tasks(self) -> list[Task]:
        """The training rows (at most verifiers_max_tasks), read once."""
        if self._tasks is None:
            self._tasks = self._rows(self.taskset)
        return self._tasks

    def eval_tasks(self) -> list[Task]:
        """The held-out rows: the taskset built with verifiers_eval_args; [] when unset."""
        if not self.env.verifiers_eval_args:
            return []
        if self._eval_tasks is None:
            where = f"environment {self.env.name!r}: verifiers_eval_args"
            args = self.env.verifiers_args | self.env.verifiers_eval_args
            config = _taskset_config(self.cls, self.env.verifiers_env, args, where)
            self._eval_tasks = self._rows(self.cls(config))
        return self._eval_tasks

    def _rows(self, taskset: Any) -> list[Task]:
        tasks: dict[str, Task] = {}
        try:
            for vf_task in taskset.take(self.env.verifiers_max_tasks):
                task = _as_task(vf_task.data, self.env.name)
                if task is None or task.id in tasks:
                    self.skipped += 1
                    continue
                tasks[task.id] = task
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the package's own load() failing
            raise ConfigError(
                f"environment {self.env.name!r}: {self.env.verifiers_env}'s load() raised "
                f"{type(e).__name__}: {e}"
            ) from None
        if self.skipped:
            log.warning("%s: %d rows left out (no prompt, a duplicate id, or a prompt with "
                        "tool messages)", self.env.name, self.skipped)  # fmt: skip
        if not tasks:
            raise ConfigError(f"environment {self.env.name!r}: the taskset has no usable rows")
        return list(tasks.values())

    def vf_task(self, task: Task) -> Any:
        """The verifiers Task a row of this taskset was made from."""
        data = self.task_cls.data_type().model_validate(task.fields["verifiers"])
        return self.task_cls(data, self.taskset.config.task)


def _as_task(data: Any, env_name: str) -> Task | None:
    """A verifiers TaskData as an agentjet Task; None for a row agentjet cannot play (no
    prompt: a user would open the conversation; or earlier tool turns in the prompt)."""
    from verifiers.v1.task import TaskData
    from verifiers.v1.types import content_text

    if data.prompt is None:
        return None
    messages: list[Message] = []
    if data.system_prompt:
        messages.append(Message(role="system", content=data.system_prompt))
    if isinstance(data.prompt, str):
        messages.append(Message(role="user", content=data.prompt))
    else:
        for message in data.prompt:
            if message.role == "tool":
                return None
            messages.append(Message(role=message.role, content=content_text(message.content)))
    dump = data.model_dump(mode="json", exclude_defaults=True)
    own = {k: v for k, v in dump.items() if k not in TaskData.model_fields and k != "answer"}
    prompt: str | tuple[Message, ...] = (
        data.prompt if len(messages) == 1 and isinstance(data.prompt, str) else tuple(messages)
    )
    return Task(
        id=str(data.id if data.id is not None else data.idx),
        env=env_name,
        prompt=prompt,
        answer=dump.get("answer"),
        fields=own | {"verifiers": dump},
    )


def opening(vf_task: Any) -> list[dict[str, Any]]:
    """The conversation the model starts from, as OpenAI chat messages."""
    from verifiers.v1.dialects.chat import message_to_wire

    data = vf_task.data
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [message_to_wire(m) for m in data.prompt]
    return messages


@dataclass
class Tools:
    """An episode's tools: each Toolset's @vf.tool methods, as OpenAI tool schemas, called
    in this process (not as MCP servers in a runtime)."""

    schemas: list[dict[str, Any]] = field(default_factory=list)
    calls: dict[str, Callable[[dict[str, Any]], Any]] = field(default_factory=dict)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, taskset: VerifiersTaskset, vf_task: Any) -> AsyncIterator[Tools]:
        """The task's toolsets (per episode) and the taskset's (shared), set up for
        `vf_task`; VerifiersError when one cannot be."""
        from mcp.server.mcpserver.tools.base import Tool as McpTool
        from verifiers.v1.utils.decorators import discover_decorated

        tools = cls()
        try:
            toolsets = [
                *type(vf_task).toolsets(vf_task.config),
                *taskset.taskset.toolsets(taskset.taskset.config),
            ]
            for toolset in toolsets:
                await toolset.setup()
                await toolset.setup_task(vf_task)
                prefix = toolset.server_name
                for fn in discover_decorated(toolset, "tool"):
                    raw = getattr(fn, "tool_name", None) or fn.__name__
                    name = f"{prefix}_{raw}" if prefix else raw
                    tool = McpTool.from_function(fn, name=name, description=fn.__doc__)
                    tools.schemas.append({"type": "function", "function": {
                        "name": name, "description": tool.description.strip(),
                        "parameters": tool.parameters}})  # fmt: skip
                    tools.calls[name] = _caller(tool)
        except Exception as e:  # noqa: BLE001 - the package's toolset failing is an outcome
            raise VerifiersError(f"a toolset could not be set up: {type(e).__name__}: {e}") from e
        yield tools

    async def call(self, name: str, arguments: str) -> str:
        """A tool call's result as the model will read it; a failing call is text too (the
        model sees the error, as verifiers' chat program shows it)."""
        if name not in self.calls:
            return f"error: unknown tool {name!r}"
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            return f"error: invalid JSON in tool arguments ({e})"
        if not isinstance(args, dict):
            return "error: tool arguments must be a JSON object"
        try:
            result = await self.calls[name](args)
        except Exception as e:  # noqa: BLE001 - shown to the model, as an MCP tool error is
            return f"error: {type(e).__name__}: {e}"
        return result if isinstance(result, str) else json.dumps(result, default=str)


def _caller(tool: Any) -> Callable[[dict[str, Any]], Any]:
    async def call(args: dict[str, Any]) -> Any:
        return await tool.fn_metadata.call_fn_with_arg_validation(
            tool.fn, tool.is_async, args, None
        )

    return call


async def score(vf_task: Any, messages: list[dict[str, Any]], opened: int, stop: str) -> float:
    """The task's @vf.reward functions over the episode (messages[opened:] are the model's
    turns and the tool results), their weighted sum; VerifiersError for one that raises or
    gives no finite number. `stop`: why the conversation ended (the trace's stop_condition)."""
    vf = _verifiers("verifiers scoring")
    import verifiers
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, TraceTask, VersionInfo

    trace = vf.Trace(
        # given, not defaulted: the default asks git for the package's commit
        verifiers=VersionInfo(version=verifiers.__version__),
        task=TraceTask(
            type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash
        ),
        state=state_cls(type(vf_task))(),
        agent=AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())),
    )
    trace.nodes = [
        MessageNode(
            parent=i - 1 if i else None,
            message=_vf_message(m),
            sampled=i >= opened and m["role"] == "assistant",
        )  # fmt: skip
        for i, m in enumerate(messages)
    ]
    trace.is_completed, trace.ok, trace.stop_condition = True, True, stop
    try:
        await vf_task.score(trace)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the package's rewards failing is an outcome
        cause = e.__cause__ or e
        raise VerifiersError(f"a reward raised {type(cause).__name__}: {cause}") from None
    for name, reward in trace.rewards.items():
        if reward is None or not math.isfinite(reward.value):
            got = "nothing" if reward is None else f"{reward.score} (weight {reward.weight})"
            raise VerifiersError(f"reward {name!r} gave {got}, not a finite number")
    return float(trace.reward)


def _vf_message(message: dict[str, Any]) -> Any:
    """An OpenAI chat message as a verifiers Message (tool calls flattened as it keeps them)."""
    from pydantic import TypeAdapter
    from verifiers.v1.types import Message as VfMessage

    message = dict(message)
    if message.get("tool_calls"):
        message["tool_calls"] = [
            {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message["tool_calls"]
        ]
    if message.get("content") is None and message["role"] != "assistant":
        message["content"] = ""
    keep = {"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"}
    return TypeAdapter(VfMessage).validate_python({k: v for k, v in message.items() if k in keep})
