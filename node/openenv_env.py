"""OpenEnv environments: an OpenEnv server's episodes (openenv-core 0.3), played by the
policy through the episode's OpenAI endpoint, on the AgentEnv of node/agents.py.

    AgentEnv.start ──▶ OpenEnvAgent.start (once): openenv_app ──▶ Server: `python -m uvicorn
        APP` on a free loopback port, /health answered; or openenv_url, /health answered.
        No openenv_action: the action's one text field, read from /schema. Else ConfigError:
        the node stops with one line.
    each episode (at most openenv_sessions at once; AgentEnv.max_episodes):
        a WebSocket session (openenv's EnvClient, /ws) ── reset(**task.fields, episode_id)
        up to max_turns, until done:
            observation ──render──▶ user turn ──client.chat.completions──▶ reply (the policy)
            reply ──to_action──▶ step(action) ──▶ observation, reward, done
        reward: the sum of the steps' rewards (the return, as gym loops add them), or the last
    AgentEnv.close ──▶ OpenEnvAgent.close: the server process stopped (SIGTERM, then SIGKILL)

HTTP /reset and /step are no use to an episode: openenv's server makes a fresh environment
for each HTTP request, so only a WebSocket session keeps one across its steps.

Faults. What the server does wrong is a failed episode: unreachable, a refused session
(more sessions than its max_concurrent_envs), an answer that is not JSON, misses
observation or done, or has a reward that is not a finite number, no answer within
openenv_timeout_s, the connection lost (the server died), its environment raised. The
episode raises; AgentEnv discards it (never trained) and plays it again, up to its
attempts (counted: `openenv/episodes_failed`). What the model does wrong is a lesson: a
reply that to_action cannot turn into an action, or that the server refuses as invalid
(VALIDATION_ERROR), ends the episode with the rewards it has (`openenv/invalid_actions`,
logged once per kind). A server agentjet started that has exited is started again by the
next episode (`openenv/server_restarts`, logged each time); a start that fails fails that
episode. A server that hangs without exiting fails its episodes by timeout, and is not
restarted. Every process is the node's child: stopped by PID at close, and by the node's
lifeline (agentjet/lifeline.py) when the node dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from agentjet.agent_runner import load_callable
from agentjet.config import EnvConfig
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from agentjet.roles import wait_for

log = logging.getLogger(__name__)

# How often a starting server's /health is asked.
HEALTH_POLL_S = 0.2
# A server being stopped gets this long after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0
# A closing session waits this long for the server to close its end first.
CLOSE_WAIT_S = 5.0
# The model the episodes' calls name: the grant's policy (node/openai_api.py).
MODEL = "policy"
# OpenEnv's ResetRequest bounds episode ids to this many characters.
EPISODE_ID_CHARS = 255
# The error code openenv's server answers an action that fails its Action model with.
INVALID_ACTION = "VALIDATION_ERROR"
INSTALL = "name = 'openenv' needs the openenv-core package: pip install 'agentjet[openenv]'"


class OpenEnvFault(Exception):
    """The server failed the episode: it is discarded and played again."""


class Refused(OpenEnvFault):
    """The server answered with an error message; `code` is openenv's WSErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"the server refused ({code}): {message}")
        self.code = code


# ── the server's answers and the model's turns (pure) ─────────────────────────────────


@dataclass(frozen=True)
class Result:
    """A reset's or a step's answer, checked."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


def parse_result(payload: Any) -> Result:
    """The `data` of an observation message, checked; OpenEnvFault saying what is wrong."""
    if not isinstance(payload, dict):
        raise OpenEnvFault(f"the server answered {type(payload).__name__}, not an object")
    observation, done, reward = (payload.get(k) for k in ("observation", "done", "reward"))
    if not isinstance(observation, dict):
        raise OpenEnvFault("the server's answer has no observation object")
    if not isinstance(done, bool):
        raise OpenEnvFault(f"the server's answer has no done flag (done = {done!r})")
    if reward is not None:  # OpenEnv's Observation.reward: bool | int | float | None
        if not isinstance(reward, int | float) or not math.isfinite(reward):
            raise OpenEnvFault(f"the server's reward {reward!r} is not a finite number")
        reward = float(reward)
    return Result(observation, reward, done)


def text_field(action_schema: Any) -> str | None:
    """The action's one text field by its JSON schema (/schema's "action"): the one string
    property, every other one optional; None when there is no such field."""
    properties = action_schema.get("properties") if isinstance(action_schema, dict) else None
    if not isinstance(properties, dict):
        return None
    texts = [
        name for name, spec in properties.items()
        if name != "metadata" and isinstance(spec, dict) and spec.get("type") == "string"
    ]  # fmt: skip
    required = set(action_schema.get("required") or ())
    return texts[0] if len(texts) == 1 and required <= {texts[0]} else None


def render_observation(observation: dict[str, Any]) -> str:
    """The default user turn: the observation's one text field, else its JSON."""
    texts = [value for value in observation.values() if isinstance(value, str)]
    return texts[0] if len(texts) == 1 else json.dumps(observation, ensure_ascii=False)


def reset_kwargs(task: Task) -> dict[str, Any]:
    """The reset's keyword arguments: the task's fields (a task file row's other columns;
    a generated task's seed) and an episode id of its own."""
    kwargs = dict(task.fields)
    kwargs.setdefault("episode_id", f"{uuid.uuid4().hex[:12]}-{task.id}"[:EPISODE_ID_CHARS])
    return kwargs


def as_action(action: Any) -> dict[str, Any]:
    """to_action's result as the step's JSON: a dict, or an OpenEnv Action (pydantic)."""
    if isinstance(action, dict):
        return action
    if hasattr(action, "model_dump"):
        return dict(action.model_dump())
    raise TypeError(f"an action is a dict or an OpenEnv Action, not {type(action).__name__}")


def episode_reward(rewards: list[float | None], how: str) -> float:
    """The episode's reward from its steps' ("sum" or "last"); a step without one gave 0."""
    steps = [r or 0.0 for r in rewards]
    if how == "last":
        return steps[-1] if steps else 0.0
    return sum(steps)


# ── the server ────────────────────────────────────────────────────────────────────────


def free_port() -> int:
    """A loopback port free now (the server binds it a moment later; a clash is a failed
    start, and the next episode starts it again on another)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _http(url: str, timeout_s: float) -> httpx.AsyncClient:
    # A proxy in the environment must not catch a server on this host.
    local = "//127.0.0.1" in url or "//localhost" in url
    return httpx.AsyncClient(timeout=timeout_s, trust_env=not local)


async def get_json(url: str, timeout_s: float) -> Any:
    """GET url's JSON; OpenEnvFault when it cannot be had."""
    try:
        async with _http(url, timeout_s) as http:
            response = await http.get(url)
            response.raise_for_status()
            return response.json()
    except (httpx.HTTPError, ValueError) as e:
        raise OpenEnvFault(f"GET {url}: {type(e).__name__}: {e}") from None


class Server:
    """openenv_app under uvicorn on a free loopback port, run from the node's current
    directory (uvicorn puts it first on the import path), its errors on the node's stderr."""

    def __init__(self, app: str, start_timeout_s: float) -> None:
        self.app = app
        self.start_timeout_s = start_timeout_s
        self.process: asyncio.subprocess.Process | None = None
        self.url = ""

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def start(self) -> str:
        """Start it; its URL once /health answers. OpenEnvFault (the process stopped) when
        it exits first or has not answered within start_timeout_s."""
        port = free_port()
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "uvicorn", self.app,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        try:
            await self._healthy()
        except BaseException:
            await self.stop()
            raise
        log.info("OpenEnv server %s serving at %s (pid %d)", self.app, self.url, self.process.pid)
        return self.url

    async def _healthy(self) -> None:
        assert self.process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        why = ""
        while loop.time() < deadline:
            if self.process.returncode is not None:
                raise OpenEnvFault(
                    f"uvicorn {self.app} exited with code {self.process.returncode} "
                    "(its error is in the node's log)"
                )
            try:
                await get_json(f"{self.url}/health", self.start_timeout_s)
                return
            except OpenEnvFault as e:
                why = str(e)
            await asyncio.sleep(HEALTH_POLL_S)  # polling a starting process
        raise OpenEnvFault(
            f"uvicorn {self.app}: no answer within {self.start_timeout_s:g} s: {why}"
        )

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_GRACE_S; reaped either way."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            process.terminate()
            try:
                await wait_for(process.wait(), STOP_GRACE_S)
            except TimeoutError:
                process.kill()
        await process.wait()


# ── the agent ─────────────────────────────────────────────────────────────────────────


class OpenEnvAgent:
    """See the module docstring: AgentEnv's agent for an "openenv" entry."""

    def __init__(self, config: EnvConfig, session_class: type) -> None:
        self.url = config.openenv_url.rstrip("/")
        self.server = Server(config.openenv_app, config.openenv_start_timeout_s) if (
            config.openenv_app
        ) else None  # fmt: skip
        self.to_action: Callable[..., Any] | None = None
        if config.openenv_action:
            self.to_action = load_callable(config.openenv_action, "openenv_action")
        self.render: Callable[[dict[str, Any]], Any] = render_observation
        if config.openenv_observation:
            self.render = load_callable(config.openenv_observation, "openenv_observation")
        self.how = config.openenv_reward
        self.max_turns = config.max_turns
        self.timeout_s = config.openenv_timeout_s
        self.max_episodes = config.openenv_sessions  # AgentEnv's bound on open episodes
        self.session_class = session_class
        self.field = ""  # the action's text field, without to_action
        self.counts = {"episodes_failed": 0, "invalid_actions": 0, "server_restarts": 0}
        self.closed = False
        self._restarting = asyncio.Lock()
        self._said: set[str] = set()

    def where(self) -> str:
        return f"openenv_app {self.server.app!r}" if self.server else f"openenv_url {self.url}"

    async def start(self) -> None:
        """The server up and its action known; ConfigError (one line) otherwise."""
        try:
            if self.server is not None:
                self.url = await self.server.start()
            else:
                await get_json(f"{self.url}/health", self.timeout_s)
            if self.to_action is None:
                schema = await get_json(f"{self.url}/schema", self.timeout_s)
                field = text_field(schema.get("action") if isinstance(schema, dict) else None)
                if field is None:
                    raise ConfigError(
                        f"envs: {self.where()}: its action is not one text field "
                        f"(schema: {json.dumps(schema)[:300]}); set openenv_action = "
                        '"module:function" turning (reply, observation) into an action'
                    )
                self.field = field
        except OpenEnvFault as e:
            await self.close()
            raise ConfigError(f"envs: {self.where()}: {e}") from None
        except ConfigError:
            await self.close()
            raise

    async def close(self) -> None:
        self.closed = True
        if self.server is not None:
            await self.server.stop()

    def metrics(self) -> dict[str, float]:
        return {f"openenv/{name}": count for name, count in self.counts.items()}

    async def __call__(self, task: Task, client: Any) -> float:
        try:
            return await self._play(task, client)
        except Exception:  # AgentEnv fails the episode; this counts it
            self.counts["episodes_failed"] += 1
            raise

    async def _play(self, task: Task, client: Any) -> float:
        session = self.session_class(
            await self._server_url(),
            connect_timeout_s=self.timeout_s,
            message_timeout_s=self.timeout_s,
        )
        rewards: list[float | None] = []
        try:
            result = await self._exchange(session.reset(**reset_kwargs(task)), "reset")
            messages: list[dict[str, str]] = []
            for _ in range(self.max_turns):
                if result.done:
                    break
                messages.append({"role": "user", "content": str(self.render(result.observation))})
                response = await client.chat.completions.create(model=MODEL, messages=messages)
                reply = response.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": reply})
                action = self._action(reply, result.observation)
                if action is None:
                    break
                try:
                    result = await self._exchange(session.step(action), "step")
                except Refused as e:
                    if e.code != INVALID_ACTION:
                        raise
                    self._invalid("the server refused the action as invalid", str(e))
                    break
                rewards.append(result.reward)
        finally:
            with contextlib.suppress(Exception):  # a dead server's socket: nothing to close
                await wait_for(session.close(), self.timeout_s)
        return episode_reward(rewards, self.how)

    async def _exchange(self, call: Awaitable[Any], what: str) -> Result:
        """A reset or step, answered and checked within openenv_timeout_s."""
        try:
            return parse_result(await wait_for(call, self.timeout_s))
        except Refused as e:
            if e.code == "CAPACITY_REACHED":  # more sessions than the server holds
                hint = "set openenv_sessions to its max_concurrent_envs"
                raise OpenEnvFault(f"{e}; {hint}") from None
            raise
        except OpenEnvFault:
            raise
        except TimeoutError:
            raise OpenEnvFault(f"{what}: no answer within {self.timeout_s:g} s") from None
        except json.JSONDecodeError as e:
            raise OpenEnvFault(f"{what}: the server's answer is not JSON ({e})") from None
        except Exception as e:  # noqa: BLE001 - connection lost, refused, closed: the server's
            raise OpenEnvFault(f"{what}: {type(e).__name__}: {e}") from None

    def _action(self, reply: str, observation: dict[str, Any]) -> dict[str, Any] | None:
        """The reply as the step's action, or None (counted) when it is none."""
        if self.to_action is None:
            return {self.field: reply}
        try:
            return as_action(self.to_action(reply, observation))
        except Exception as e:  # noqa: BLE001 - the model's reply is not an action
            self._invalid(f"openenv_action raised {type(e).__name__}", str(e))
            return None

    def _invalid(self, kind: str, detail: str) -> None:
        self.counts["invalid_actions"] += 1
        if kind not in self._said:
            self._said.add(kind)
            log.warning("openenv: a reply was no action, the episode ends with its rewards "
                        "so far (%s: %s; said once)", kind, detail[:200])  # fmt: skip

    async def _server_url(self) -> str:
        """The server's URL; one agentjet started and that has exited, started again."""
        if self.server is None or self.server.alive:
            return self.url
        async with self._restarting:
            if self.closed:
                raise OpenEnvFault("the environment is closed")
            if not self.server.alive:
                code = None if self.server.process is None else self.server.process.returncode
                log.warning("openenv: the server %s exited (code %s); starting it again",
                            self.server.app, code)  # fmt: skip
                self.counts["server_restarts"] += 1
                self.url = await self.server.start()
        return self.url


def session_class() -> type:
    """openenv's WebSocket client, its answers handed back raw (parse_result checks them)
    and an error message raised as Refused with its code; ConfigError without openenv."""
    try:
        from openenv.core.env_client import EnvClient
    except ImportError:
        raise ConfigError(f"envs: {INSTALL}") from None

    class Session(EnvClient):
        def _step_payload(self, action: dict[str, Any]) -> dict[str, Any]:
            return action

        def _parse_result(self, payload: Any) -> Any:
            return payload

        def _parse_state(self, payload: Any) -> Any:
            return payload

        async def disconnect(self) -> None:
            # openenv's disconnect closes the socket right after its "close" message, and
            # the server, closing too, logs a traceback per session; wait for its close.
            ws: Any = getattr(self, "_ws", None)
            if ws is not None:
                with contextlib.suppress(Exception):
                    await self._send({"type": "close"})
                    await wait_for(ws.wait_closed(), CLOSE_WAIT_S)
                with contextlib.suppress(Exception):
                    await ws.close()
                self._ws = None

        async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
            await self._send(message)
            response = await self._receive()
            if not isinstance(response, dict):
                raise OpenEnvFault(f"the server sent {type(response).__name__}, not a message")
            if response.get("type") == "error":
                data = response.get("data")
                data = data if isinstance(data, dict) else {}
                raise Refused(str(data.get("code", "UNKNOWN")), str(data.get("message", "")))
            return response

    return Session


def make_openenv_agent(config: EnvConfig) -> OpenEnvAgent:
    """The agent of an "openenv" `[[envs]]` entry (make_agent_env's dispatch)."""
    return OpenEnvAgent(config, session_class())
