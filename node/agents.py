"""Agent environments: episodes are programs that talk to the policy through the OpenAI API.

    rollout node ── await run_group(engine, tasks, n) ──▶ AgentEnv (on the node's event loop)
        first call: OpenAIServer started on that loop (rollout.agent_listen)
        for each of the n episodes of a task: EpisodeHub.open ─▶ key
            in-process:  reward = await agent(task, AsyncOpenAI(base_url, key))
            external:    an `agentjet agent` process claims it over HTTP, plays, finishes
        each model call: HTTP ─▶ Batcher ─▶ await engine.generate ─▶ (bridge thread) decode
        episode's calls ──agentjet.timeline.merge_calls──▶ training sequences ──▶ Episode

No thread or loop of its own: the endpoint, the agents and the episodes all run on the
caller's loop, and a model call crosses one thread boundary, the engine's bridge
(agentjet/bridge.py). `await close()` stops the endpoint, on that loop, before it ends.

An agent is `async def run_episode(task, client) -> float` (or an object with that
`__call__`), written against the official `openai` client; a separate
`judge(task, messages) -> float` may score instead. An agent object may also bring its
own lifecycle: `async start()` (awaited once, before the endpoint serves its first episode:
a ConfigError there stops the node with its one line), `async close()` (after the
endpoint's), `metrics()` (merged into `metrics()`) and `max_episodes` (at most that many of
its episodes open at once; the others wait unopened, their clocks not started): the OpenEnv
agent (node/openenv_env.py) starts and stops its server so. An episode that fails (the agent
raised, went silent past `idle_timeout_s`, ran past `episode_timeout_s`, returned no
finite reward, or never called the model) is discarded, never trained, and played again
from scratch up to `attempts` times; a task whose episodes keep failing yields no group
(the rollout node reports it as failed).

External episodes wait for a claim without a bound (the endpoint says once when none is
claimed and no agent is connected); their `episode_timeout_s` counts from the claim. When
the node stops, `close()` discards the episodes still out to agents (never trained) and the
endpoint answers their agents 503 at once, so the stop does not wait on them. Agent and
judge modules are imported from the node's current directory first (`load_callable`, as
`agentjet agent` does), so `agentjet local` started in the agent's folder finds it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentjet.agent_runner import load_callable
from agentjet.bridge import Exclusive
from agentjet.config import EnvConfig, RolloutConfig
from agentjet.episode import Episode, Generator, Reward, SamplingParams, as_reward
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from agentjet.roles import wait_for
from agentjet.timeline import Call, merge_by_policy
from node.openai_api import AgentEpisode, EpisodeHub, OpenAIServer
from node.openenv_env import make_openenv_agent
from node.policy_sync import PolicyView
from node.tool_templates import Setting
from node.verifiers_env import verifiers_agent
from sandboxes.base import Sandbox
from sandboxes.envs.env_class import env_class_agent
from sandboxes.envs.react import ReactAgent, react_judge

log = logging.getLogger(__name__)

Agent = Callable[[Task, Any], Any]  # async (task, openai.AsyncOpenAI) -> float
Judge = Callable[[Task, list[dict[str, Any]]], Any]  # (task, final messages) -> float
# Attempts at one episode before its task's group is given up.
ATTEMPTS = 2


@dataclass
class Played:
    """A finished episode: its reward and its calls as sampled; with several policies,
    `rewards` holds those the agent gave each policy apart (`reward`: its grant's)."""

    reward: float
    calls: list[Call]
    error: str = ""
    rewards: dict[str, float] = field(default_factory=dict)


class AgentEnv:
    """See the module docstring. One per environment entry of a rollout node."""

    def __init__(
        self,
        name: str,
        agent: Agent | None,
        *,
        judge: Judge | None = None,
        external: bool = False,
        merge: bool = True,
        episode_timeout_s: float = 300.0,
        idle_timeout_s: float = 60.0,
        listen: str = "127.0.0.1:0",
        agent_token: str = "",
        tool_format: Setting = "auto",
        attempts: int = ATTEMPTS,
        policies: Sequence[str] = (),
    ) -> None:
        """`policies`: the [[policies]] names a request's `model` may name."""
        if agent is None and not external:
            raise ConfigError(f"environment {name!r} needs an agent, or external = true")
        self.name = name
        self.agent = agent
        self.judge = judge
        self.external = external
        self.merge = merge
        self.episode_timeout_s = episode_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.host, _, port = listen.rpartition(":")
        self.port = int(port)
        self.agent_token = agent_token
        self.tool_format = tool_format
        self.attempts = attempts
        self.policies = list(policies)
        self.server: OpenAIServer | None = None
        self._starting = Exclusive()
        self._running: set[asyncio.Task[list[list[Played]]]] = set()
        limit = getattr(agent, "max_episodes", 0)
        self._slots = asyncio.Semaphore(limit) if limit else None
        self.failures: Counter[str] = Counter()  # failed attempts, by kind of failure

    # ── the Environment interface ─────────────────────────────────────────────────────

    async def run_group(
        self, generator: Generator, tasks: list[Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        """`n` episodes per task (an empty list for a task whose episodes kept failing)."""
        played = await self.play(generator, tasks, n, params)
        return [[_episode(p, self.merge) for p in group] for group in played]

    async def play(
        self,
        generator: Generator,
        tasks: list[Task],
        n: int,
        params: SamplingParams,
        *,
        training: bool = True,
    ) -> list[list[Played]]:
        """The raw outcome: per task, n finished episodes with their calls, or []. An
        evaluation run (`training=False`) honours the agents' own sampling settings (else
        `params`); its episodes are for scoring, never for training."""
        await self.start(generator, params)
        # With [[policies]]: the policy whose grant this is (a request's `model` may name
        # another); its episodes' calls go to it.
        policy = generator.policy if isinstance(generator, PolicyView) else ""
        group = asyncio.ensure_future(self._group(tasks, n, training, policy))
        self._running.add(group)
        try:
            return await group
        finally:
            self._running.discard(group)

    async def start(self, generator: Generator, params: SamplingParams) -> str:
        """Serve the endpoint on the running loop (once; `run_group` calls this) for
        `generator` with training `params`; its base URL. ConfigError when the address in
        rollout.agent_listen cannot be bound."""
        async with self._starting.hold():
            if self.server is None:
                await _hook(self.agent, "start")
                hub = EpisodeHub(self.idle_timeout_s)
                server = OpenAIServer(
                    generator,
                    hub,
                    params,
                    agent_token=self.agent_token,
                    tool_format=self.tool_format,
                    policies=self.policies,
                )
                try:
                    url = await server.start(self.host, self.port)
                except OSError as e:
                    where = f"rollout.agent_listen {self.host}:{self.port}"
                    raise ConfigError(f"{where}: cannot listen: {e.strerror}") from None
                log.info("%s: OpenAI endpoint at %s/v1, agent claims at %s/agents",
                         self.name, url, url)  # fmt: skip
                self.server = server
            self.server.batcher.generator = generator
            if isinstance(generator, PolicyView):  # each call samples with its own policy
                self.server.batcher.engine = generator.engine
            self.server.training_params = params
            return self.server.base_url

    def metrics(self) -> dict[str, float]:
        """For the rollout node's metrics rows (`EpisodeHub.stats`): `agents/unclaimed`,
        `agents/playing` and `agents/claim_wait_s`, the time episodes waited for agents."""
        metrics = getattr(self.agent, "metrics", None)
        own: dict[str, float] = metrics() if metrics is not None else {}
        failed = {"agents/attempts_failed": float(sum(self.failures.values()))}
        return (self.server.hub.stats() if self.server is not None else {}) | failed | own

    async def close(self) -> None:
        """Stop the endpoint; a run_group still waiting on episodes raises CancelledError
        (its episodes, claimed or not, are discarded)."""
        if self.server is not None:
            self.server.hub.close()  # their agents hear 503 "stopping" from now on
        for group in list(self._running):
            group.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        server, self.server = self.server, None
        if server is not None:
            await server.close()
        await _hook(self.agent, "close")

    # ── episodes ──────────────────────────────────────────────────────────────────────

    async def _group(
        self, tasks: list[Task], n: int, training: bool, policy: str = ""
    ) -> list[list[Played]]:
        results = await asyncio.gather(
            *(
                self._episode_with_retries(task, training, policy)
                for task in tasks
                for _ in range(n)
            )
        )
        groups: list[list[Played]] = []
        for i in range(len(tasks)):
            group = [p for p in results[i * n : (i + 1) * n] if p is not None]
            groups.append(group if len(group) == n else [])
        return groups

    async def _episode_with_retries(
        self, task: Task, training: bool, policy: str = ""
    ) -> Played | None:
        if self._slots is None:
            return await self._play_attempts(task, training, policy)
        async with self._slots:
            return await self._play_attempts(task, training, policy)

    async def _play_attempts(self, task: Task, training: bool, policy: str) -> Played | None:
        assert self.server is not None
        hub = self.server.hub
        for attempt in range(1, self.attempts + 1):
            episode = hub.open(task, training=training, external=self.external, policy=policy)
            try:
                reward, error = await self._play_one(episode)
            finally:
                hub.forget(episode)
            if error == "" and not episode.calls:
                error = "the agent never called the model"
            if error == "":
                calls = [r.call for r in episode.calls]
                if isinstance(reward, dict):  # one per policy: the grant's is the episode's
                    own = reward.get(policy, sum(reward.values()) / len(reward))
                    return Played(own, calls, rewards=reward)
                return Played(reward, calls)
            self._failed(task, attempt, error)
        return None

    def _failed(self, task: Task, attempt: int, error: str) -> None:
        """Count a failed attempt; log the first of each kind (its first two colon-separated
        parts, digits as N: "the agent raised VerifiersError: a reward returned nan"): an
        environment failing every episode the same way says so once."""
        kind = re.sub(r"\d+", "N", ":".join(error.split(":", 2)[:2]))[:160]
        if kind not in self.failures:
            log.warning("%s: episode of task %s failed (attempt %d): %s (logged once per "
                        "kind; agents/attempts_failed counts them)",
                        self.name, task.id, attempt, error)  # fmt: skip
        self.failures[kind] += 1

    async def _play_one(self, episode: AgentEpisode) -> tuple[Reward, str]:
        """(reward, "") for a finished episode, else (0.0, why it failed)."""
        if self.external:
            await episode.started.wait()  # unbounded: the clock starts at the claim
            try:
                await wait_for(episode.done.wait(), self.episode_timeout_s)
            except TimeoutError:
                return 0.0, f"not finished within {self.episode_timeout_s:g} s of its claim"
            if episode.state != "finished" or episode.reward is None:
                return 0.0, episode.error or episode.state
            return await self._judged(episode, episode.reward)
        import openai

        assert self.server is not None and self.agent is not None
        client = openai.AsyncOpenAI(
            base_url=f"{self.server.base_url}/v1",
            api_key=episode.key,
            max_retries=0,
            timeout=self.episode_timeout_s,
        )
        agent = asyncio.ensure_future(_call(self.agent, episode.task, client))
        expired = asyncio.ensure_future(episode.done.wait())
        try:
            done, _ = await asyncio.wait(
                {agent, expired},
                timeout=self.episode_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if agent not in done:
                why = episode.error if expired in done else f"ran past {self.episode_timeout_s:g} s"
                return 0.0, why or "stopped"
            try:
                reward = agent.result()
            except Exception as e:  # noqa: BLE001 - the agent's own failure is an outcome
                return 0.0, f"the agent raised {type(e).__name__}: {e}"
            episode.close("finished")
            return await self._judged(episode, reward)
        finally:
            for future in (agent, expired):
                future.cancel()
            await asyncio.gather(agent, expired, return_exceptions=True)
            await client.close()

    async def _judged(self, episode: AgentEpisode, reward: Any) -> tuple[Reward, str]:
        """The agent's (or the judge's) reward checked: a finite number, or with
        [[policies]] a mapping of the episode's called policies to finite numbers."""
        if self.judge is not None:
            try:
                reward = await _call(self.judge, episode.task, _transcript(episode))
            except Exception as e:  # noqa: BLE001
                return 0.0, f"the judge raised {type(e).__name__}: {e}"
        try:
            checked = as_reward(reward)
        except ValueError as e:
            return 0.0, f"reward {e}"
        if isinstance(checked, dict):
            called = {r.call.policy for r in episode.calls}
            if not self.policies:
                return 0.0, "a reward per policy needs [[policies]]; return a number"
            if not set(checked) <= called:
                stray = sorted(set(checked) - called)
                return 0.0, f"reward names {', '.join(stray)}, which the episode never called"
        return checked, ""


async def _hook(agent: Agent | None, name: str) -> None:
    """The agent's own `start` or `close`, when it has one."""
    hook = getattr(agent, name, None)
    if hook is not None:
        await _call(hook)


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


def _transcript(episode: AgentEpisode) -> list[dict[str, Any]]:
    """The last call's conversation and the reply, for a judge."""
    if not episode.calls:
        return []
    last = episode.calls[-1]
    return [*last.messages, {"role": "assistant", "content": last.reply}]


def _episode(played: Played, merge: bool) -> Episode:
    # Each policy's calls on a timeline of their own (one policy: `merge_calls`); each
    # sequence names its policy, and the rollout node makes one group per policy of them.
    by_policy = merge_by_policy(played.calls, merge=merge)
    sequences = [seq for own in by_policy.values() for seq in own]
    return Episode(
        prompt_ids=sequences[0].prompt_ids,
        reward=played.reward,
        turns=len(played.calls),
        finish_reason=sequences[-1].finish_reason,
        policy_version=min(s.policy_version for s in sequences),
        sequences=sequences,
        policy_rewards=dict(played.rewards),
    )


def make_agent_env(
    config: EnvConfig,
    rollout: RolloutConfig,
    sandbox_factory: Callable[[], Sandbox],
    policies: Sequence[str] = (),
) -> AgentEnv:
    """The AgentEnv an `[[envs]]` entry names: the built-in react agent, a TRL-style
    environment class (sandboxes/envs/env_class.py), or the user's agent;
    `policies`: the [[policies]] names its agents may call by the `model` field."""
    agent: Agent | None
    if config.name == "openenv":  # an OpenEnv server's reset/step (node/openenv_env.py)
        agent = make_openenv_agent(config)
    elif config.name == "react":
        agent = ReactAgent(
            max_turns=config.max_turns,
            tool_timeout_s=config.tool_timeout_s,
            sandbox_factory=sandbox_factory,
        )
    elif config.name == "verifiers":
        agent = verifiers_agent(config)
    elif config.name == "env_class":
        agent = env_class_agent(config, sandbox_factory)
    else:
        agent = load_callable(config.agent, "agent") if config.agent else None
    judge: Judge | None = load_callable(config.judge, "judge") if config.judge else None
    if judge is None and config.name == "react" and config.external:
        judge = react_judge  # external agents never see the answer
    return AgentEnv(
        config.name,
        agent,
        judge=judge,
        external=config.external,
        merge=config.merge_timeline,
        episode_timeout_s=config.episode_timeout_s,
        idle_timeout_s=config.idle_timeout_s,
        listen=rollout.agent_listen,
        agent_token=rollout.agent_token,
        tool_format=rollout.tool_format,
        policies=policies,
    )
