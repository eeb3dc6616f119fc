"""`agentjet agent`: play a rollout node's agent episodes from another process or machine.

    loop (× concurrency):  POST {rollout}/agents/claim ──▶ episode: task, base_url, api_key
                           reward = await agent(task, AsyncOpenAI(base_url, api_key))
                           POST /agents/{id}/finish {"reward"}   (or /abort on an exception)

No torch and no model here: the agent's model calls go to the rollout node's endpoint,
which samples them with the current policy and records them for training. Edit the agent
and restart this process while training goes on; an episode it abandons is reclaimed by
the node after its idle timeout and played again. Tasks arrive without their answer or
check: for verifiable environments the node's judge scores the transcript.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable
from typing import Any

from agentjet.errors import AgentjetError, ConfigError
from agentjet.protocol import Task

log = logging.getLogger(__name__)

# How long one claim waits on the node for an episode before asking again.
CLAIM_WAIT_S = 10.0
# Pause after the node could not be reached, before trying again.
RETRY_S = 2.0


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """`module:attribute` (e.g. `my_agents:run_episode`) imported; ConfigError otherwise."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{what} {spec!r} must look like module:function")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {spec!r} cannot be loaded: {e}") from None
    if not callable(target):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return target  # type: ignore[no-any-return]


async def run_agents(
    rollout_url: str,
    agent: Callable[..., Any],
    *,
    token: str = "",
    concurrency: int = 1,
    episodes: int = 0,
    stop: asyncio.Event | None = None,
) -> int:
    """Claim and play episodes until `stop` is set (or `episodes` were played, if > 0);
    the number of episodes finished."""
    import httpx

    stop = stop or asyncio.Event()
    finished = 0
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal finished
        while not stop.is_set() and not (episodes and finished >= episodes):
            try:
                claim = await http.post("/agents/claim", json={"wait_s": CLAIM_WAIT_S})
            except httpx.HTTPError as e:
                log.warning("cannot reach the rollout node at %s: %s", rollout_url, e)
                await asyncio.sleep(RETRY_S)
                continue
            if claim.status_code == 204:
                continue
            if claim.status_code != 200:
                raise AgentjetError(f"claim refused ({claim.status_code}): {claim.text[:200]}")
            if await _play(http, agent, claim.json()):
                finished += 1
        stop.set()

    async with httpx.AsyncClient(
        base_url=rollout_url, headers=headers, timeout=CLAIM_WAIT_S + 30
    ) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return finished


async def _play(http: Any, agent: Callable[..., Any], claimed: dict[str, Any]) -> bool:
    import openai

    episode_id, key = claimed["episode_id"], claimed["api_key"]
    task = Task(**claimed["task"])
    auth = {"Authorization": f"Bearer {key}"}
    client = openai.AsyncOpenAI(base_url=claimed["base_url"], api_key=key, max_retries=0)
    try:
        result = agent(task, client)
        reward = await result if asyncio.iscoroutine(result) else result
    except Exception as e:  # noqa: BLE001 - the agent's failure ends only this episode
        log.warning("episode %s: the agent raised %s: %s", episode_id, type(e).__name__, e)
        await http.post(f"/agents/{episode_id}/abort", json={"reason": repr(e)}, headers=auth)
        return False
    finally:
        await client.close()
    done = await http.post(f"/agents/{episode_id}/finish", json={"reward": reward}, headers=auth)
    if done.status_code != 200:
        log.warning("episode %s: finish refused: %s %s", episode_id, done.status_code, done.text)
        return False
    return True
