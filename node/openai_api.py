"""The rollout node's OpenAI-compatible endpoint: every agent episode gets its own key.

    agent (openai client, LangChain, raw HTTP) ── POST /v1/chat/completions ──┐
        Authorization: Bearer <episode key>                                    │
                                                                               ▼
    EpisodeHub: key ─▶ episode ─▶ prompt ids (token-faithful, below) ─▶ Batcher ─▶ engine
                                   ◀── reply (content / tool_calls) ◀── Call recorded
    external agents: POST /agents/claim ─▶ task, base URL, key ... /agents/{id}/finish

The server has no thread or loop of its own: it runs on the loop that starts it (the
rollout node's, where its episodes are played), and the Batcher awaits the engine there.
A model call crosses one thread boundary, the engine's own bridge (agentjet/bridge.py).

**Token-faithful prompts.** A chat API sends the whole history as text each time; the
model must see, and the trainer must train, the ids as sampled. When a request's
messages are an earlier call's messages, then that call's reply, then one new user or
tool message, the prompt is that call's prompt ids + its completion ids as sampled + the
new message's ids: the conversation grows token-in/token-out and `agentjet.timeline`
merges the calls into one sequence. The reply is matched by text, whitespace-normalized,
with tool-call arguments compared as parsed JSON: the documented fallback for clients
that re-format history. Anything else (edited history, summaries, another agent's view)
is rendered afresh with the chat template and becomes a sequence of its own.

**Tools.** How tools reach the model depends on its chat template (node/tool_templates.py,
detected when the server starts; `rollout.tool_format` overrides): the template renders
them itself, or they are described in the system message ("tags"); node/openai_messages.py
says how requests' messages and tools are put to the model and how its calls come back as
OpenAI `tool_calls` (finish_reason "tool_calls"). With a template's own format, a request
extends a recorded call by any number of `tool` and user messages: the ids between the
sampled reply and the next assistant header are the template's own rendering of them
(`tool_templates.continuation`).

**Sampling.** Training episodes always use the node's sampler settings (the logprobs the
trainer needs are those of that sampler); evaluation episodes honour the request's
temperature, top_p and max_tokens. Streaming sends the finished completion as
server-sent-event chunks (generation itself is batched, not incremental).

Every malformed request gets an OpenAI-style error (`{"error": {"message", "type",
"code"}}`) and a 4xx status; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from aiohttp import web

from agentjet.episode import Completion, Generator, Reward, SamplingParams, as_reward
from agentjet.errors import EngineError
from agentjet.protocol import Task
from agentjet.roles import wait_for
from agentjet.timeline import Call
from node.engine import Engine
from node.openai_messages import (
    ApiError,
    assistant_text,
    client_params,
    json_body,
    normalize_messages,
    parse_reply,
    reply_text,
    same_text,
    template_messages,
    template_tools,
    tool_functions,
)
from node.policy_sync import adapters_for
from node.tool_templates import (
    Setting,
    TemplateRefused,
    choose_tool_format,
    continuation,
    render_ids,
)
from sandboxes.envs.chat import UserTurn

log = logging.getLogger(__name__)

# Requests gathered into one engine call: wait this long after the first for more.
BATCH_WINDOW_S = 0.01
MAX_BATCH = 64
# A closing endpoint waits this long for requests in progress before it cancels them: the
# node is stopping, and aiohttp's default (60 s) would hold its shutdown for a long-polled
# claim.
SHUTDOWN_GRACE_S = 1.0
# External episodes unclaimed this long, with no agent connected for as long, are reported
# (once): a node whose agents are not running looks idle otherwise.
AGENTS_AWAY_S = 10.0
# Largest request body (a long conversation is far below this).
MAX_REQUEST_BYTES = 4 << 20

EpisodeState = Literal["open", "claimed", "finished", "aborted", "expired"]


# ── episodes ──────────────────────────────────────────────────────────────────────────


@dataclass
class Recorded:
    """One call of an episode: the normalized request, the reply and the ids as sampled."""

    messages: list[dict[str, Any]]
    reply: str  # the reply as `assistant_text` writes it
    call: Call
    tools: list[dict[str, Any]] | None = None  # as the template got them (template formats)


@dataclass
class AgentEpisode:
    id: str
    key: str
    task: Task
    training: bool
    state: EpisodeState = "open"
    calls: list[Recorded] = field(default_factory=list)
    reward: Reward | None = None
    error: str = ""
    opened_at: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    in_flight: int = 0  # requests being answered: a waiting agent is not a silent one
    # The policy its calls go to unless a request's `model` names another ([[policies]];
    # "" = the swarm's one policy): its grant's.
    policy: str = ""
    # Set once the episode's clock starts (an agent claimed it; in-process: at once), or it
    # closed unclaimed: its episode_timeout_s counts from the claim, not from the open.
    started: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def live(self) -> bool:
        return self.state in ("open", "claimed")

    def claim(self) -> None:
        self.state = "claimed"
        self.last_active = time.monotonic()
        self.started.set()

    def close(self, state: EpisodeState, error: str = "") -> None:
        if self.live:
            self.state, self.error = state, error
            self.started.set()
            self.done.set()


class EpisodeHub:
    """Episodes by key; claims for external agents; idle episodes expire."""

    def __init__(self, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.by_key: dict[str, AgentEpisode] = {}
        self.by_id: dict[str, AgentEpisode] = {}
        self.unclaimed: dict[str, AgentEpisode] = {}  # external episodes, oldest first
        self._offered = asyncio.Event()  # set when an episode becomes claimable, or closing
        self.closing = False
        self.claims_waiting = 0  # claim requests in progress (long-polled)
        self.asked_at = time.monotonic()  # the last claim request began or ended
        self.agents_away = False  # the node has said that no agent claims its episodes
        self.claim_wait_s = 0.0  # external episodes' waits from open to claim, summed

    def open(
        self, task: Task, training: bool, *, external: bool = False, policy: str = ""
    ) -> AgentEpisode:
        episode = AgentEpisode(
            id=f"ep-{uuid.uuid4().hex[:16]}", key=secrets.token_urlsafe(24), task=task,
            training=training, policy=policy,
        )  # fmt: skip
        self.by_key[episode.key] = episode
        self.by_id[episode.id] = episode
        if external:
            self.unclaimed[episode.id] = episode
            self._offered.set()
        else:
            episode.claim()  # its agent runs in-process, now
        return episode

    def forget(self, episode: AgentEpisode) -> None:
        episode.close("aborted", episode.error or "forgotten")
        self.by_key.pop(episode.key, None)
        self.by_id.pop(episode.id, None)
        self.unclaimed.pop(episode.id, None)

    async def claim(self, wait_s: float) -> AgentEpisode | None:
        """The oldest unclaimed episode, claimed now, waiting up to `wait_s` for one; None
        if none came. ApiError 503 once the hub is closing (the node is stopping)."""
        self.claims_waiting += 1
        self.asked_at = time.monotonic()
        try:
            async with asyncio.timeout(wait_s):
                while not self.unclaimed and not self.closing:
                    self._offered.clear()  # no await between the check and the wait
                    await self._offered.wait()
        except TimeoutError:
            return None
        finally:
            self.claims_waiting -= 1
            self.asked_at = time.monotonic()
        if self.closing:
            raise ApiError(503, "the rollout node is stopping", "stopping", "server_error")
        episode = self.unclaimed.pop(next(iter(self.unclaimed)))  # open: closing one forgets it
        episode.claim()
        self.claim_wait_s += episode.last_active - episode.opened_at
        if self.agents_away:
            self.agents_away = False
            log.info("an external agent is claiming episodes")
        return episode

    def close(self) -> None:
        """Answer every waiting and later request with 503: the node is stopping."""
        self.closing = True
        self._offered.set()

    def waiting_for_agents(self, now: float, after_s: float) -> tuple[int, float] | None:
        """(episodes unclaimed, seconds since an agent last asked) when episodes have waited
        `after_s` for a claim and no agent is connected (none asking, none playing), else
        None."""
        if not self.unclaimed or self.claims_waiting:
            return None
        oldest = next(iter(self.unclaimed.values()))
        if now - oldest.opened_at < after_s or now - self.asked_at < after_s:
            return None
        if any(e.state == "claimed" for e in self.by_id.values()):
            return None
        return len(self.unclaimed), now - self.asked_at

    def stats(self) -> dict[str, float]:
        """Metrics: episodes waiting for an external agent's claim and being played now,
        and the seconds external episodes have waited for a claim in all."""
        playing = sum(e.state == "claimed" for e in self.by_id.values())
        return {
            "agents/unclaimed": len(self.unclaimed),
            "agents/playing": playing,
            "agents/claim_wait_s": round(self.claim_wait_s, 3),
        }

    def authorize(self, header: str | None) -> AgentEpisode:
        if self.closing:  # its episodes are being discarded: say why, not "unknown key"
            raise ApiError(503, "the rollout node is stopping", "stopping", "server_error")
        key = (header or "").removeprefix("Bearer ").strip()
        episode = self.by_key.get(key)
        if episode is None:
            raise ApiError(401, "unknown API key: each episode has its own", "invalid_api_key",
                           "authentication_error")  # fmt: skip
        if not episode.live:
            raise ApiError(409, f"episode {episode.id} is {episode.state}", "episode_closed")
        episode.last_active = time.monotonic()
        return episode

    def sweep(self) -> list[AgentEpisode]:
        """Expire claimed episodes idle for longer than the timeout; the ones expired."""
        now = time.monotonic()
        expired = [
            e for e in self.by_id.values()
            if e.state == "claimed" and not e.in_flight
            and now - e.last_active > self.idle_timeout_s
        ]  # fmt: skip
        for episode in expired:
            episode.close("expired", f"no request for {self.idle_timeout_s:g} s")
        return expired


# ── generation ────────────────────────────────────────────────────────────────────────


class Batcher:
    """Gathers concurrent requests into engine calls, one engine call at a time, awaited on
    the server's loop (the engine takes its compute across the bridge: the only thread a
    model call meets)."""

    def __init__(self, generator: Generator) -> None:
        self.generator = generator
        # With several policies ([[policies]]): the engine that holds their adapters; each
        # engine call then samples every request with its own policy's (one mixed batch).
        self.engine: Engine | None = None
        self.queue: asyncio.Queue[tuple[list[int], SamplingParams, str, asyncio.Future[Any]]] = (
            asyncio.Queue()
        )
        self.waiting: set[asyncio.Future[Any]] = set()  # requests not answered yet

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, policy: str = ""
    ) -> tuple[Completion, int]:
        """A completion of `prompt_ids` by `policy` and the policy version that sampled it."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.add(future)
        future.add_done_callback(self.waiting.discard)
        await self.queue.put((prompt_ids, params, policy, future))
        return await future  # type: ignore[no-any-return]

    def close(self) -> None:
        """Answer every waiting request with a 503: the endpoint is stopping."""
        for future in list(self.waiting):
            if not future.done():
                future.set_exception(
                    ApiError(503, "the endpoint is stopping", "stopping", "server_error")
                )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + BATCH_WINDOW_S
            while len(batch) < MAX_BATCH and (left := deadline - loop.time()) > 0:
                try:
                    batch.append(await wait_for(self.queue.get(), left))
                except TimeoutError:
                    break
            by_params: dict[SamplingParams, list[tuple[list[int], str, asyncio.Future[Any]]]] = {}
            for prompt, params, policy, future in batch:
                by_params.setdefault(params, []).append((prompt, policy, future))
            for params, items in by_params.items():
                live = [(p, policy, f) for p, policy, f in items if not f.done()]
                if not live:
                    continue
                try:
                    completions, versions = await self._sample(live, params)
                except Exception as e:  # noqa: BLE001 - handed to every waiting request
                    for _, _, future in live:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for (_, _, future), samples, version in zip(
                    live, completions, versions, strict=True
                ):
                    if not future.done():
                        future.set_result((samples[0], version))

    async def _sample(
        self, live: list[tuple[list[int], str, asyncio.Future[Any]]], params: SamplingParams
    ) -> tuple[list[list[Completion]], list[int]]:
        """One engine call for `live`'s prompts; each one's completions and version."""
        prompts = [p for p, _, _ in live]
        engine = self.engine
        if engine is None:
            completions = await self.generator.generate(prompts, 1, params)
            return completions, [self.generator.policy_version] * len(live)
        policies = [policy for _, policy, _ in live]
        versions = [engine.policy_versions.get(policy, 0) for policy in policies]
        sampled = adapters_for(engine, policies)
        return await engine.generate(prompts, 1, params, policies=sampled), versions


# ── the server ────────────────────────────────────────────────────────────────────────


class OpenAIServer:
    """aiohttp app on one port: /v1 for agents' model calls, /agents for external agents."""

    def __init__(
        self,
        generator: Generator,
        hub: EpisodeHub,
        training_params: SamplingParams,
        *,
        model_name: str = "agentjet-policy",
        agent_token: str = "",
        tool_format: Setting = "auto",
        policies: Sequence[str] = (),
    ) -> None:
        """`policies`: the [[policies]] names, which a request's `model` may name (then
        `/v1/models` lists them, and any other name but `model_name` is a 404)."""
        self.tokenizer = generator.tokenizer
        self.user_turn = UserTurn(self.tokenizer)
        self.tool_format = choose_tool_format(self.tokenizer, tool_format)
        log.info("OpenAI endpoint: tool format %r", self.tool_format.name)
        self.hub = hub
        self.batcher = Batcher(generator)
        self.training_params = training_params
        self.model_name = model_name
        self.policies = list(policies)
        self.agent_token = agent_token
        self.rejected = 0
        self.unknown_models = 0  # requests naming a model (policy) this endpoint does not serve
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self._errors])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/agents/claim", self._claim)
        app.router.add_post("/agents/{id}/finish", self._finish)
        app.router.add_post("/agents/{id}/abort", self._abort)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        bound = sockets[0].getsockname()[1]
        self.base_url = f"http://{host}:{bound}"
        self._tasks = [
            asyncio.create_task(self.batcher.run(), name="agent-batcher"),
            asyncio.create_task(self._sweep(), name="agent-sweeper"),
        ]
        return self.base_url

    async def close(self) -> None:
        """Stop serving: waiting model calls and long-polled claims are answered 503 at
        once, other requests in progress get `SHUTDOWN_GRACE_S`."""
        self.hub.close()
        self.batcher.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.hub.idle_timeout_s / 4))
            for episode in self.hub.sweep():
                log.warning("episode %s expired: %s", episode.id, episode.error)
            waiting = self.hub.waiting_for_agents(time.monotonic(), AGENTS_AWAY_S)
            if waiting is not None and not self.hub.agents_away:
                self.hub.agents_away = True
                unclaimed, since_s = waiting
                log.warning(
                    "%d episodes wait for an external agent to claim them (none connected in "
                    "the last %.0f s); start one: agentjet agent --rollout %s --agent "
                    "MODULE:FUNCTION",
                    unclaimed, since_s, self.base_url,
                )  # fmt: skip

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            self.rejected += 1
            return e.response()
        except web.HTTPException as e:  # aiohttp's own: unknown route, body too large
            self.rejected += 1
            return ApiError(e.status, e.reason, "http_error").response()
        except EngineError as e:  # the node stops with it after the batch (rollout_produce)
            return ApiError(503, str(e), "engine_failed", "server_error").response()

    # ── /v1 ───────────────────────────────────────────────────────────────────────────

    async def _models(self, request: web.Request) -> web.Response:
        self.hub.authorize(request.headers.get("Authorization"))
        return web.json_response(
            {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                          "owned_by": "agentjet"}
                                         for name in self.policies or [self.model_name]]}
        )  # fmt: skip

    def _policy(self, episode: AgentEpisode, model: Any) -> str:
        """The policy a request's `model` names: one of [[policies]], or the episode's own
        for none, "" or `model_name`. Without [[policies]] any name is the one policy."""
        if not self.policies:
            return episode.policy
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "model must be a string", "invalid_model")
        if model in self.policies:
            return model
        if model in (None, "", self.model_name):
            return episode.policy
        self.unknown_models += 1
        raise ApiError(
            404,
            f"The model `{model[:200]}` does not exist (this endpoint serves: "
            f"{', '.join(self.policies)})",
            "model_not_found",
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self.hub.authorize(request.headers.get("Authorization"))
        body = await json_body(request)
        policy = self._policy(episode, body.get("model"))
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "tools must be a list", "invalid_tools")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported", "unsupported_n")
        schemas: list[dict[str, Any]] | None = None
        messages: list[dict[str, Any]]
        if self.tool_format.in_template:
            messages = template_messages(body.get("messages"))
            schemas = template_tools(tools) if tools else None
        else:
            messages = normalize_messages(body.get("messages"), tools)
        params = (
            self.training_params if episode.training else client_params(body, self.training_params)
        )
        try:
            prompt_ids = self._prompt(episode, messages, schemas)
        except TemplateRefused as e:
            raise ApiError(400, f"the chat template refused these messages: {e}",
                           "invalid_messages") from None  # fmt: skip
        episode.in_flight += 1
        try:
            completion, version = await self.batcher.generate(prompt_ids, params, policy)
        finally:
            episode.in_flight -= 1
        if not episode.live:  # finished or aborted while it waited
            raise ApiError(409, f"episode {episode.id} is {episode.state}", "episode_closed")
        episode.last_active = time.monotonic()
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        names = {f["name"] for f in tool_functions(tools)} if tools else set()
        content, tool_calls = parse_reply(text, names, self.tool_format)
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        episode.calls.append(
            Recorded(
                messages=messages,
                reply=assistant_text(reply, 0),
                call=Call(prompt_ids, completion.token_ids, completion.logprobs, version,
                          completion.finish_reason, policy),
                tools=schemas,
            )
        )  # fmt: skip
        finish = "tool_calls" if tool_calls else completion.finish_reason
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(completion.token_ids),
            "total_tokens": len(prompt_ids) + len(completion.token_ids),
        }
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.get("stream"):
            return await self._stream(
                request, ident, created, content, tool_calls, finish, usage, policy
            )
        return web.json_response(
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": policy or self.model_name,
                "choices": [
                    {"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}
                ],
                "usage": usage,
            }
        )

    async def _stream(
        self,
        request: web.Request,
        ident: str,
        created: int,
        content: str | None,
        tool_calls: list[dict[str, Any]],
        finish: str,
        usage: dict[str, int],
        policy: str = "",
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(delta: dict[str, Any], finish_reason: str | None = None) -> None:
            chunk = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": policy or self.model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        for piece in _pieces(content or ""):
            await send({"content": piece})
        if tool_calls:
            await send({"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]})
        await send({}, finish)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _prompt(
        self,
        episode: AgentEpisode,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> list[int]:
        """Token-faithful prompt ids (module docstring). TemplateRefused if the chat
        template raises on the messages."""
        for recorded in reversed(episode.calls):
            k = len(recorded.messages)
            if (
                len(messages) >= k + 2
                and messages[:k] == recorded.messages
                and recorded.tools == tools
                and messages[k]["role"] == "assistant"
                and same_text(reply_text(messages[k]), recorded.reply)
                and (tail := self._tail(recorded, messages)) is not None
            ):
                call = recorded.call
                return call.prompt_ids + call.completion_ids + tail
        return render_ids(self.tokenizer, messages, tools)

    def _tail(self, recorded: Recorded, messages: list[dict[str, Any]]) -> list[int] | None:
        """The ids that follow a recorded call's completion when `messages` are its messages,
        its reply and new messages; None when the new messages do not extend it."""
        k = len(recorded.messages)
        new, sampled = messages[k + 1 :], recorded.call.completion_ids
        if not self.tool_format.in_template:  # tool results are user turns, merged into one
            if len(new) == 1 and new[0]["role"] == "user":
                return self.user_turn.ids(sampled, new[0]["content"])
            return None
        if any(m["role"] not in ("user", "tool") for m in new):
            return None
        text = continuation(self.tokenizer, messages[: k + 1], messages, recorded.tools)
        if text is None:
            return None
        closed = bool(sampled) and sampled[-1] == self.user_turn.end_of_turn_id
        close = [] if closed else [self.user_turn.end_of_turn_id]
        return close + [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    # ── /agents ───────────────────────────────────────────────────────────────────────

    def _check_agent(self, request: web.Request) -> None:
        if self.agent_token:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given, self.agent_token):
                raise ApiError(
                    401, "wrong agent token", "invalid_agent_token", "authentication_error"
                )

    async def _claim(self, request: web.Request) -> web.Response:
        """The oldest unclaimed episode, waiting up to `wait_s` (body) for one; 204 if none,
        503 once the node is stopping."""
        self._check_agent(request)
        body = await json_body(request, required=False)
        wait_s = body.get("wait_s", 10.0)
        if not isinstance(wait_s, int | float) or not 0 <= wait_s <= 60:
            raise ApiError(400, "wait_s must be a number of seconds in [0, 60]", "invalid_wait")
        episode = await self.hub.claim(float(wait_s))
        if episode is None:
            return web.Response(status=204)
        task = episode.task
        return web.json_response(
            {
                "episode_id": episode.id,
                # The task as its row minus what scores it (the node's judge does)
                "task": msgspec.to_builtins(
                    msgspec.structs.replace(task, answer=None, setup=(), check="")
                ),
                "base_url": f"{self.base_url}/v1",
                "api_key": episode.key,
                "training": episode.training,
            }
        )  # fmt: skip

    async def _finish(self, request: web.Request) -> web.Response:
        episode = self._own_episode(request)
        body = await json_body(request)
        try:  # (the environment checks a per-policy mapping's names against the calls)
            reward = as_reward(body.get("reward"))
        except ValueError as e:
            raise ApiError(
                400, f"reward must be a finite number, or one per policy: {e}", "invalid_reward"
            ) from None
        episode.reward = reward
        episode.close("finished")
        return web.json_response({"episode_id": episode.id, "state": episode.state})

    async def _abort(self, request: web.Request) -> web.Response:
        episode = self._own_episode(request)
        body = await json_body(request, required=False)
        episode.close("aborted", str(body.get("reason", "aborted by the agent"))[:200])
        return web.json_response({"episode_id": episode.id, "state": episode.state})

    def _own_episode(self, request: web.Request) -> AgentEpisode:
        episode = self.hub.authorize(request.headers.get("Authorization"))
        if episode.id != request.match_info["id"]:
            raise ApiError(403, "this key belongs to another episode", "wrong_episode")
        return episode


def _pieces(text: str, size: int = 16) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]
