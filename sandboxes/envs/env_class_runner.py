"""The program an "env_class" environment with `sandbox = true` runs in its sandbox, once
per call on the episode's instance (sandboxes/envs/env_class.py sends this file's source
with one request appended as `main(REQUEST_JSON)`).

    work dir: agentjet_env_module.py (the class's module, copied in at the episode's start)
              agentjet_env_state.pickle (the instance between calls)

    {"op": "reset", "class", "row"}        instance = Class(); reset(**row); pickled
    {"op": "call", "class", "name", "arguments"}   unpickled; name(**arguments); pickled
    {"op": "reward", "class"}              unpickled; get_reward()
         ──▶ stdout's last line, one JSON object: the outcome (below)

A sandbox runs programs to completion (each exec forks a fresh child of the sandbox's warm
interpreter and ends every process it started), so no instance can live on between calls:
its state does, pickled in the work dir, which persists for the episode. A call that times
out or is killed leaves the state of the call before it.

Outcomes: {"observation": str | None}, {"content": str} (a tool's result as text),
{"raised": "Type: message"} (a tool raised: the model is told), {"reward": value} (any
JSON value: the host checks it), {"broken": why} (the class failed where the episode
cannot go on). The class's own prints go to stderr, so they never mix with the outcome.
Standard library only: the docker image has python3 and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import pickle
import sys
from typing import Any

MODULE_NAME = "agentjet_env_module"
MODULE_FILE = MODULE_NAME + ".py"
STATE_FILE = "agentjet_env_state.pickle"
# A tool's result is cut to this many characters: the model's context is the limit anyway.
MAX_TEXT_CHARS = 8192


class Broken(Exception):
    """The class failed where the episode cannot go on."""


def main(request_json: str) -> None:
    request = json.loads(request_json)
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        try:
            outcome = handle(request)
        except Broken as e:
            outcome = {"broken": str(e)}
    out.write("\n" + json.dumps(outcome) + "\n")
    out.flush()


def handle(request: dict[str, Any]) -> dict[str, Any]:
    cls = getattr(load_module(), request["class"])
    op = request["op"]
    if op == "reset":
        instance = expect(cls, "the class's __init__")
        observation = expect(instance.reset, "reset", **request["row"])
        if observation is not None and not isinstance(observation, str):
            raise Broken(f"reset returned a {type(observation).__name__}, not a string or None")
        save(instance)
        return {"observation": observation}
    instance = restore()
    if op == "reward":
        value = expect(instance.get_reward, "get_reward")
        if not isinstance(value, int | float):  # bool is an int: the host takes it as 1 or 0
            raise Broken(f"get_reward returned a {type(value).__name__}, not a number")
        return {"reward": value}
    try:
        value = outcome_of(getattr(instance, request["name"]), **request["arguments"])
    except Exception as e:  # noqa: BLE001 - the tool's own failure: the model is told
        save(instance)
        return {"raised": f"{type(e).__name__}: {e}"[:MAX_TEXT_CHARS]}
    save(instance)
    return {"content": str(value)[:MAX_TEXT_CHARS]}


def load_module() -> Any:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, MODULE_FILE)
    if spec is None or spec.loader is None:
        raise Broken(f"{MODULE_FILE} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # pickle finds the class by its module's name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a package missing in the sandbox, say
        raise Broken(f"the module raised {type(e).__name__} on import: {e}") from None
    return module


def outcome_of(fn: Any, *args: Any, **kwargs: Any) -> Any:
    value = fn(*args, **kwargs)
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def expect(fn: Any, what: str, **kwargs: Any) -> Any:
    try:
        return outcome_of(fn, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise Broken(f"{what} raised {type(e).__name__}: {e}") from None


def save(instance: Any) -> None:
    try:
        data = pickle.dumps(instance)
    except Exception as e:  # noqa: BLE001 - an open file, a socket, a lock on the instance
        raise Broken(
            f"the instance cannot be kept between sandboxed calls ({type(e).__name__}: {e}); "
            "keep only picklable state on it, or use sandbox = false"
        ) from None
    with open(STATE_FILE, "wb") as f:
        f.write(data)


def restore() -> Any:
    try:
        with open(STATE_FILE, "rb") as f:
            return pickle.load(f)
    except Exception as e:  # noqa: BLE001
        raise Broken(f"the instance's state is gone ({type(e).__name__}: {e})") from None
