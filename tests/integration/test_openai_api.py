"""The rollout node's OpenAI-compatible endpoint, driven by the real `openai` client.

The server is real (aiohttp on loopback); the policy is the tiny model where token ids
matter, and a rule-following stand-in where a test needs a particular reply (a tool call,
an answer) that a random model would not write.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from agentjet.agent_runner import run_agents
from agentjet.bridge import blocking, is_bridge_thread
from agentjet.episode import Completion, Episode, Generator, SamplingParams
from agentjet.errors import EngineError
from agentjet.protocol import Task
from agentjet.timeline import merge_calls
from node.agents import AgentEnv
from node.openai_api import ApiError, EpisodeHub, OpenAIServer
from node.torch_engine import TorchEngine
from sandboxes.envs.react import ReactAgent
from tests.factories import RuleGenerator
from tests.unit.test_tool_templates import hermes_tokenizer

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(max_new_tokens=12)
TASK = Task(id="t1", env="agent", prompt="What is 2 + 3?", answer=5)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
]
# How long the test's engine holds a model call at most (the test lets it go at once).
HELD_CALL_TIMEOUT_S = 60.0
# A closing endpoint is done within this, though the engine holds a call (aiohttp's own
# grace for requests in progress is 60 s).
CLOSE_TIMEOUT_S = 10.0
TOOL_CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(2 + 3)"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def engine(tiny_model_dir: Path, one_torch_thread: None) -> TorchEngine:
    return TorchEngine(tiny_model_dir, seed=0)


def serve(
    generator: Generator,
    test: Callable[[OpenAIServer, EpisodeHub], Awaitable[None]],
    idle_timeout_s: float = 30.0,
) -> None:
    """Run `test` against a started server on loopback, then close it."""

    async def main() -> None:
        hub = EpisodeHub(idle_timeout_s)
        server = OpenAIServer(generator, hub, PARAMS)
        await server.start()
        try:
            await test(server, hub)
        finally:
            await server.close()

    asyncio.run(main())


def client_for(server: OpenAIServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def test_replies_are_the_sampled_ids_and_a_conversation_is_one_sequence(
    engine: TorchEngine,
) -> None:
    async def test(server: OpenAIServer, hub: EpisodeHub) -> None:
        episode = hub.open(TASK, training=True)
        client = client_for(server, episode.key)
        history: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
        for turn in range(3):
            response = await client.chat.completions.create(model="any", messages=history)
            message = response.choices[0].message
            call = episode.calls[-1].call
            assert message.content == engine.tokenizer.decode(
                call.completion_ids, skip_special_tokens=True
            )
            assert response.usage is not None
            assert response.usage.completion_tokens == len(call.completion_ids)
            history.append(message.model_dump(exclude_none=True))
            history.append({"role": "user", "content": f"{turn}"})
        await client.close()
        calls = [r.call for r in episode.calls]
        first = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say something."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert calls[0].prompt_ids == list(first)
        for before, after in zip(calls, calls[1:], strict=False):
            # token-in/token-out: the next prompt holds the previous ids exactly as sampled
            assert after.prompt_ids[: len(before.prompt_ids) + len(before.completion_ids)] == (
                before.prompt_ids + before.completion_ids
            )
        [sequence] = merge_calls(calls)
        trained = [t for t, m in zip(sequence.completion_ids, sequence.loss_mask, strict=True) if m]
        assert trained == [t for c in calls for t in c.completion_ids]
        logprobs = [lp for lp, m in zip(sequence.logprobs, sequence.loss_mask, strict=True) if m]
        assert logprobs == [lp for c in calls for lp in c.logprobs]

    serve(engine, test)


def test_tool_calls_round_trip_and_stream(tokenizer: Any) -> None:
    def reply(context: str) -> str:
        return "Answer: 5" if "Tool result: 5" in context else f"Let me run it. {TOOL_CALL}"

    async def test(server: OpenAIServer, hub: EpisodeHub) -> None:
        episode = hub.open(TASK, training=True)
        client = client_for(server, episode.key)
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK.prompt}]
        response = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me run it."
        [tool_call] = choice.message.tool_calls or []
        assert tool_call.function.name == "python"
        assert json.loads(tool_call.function.arguments) == {"code": "print(2 + 3)"}
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "5"},
        ]
        stream = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, stream=True
        )
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        assert ("".join(pieces), finish) == ("Answer: 5", "stop")
        # the assistant turn with its tool call was matched: one sequence, two model turns
        [sequence] = merge_calls([r.call for r in episode.calls])
        assert sequence.calls == 2
        streamed_tool = await client.chat.completions.create(
            model="m", messages=messages[:1], tools=TOOLS, stream=True
        )
        deltas = [c.choices[0].delta async for c in streamed_tool]
        calls = [d.tool_calls for d in deltas if d.tool_calls]
        assert calls and calls[0][0].function.name == "python"
        await client.close()

    serve(RuleGenerator(tokenizer, reply), test)


def test_a_tool_capable_template_renders_tools_and_its_calls_are_parsed(
    tiny_model_dir: Path,
) -> None:
    """A Qwen-like template (tests/unit/test_tool_templates.py) is detected: tools, calls and
    results go through it, and the conversation still grows token-in/token-out."""
    tokenizer = hermes_tokenizer(tiny_model_dir)
    # compact JSON, unlike the template's rendering of the call: only the sampled ids match
    call = '<tool_call>{"name":"python","arguments":{"code":"print(2 + 3)"}}</tool_call>'

    def reply(context: str) -> str:
        return "Answer: 5" if "<tool_response>\n5\n</tool_response>" in context else call

    async def test(server: OpenAIServer, hub: EpisodeHub) -> None:
        assert server.tool_format.name == "hermes"
        episode = hub.open(TASK, training=True)
        client = client_for(server, episode.key)
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK.prompt}]
        response = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = response.choices[0]
        [tool_call] = choice.message.tool_calls or []
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        assert json.loads(tool_call.function.arguments) == {"code": "print(2 + 3)"}
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "5"},
        ]
        response = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert response.choices[0].message.content == "Answer: 5"
        await client.close()
        first, second = (r.call for r in episode.calls)
        assert '<tools>\n{"type": "function", "function": {"name": "python"' in tokenizer.decode(
            first.prompt_ids
        )
        grown = first.prompt_ids + first.completion_ids
        assert second.prompt_ids[: len(grown)] == grown  # the call's ids as sampled
        assert tokenizer.decode(second.prompt_ids[len(grown) :]) == (
            "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        [sequence] = merge_calls([first, second])
        assert sequence.calls == 2

    serve(RuleGenerator(tokenizer, reply), test)


def test_a_forked_conversation_yields_two_sequences(tokenizer: Any) -> None:
    async def test(server: OpenAIServer, hub: EpisodeHub) -> None:
        episode = hub.open(TASK, training=True)
        client = client_for(server, episode.key)
        first = [{"role": "user", "content": "Plan the work."}]
        reply = (await client.chat.completions.create(model="m", messages=first)).choices[0]
        follow_up = [*first, reply.message.model_dump(exclude_none=True)]
        follow_up.append({"role": "user", "content": "Go on."})
        await client.chat.completions.create(model="m", messages=follow_up)
        summary = [{"role": "user", "content": "Summary of the plan so far. Go on."}]
        await client.chat.completions.create(model="m", messages=summary)
        await client.close()
        sequences = merge_calls([r.call for r in episode.calls])
        assert [s.calls for s in sequences] == [2, 1]

    serve(RuleGenerator(tokenizer, lambda context: "Working on it."), test)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(tokenizer: Any) -> None:
    async def test(server: OpenAIServer, hub: EpisodeHub) -> None:
        episode = hub.open(TASK, training=False)
        client = client_for(server, episode.key)
        ok = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError):
            await client_for(server, "not-a-key").chat.completions.create(model="m", messages=ok)
        bad: list[tuple[dict[str, Any], str]] = [
            ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_role"),
            ({"messages": []}, "invalid_messages"),
            ({"messages": ok, "n": 3}, "unsupported_n"),
            ({"messages": ok, "temperature": 9}, "invalid_temperature"),
            ({"messages": [{"role": "user", "content": {"x": 1}}]}, "invalid_content"),
            ({"messages": ok, "tools": "python"}, "invalid_tools"),
        ]
        for body, code in bad:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="m", **body)
            assert err.value.code == code
        headers = {"Authorization": f"Bearer {episode.key}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers) as http:
            junk = await http.post("/v1/chat/completions", content=b"{not json")
            assert junk.status_code == 400 and junk.json()["error"]["code"] == "invalid_json"
            huge = await http.post("/v1/chat/completions", content=b"x" * (5 << 20))
            assert huge.status_code == 413 and "error" in huge.json()
            missing = await http.get("/v1/nothing")
            assert missing.status_code == 404 and "error" in missing.json()
        # evaluation episodes honour the client's sampling settings; the server still serves
        response = await client.chat.completions.create(
            model="m", messages=ok, temperature=0, max_tokens=3
        )
        assert response.choices[0].message.content == "fine"
        assert server.rejected == len(bad) + 4
        models = await client.models.list()
        assert [m.id for m in models.data] == ["agentjet-policy"]
        await client.close()

    serve(RuleGenerator(tokenizer, lambda context: "fine"), test)


def test_an_agent_that_goes_silent_is_reclaimed_and_its_episode_played_again(
    tokenizer: Any,
) -> None:
    attempts: list[str] = []

    async def agent(task: Task, client: Any) -> float:
        attempts.append(task.id)
        messages = [{"role": "user", "content": task.prompt}]
        await client.chat.completions.create(model="m", messages=messages)
        if len(attempts) == 1:
            await asyncio.Event().wait()  # hangs forever: only the idle timeout ends it
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
        await client.chat.completions.create(model="m", messages=messages)
        return 1.0

    async def main() -> list[list[Episode]]:
        env = AgentEnv("agent", agent, idle_timeout_s=0.5, episode_timeout_s=60)
        try:
            return await env.run_group(RuleGenerator(tokenizer, lambda c: "ok"), [TASK], 1, PARAMS)
        finally:
            await env.close()

    [[episode]] = asyncio.run(main())
    assert len(attempts) == 2
    assert episode.reward == 1.0 and episode.turns == 2  # only the finished attempt
    assert [s.calls for s in episode.sequences] == [2]


def test_react_agent_in_process_and_an_external_agent_process(tokenizer: Any) -> None:
    def reply(context: str) -> str:
        return "Answer: 5" if "Tool result: 5" in context else TOOL_CALL

    generator = RuleGenerator(tokenizer, reply)

    async def in_process() -> list[list[Episode]]:
        react = AgentEnv("react", ReactAgent(max_turns=4, tool_timeout_s=10))
        try:
            return await react.run_group(generator, [TASK], 2, PARAMS)
        finally:
            await react.close()

    [group] = asyncio.run(in_process())
    assert [(e.reward, e.turns, len(e.sequences)) for e in group] == [(1.0, 2, 1)] * 2

    # External: the env waits for claims; `run_agents` plays them as `agentjet agent` would.
    async def external() -> tuple[list[list[Episode]], int]:
        env = AgentEnv(
            "react", None, external=True, judge=lambda task, messages: 1.0 if messages else 0.0
        )
        try:
            url = await env.start(generator, PARAMS)
            return await asyncio.gather(
                env.run_group(generator, [TASK], 3, PARAMS),
                run_agents(url, ReactAgent(max_turns=4), episodes=3),
            )
        finally:
            await env.close()

    [[*episodes]], finished = asyncio.run(external())
    assert finished == 3
    assert [(e.reward, e.turns) for e in episodes] == [(1.0, 2)] * 3


class HeldEngine:
    """A Generator whose compute, in a bridge thread as a real engine's, holds each call
    until the test lets it go, and notes the threads each call met on its way."""

    def __init__(self, tokenizer: Any) -> None:
        self.rule = RuleGenerator(tokenizer, lambda context: "Answer: 5")
        self.tokenizer = tokenizer
        self.policy_version = 0
        self.awaited_on: list[threading.Thread] = []  # where `generate` was awaited
        self.computed_on: list[threading.Thread] = []  # where the compute ran
        self.computing = asyncio.Event()
        self.go_on = threading.Event()

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        self.awaited_on.append(threading.current_thread())
        loop = asyncio.get_running_loop()
        await blocking(self._compute, loop)
        return await self.rule.generate(prompts, n, params)

    def _compute(self, loop: asyncio.AbstractEventLoop) -> None:
        self.computed_on.append(threading.current_thread())
        loop.call_soon_threadsafe(self.computing.set)
        assert self.go_on.wait(HELD_CALL_TIMEOUT_S), "the test never let the call go on"


def test_an_agents_model_call_crosses_one_bridge_and_the_loop_serves_meanwhile(
    tokenizer: Any,
) -> None:
    """The agent, the endpoint and the engine's caller share the loop that runs run_group:
    while a model call is held in the engine, that loop answers another request on the
    endpoint, and the only threads the episode met are the loop's and the bridge's."""
    engine = HeldEngine(tokenizer)
    agent_ran_on: list[threading.Thread] = []

    async def agent(task: Task, client: Any) -> float:
        """Raw HTTP on the episode's key: the openai client looks up its platform once per
        client in a thread of asyncio's (openai/_base_client.py), a library's detail this
        test keeps out of the threads it counts."""
        agent_ran_on.append(threading.current_thread())
        body = {"model": "m", "messages": [{"role": "user", "content": task.prompt}]}
        headers = {"Authorization": f"Bearer {client.api_key}"}
        async with httpx.AsyncClient(base_url=str(client.base_url), headers=headers) as http:
            reply = (await http.post("chat/completions", json=body)).json()
        return 1.0 if reply["choices"][0]["message"]["content"] == "Answer: 5" else 0.0

    async def main() -> tuple[list[list[Episode]], set[threading.Thread]]:
        env = AgentEnv("agent", agent)
        try:
            url = await env.start(engine, PARAMS)
            assert env.server is not None
            playing = asyncio.ensure_future(env.run_group(engine, [TASK], 1, PARAMS))
            await engine.computing.wait()  # the model call is in the engine now
            [episode] = env.server.hub.by_key.values()
            headers = {"Authorization": f"Bearer {episode.key}"}
            async with httpx.AsyncClient(base_url=url, headers=headers) as http:
                models = await http.get("/v1/models")
            assert models.status_code == 200 and not playing.done()
            during = set(threading.enumerate())
            engine.go_on.set()
            return await playing, during
        finally:
            engine.go_on.set()
            await env.close()

    threads_before = set(threading.enumerate())
    [[episode]], threads_during = asyncio.run(main())
    assert episode.reward == 1.0
    main_thread = threading.current_thread()
    # The agent ran, and awaited the engine, on the loop of run_group (this thread's)...
    assert agent_ran_on == engine.awaited_on == [main_thread]
    # ...and the compute ran in a bridge thread: the one hop of a model call.
    [compute_thread] = engine.computed_on
    assert is_bridge_thread(compute_thread)
    # No thread but the bridge's started while the episode played.
    new = threads_during - threads_before
    assert all(is_bridge_thread(t) for t in new), sorted(t.name for t in new)


def test_closing_an_agent_env_mid_call_stops_its_endpoint_at_once(tokenizer: Any) -> None:
    """A node stopping while a model call is in the engine: close() cancels the episode,
    answers its waiting request 503 and stops the endpoint, though the engine still holds
    the call (aiohttp alone would wait 60 s for that request)."""
    engine = HeldEngine(tokenizer)

    async def agent(task: Task, client: Any) -> float:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": task.prompt}]
        )
        return 1.0

    async def main() -> None:
        env = AgentEnv("agent", agent)
        try:
            playing = asyncio.ensure_future(env.run_group(engine, [TASK], 1, PARAMS))
            await engine.computing.wait()
            assert env.server is not None
            [waiting] = env.server.batcher.waiting
            await asyncio.wait_for(env.close(), CLOSE_TIMEOUT_S)
            with pytest.raises(asyncio.CancelledError):
                await playing
            error = waiting.exception()
            assert isinstance(error, ApiError) and error.status == 503
        finally:
            engine.go_on.set()
            await env.close()

    asyncio.run(main())


def test_a_dead_engine_is_a_503_that_says_so(engine: TorchEngine) -> None:
    """The engine is gone (vLLM's engine core died: node/engine_base.py keeps the error):
    an agent's call gets a 503 that says why, not a 500 or a hang, and the endpoint stays
    up; the rollout node stops after the batch (tests/unit/test_rollout_produce.py)."""

    async def test(server: OpenAIServer, hub: EpisodeHub) -> None:
        episode = hub.open(TASK, training=True)
        client = client_for(server, episode.key)
        ok = [{"role": "user", "content": "hi"}]
        engine.failure = EngineError("vLLM's engine core died")
        for _ in range(2):  # the batcher serves on after the first failure
            with pytest.raises(openai.InternalServerError) as err:
                await client.chat.completions.create(model="m", messages=ok, max_tokens=2)
            assert err.value.status_code == 503 and err.value.code == "engine_failed"
            assert "engine core died" in err.value.message
        await client.close()

    serve(engine, test)
