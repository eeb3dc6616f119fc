"""`agentjet agent`: play a rollout node's agent episodes from another process or machine.

    loop (× concurrency):  POST {rollout}/agents/claim ──▶ episode: task, base_url, api_key
                           reward = await agent(task, AsyncOpenAI(base_url, api_key))
                           POST /agents/{id}/finish {"reward"}   (or /abort when the agent failed)
    Ctrl-C / SIGTERM:      the episodes still held are aborted (bounded), then exit 0

No torch and no model here: the agent's model calls go to the rollout node's endpoint,
which samples them with the current policy and records them for training. Edit the agent
and restart this process while training goes on; an episode it abandons is reclaimed by
the node after its idle timeout and played again. Tasks arrive without their answer or
check: for verifiable environments the node's judge scores the transcript.

The runner outlives the node and its own agent: an agent that raises (or returns no
number) costs its episode only (aborted, played again by the node), and while the node
cannot be reached, stops, or refuses claims, every request is tried again each `RETRY_S`,
said once ("waiting for the rollout node ...") and again once it answers ("connected").
An episode the node no longer knows (it restarted, or expired the episode) is lost, and
counted. Only a refused agent token (401 on a claim) ends the runner: retrying cannot help.

The user's module is imported like uvicorn imports an app: from the current directory
first (or `--app-dir`), then the installed packages.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agentjet.episode import Reward, as_reward
from agentjet.errors import AgentjetError, ConfigError
from agentjet.protocol import Task

log = logging.getLogger(__name__)

# How long one claim waits on the node for an episode before asking again.
CLAIM_WAIT_S = 10.0
# Pause before trying a request again that the node did not answer (or refused for now).
RETRY_S = 2.0
# A request the node accepted but has not answered after this long (beyond a claim's own
# wait) counts as the node gone: a stopped (SIGSTOP) or partitioned node.
ANSWER_TIMEOUT_S = 30.0
# At Ctrl-C the episodes still held are aborted within this long, answered or not: the node
# would otherwise wait its idle timeout before playing them again.
STOP_ABORT_S = 5.0
# Statuses that mean "not now" from the node or a proxy in front of it (503: stopping).
UNAVAILABLE = frozenset({502, 503, 504})


def load_callable(spec: str, what: str, app_dir: str | Path = ".") -> Callable[..., Any]:
    """`module:attribute` (e.g. `my_agents:run_episode`) imported, with `app_dir` (the
    current directory by default) first on the import path; ConfigError otherwise."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{what} {spec!r} must look like module:function")
    directory = os.path.abspath(app_dir)
    if sys.path[:1] != [directory]:
        sys.path.insert(0, directory)
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except ModuleNotFoundError as e:
        where = ""
        if e.name is not None and module_name.split(".")[0] == e.name.split(".")[0]:
            where = f" (looked in {directory}, then the installed packages)"
        raise ConfigError(f"{what} {spec!r} cannot be loaded: {e}{where}") from None
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {spec!r} cannot be loaded: {e}") from None
    if not callable(target):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return target  # type: ignore[no-any-return]


@dataclass
class Counts:
    """What became of the episodes this runner claimed."""

    finished: int = 0  # the node took the reward
    failed: int = 0  # the agent raised or returned no number: aborted
    lost: int = 0  # the node no longer knew it (restarted, expired it) or refused the reward
    abandoned: int = 0  # still held at stop: aborted

    def line(self) -> str:
        return (
            f"{self.finished} episodes finished, {self.failed} failed in the agent, "
            f"{self.lost} lost by the node, {self.abandoned} aborted at stop"
        )


@dataclass
class Link:
    """Whether the rollout node answers; each change is logged once, not every retry."""

    url: str
    up: bool | None = None  # None: not asked yet

    def answered(self) -> None:
        if self.up is not True:
            log.info("connected to the rollout node at %s", self.url)
        self.up = True

    def lost(self, why: str) -> None:
        if self.up is not False:
            log.warning(
                "waiting for the rollout node at %s (%s); retrying every %g s",
                self.url, why, RETRY_S,
            )  # fmt: skip
        self.up = False


class AgentFailed(Exception):
    """The user's agent raised, or returned something that is not a finite number."""


@dataclass
class Runner:
    """Claims and plays episodes with `agent` (see the module docstring)."""

    http: Any  # httpx.AsyncClient on the node's URL
    agent: Callable[..., Any]
    link: Link
    episodes: int = 0  # stop after this many finished (0 = run on)
    counts: Counts = field(default_factory=Counts)
    # Episodes claimed and not yet reported: id -> the episode's Authorization header.
    held: dict[str, dict[str, str]] = field(default_factory=dict)

    def enough(self) -> bool:
        return bool(self.episodes) and self.counts.finished >= self.episodes

    async def work(self) -> None:
        """One worker: claim, play, report, until `episodes` are finished (or cancelled)."""
        while not self.enough():
            claim = await self._post("/agents/claim", {"wait_s": CLAIM_WAIT_S})
            if claim.status_code == 401:
                raise AgentjetError(
                    f"the rollout node at {self.link.url} refused the agent token (401): "
                    "pass its rollout.agent_token with --token"
                )
            if claim.status_code == 204:
                self.link.answered()
                continue
            try:
                claimed: dict[str, Any] = claim.json() if claim.status_code == 200 else {}
                episode_id, key = claimed["episode_id"], claimed["api_key"]
            except (ValueError, TypeError, KeyError):
                self.link.lost(f"it refuses claims: {claim.status_code} {claim.text[:200]!r}")
                await asyncio.sleep(RETRY_S)
                continue
            self.link.answered()
            auth = {"Authorization": f"Bearer {key}"}
            self.held[episode_id] = auth
            await self._play(episode_id, auth, claimed)
            del self.held[episode_id]

    async def _play(self, episode_id: str, auth: dict[str, str], claimed: dict[str, Any]) -> None:
        try:
            reward = await self._run_agent(claimed, auth)
        except AgentFailed as e:
            log.warning("episode %s: %s; aborting it", episode_id, e)
            aborted = await self._post(
                f"/agents/{episode_id}/abort", {"reason": str(e)[:200]}, auth
            )
            self.link.answered()
            if aborted.status_code == 200:
                self.counts.failed += 1
            else:
                self.counts.lost += 1
            return
        done = await self._post(f"/agents/{episode_id}/finish", {"reward": reward}, auth)
        self.link.answered()
        if done.status_code == 200:
            self.counts.finished += 1
        else:  # 401: a restarted node never knew it; 409: expired meanwhile
            log.warning("episode %s: the node did not take its reward (%d %s)",
                        episode_id, done.status_code, done.text[:200])  # fmt: skip
            self.counts.lost += 1

    async def _run_agent(self, claimed: dict[str, Any], auth: dict[str, str]) -> Reward:
        import openai

        try:
            task = msgspec.convert(claimed["task"], Task)
        except (KeyError, msgspec.ValidationError) as e:
            raise AgentFailed(f"the node sent a task this runner cannot read: {e}") from None
        key = auth["Authorization"].removeprefix("Bearer ")
        client = openai.AsyncOpenAI(base_url=claimed["base_url"], api_key=key, max_retries=0)
        try:
            result = self.agent(task, client)
            reward = await result if inspect.isawaitable(result) else result
        except Exception as e:  # noqa: BLE001 - the agent's failure ends only this episode
            raise AgentFailed(f"the agent raised {type(e).__name__}: {e}{_where(e)}") from None
        finally:
            await client.close()
        try:  # numpy and torch scalars are numbers too; or one per policy ([[policies]])
            return as_reward(reward)
        except ValueError as e:
            raise AgentFailed(f"the agent's reward {e}") from None

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> Any:
        """The node's answer to POST `path`; while there is none (unreachable, no answer,
        502/503/504) it is asked again every RETRY_S."""
        import httpx

        while True:
            try:
                response = await self.http.post(path, json=body, headers=headers)
            except httpx.TransportError as e:
                self.link.lost(_why(e))
            else:
                if response.status_code not in UNAVAILABLE:
                    return response
                self.link.lost(f"it answers {response.status_code}: {_error_text(response)}")
            await asyncio.sleep(RETRY_S)

    async def abort_held(self) -> None:
        """Abort every episode still held, at once and bounded (the node may be gone)."""
        import httpx

        held, self.held = self.held, {}
        self.counts.abandoned += len(held)

        async def abort(episode_id: str, auth: dict[str, str]) -> None:
            reason = {"reason": "the agent runner stopped"}
            with contextlib.suppress(httpx.TransportError):  # gone: it forgot the episode
                await self.http.post(f"/agents/{episode_id}/abort", json=reason, headers=auth)

        try:
            async with asyncio.timeout(STOP_ABORT_S):
                await asyncio.gather(*(abort(i, auth) for i, auth in held.items()))
        except TimeoutError:
            log.warning("the rollout node did not answer every abort within %g s", STOP_ABORT_S)


async def run_agents(
    rollout_url: str,
    agent: Callable[..., Any],
    *,
    token: str = "",
    concurrency: int = 1,
    episodes: int = 0,
    stop: asyncio.Event | None = None,
) -> int:
    """Claim and play episodes until `stop` is set (or `episodes` were finished, if > 0),
    then abort the episodes still held; the number of episodes finished. AgentjetError
    when the node refuses the agent token."""
    import httpx

    stop = stop or asyncio.Event()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = httpx.Timeout(CLAIM_WAIT_S + ANSWER_TIMEOUT_S, connect=ANSWER_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=rollout_url, headers=headers, timeout=timeout) as http:
        runner = Runner(http, agent, Link(rollout_url), episodes)
        workers: list[asyncio.Task[Any]] = [
            asyncio.create_task(runner.work(), name=f"agent-worker-{i}") for i in range(concurrency)
        ]
        stopping: asyncio.Task[Any] = asyncio.create_task(stop.wait(), name="agent-stop")
        refused = True  # until the loop below ends without an error
        try:
            running = set(workers)
            while running and not stop.is_set() and not runner.enough():
                done, running = await asyncio.wait(
                    running | {stopping}, return_when=asyncio.FIRST_COMPLETED
                )
                running.discard(stopping)
                for task in done - {stopping}:
                    task.result()  # a refused token ends the runner
            refused = False
        finally:
            for task in [*workers, stopping]:
                task.cancel()
            await asyncio.gather(*workers, stopping, return_exceptions=True)
            await runner.abort_held()
            if not refused or runner.counts != Counts():  # else the error is the one line
                log.info("stopped: %s", runner.counts.line())
    return runner.counts.finished


def _why(error: Exception) -> str:
    """A transport failure in a few words: the OS's reason when there is one."""
    import httpx

    if isinstance(error, httpx.TimeoutException):
        return f"no answer within {ANSWER_TIMEOUT_S:g} s"
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno).lower()
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, httpx.RemoteProtocolError):
        return "it closed the connection"
    return str(error) or type(error).__name__


def _error_text(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, TypeError, KeyError):
        return str(response.reason_phrase)


def _where(error: BaseException) -> str:
    """Where the agent failed, as " (file.py:12)": the innermost frame of its traceback
    outside the standard library and installed packages (the agent's own code)."""
    frames = traceback.extract_tb(error.__traceback__)
    library = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])
    own = [f for f in frames if not f.filename.startswith(library)] or frames
    return f" ({Path(own[-1].filename).name}:{own[-1].lineno})" if own else ""
