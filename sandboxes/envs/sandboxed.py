"""The multi-turn loop every sandboxed environment shares: model turns, tool runs, scoring.

    turn 1:  task prompts ──await generate──────────────────▶ model turn ─┬─ no tool call: finished
    turn k:  each episode's context ids ──await generate(1)─▶ model turn ─┘   a code block: run
                 ▲                                                            it in the episode's
                 └── + "Output: …" user message and assistant header ◀────┘ sandbox (bridge)
    finished episodes ──score (may run the task's check in the sandbox)──▶ reward; sandbox back

`run_group` runs on the caller's event loop. Each turn batches the model calls of every
still-active episode into one awaited engine call; the turn's tool calls (each taking and
setting up its episode's sandbox first), the scoring and the sandboxes' return run
concurrently across the one bridge to threads (agentjet/bridge.py), at most
`max_concurrent_tool_calls` at once.
The context grows token-in/token-out (see `chat.py`): the model's ids are appended as
sampled (loss 1), the tool output and turn framing as context (loss 0). An episode ends on
a turn without a tool call, or after `max_turns` model calls.

Each episode has its own sandbox, taken (from a pool, through `sandbox_factory`) when it
first needs one, with the task's `setup` files written into it, and given back when the
episode is scored: state persists across its turns, and one sample's fault cannot touch
another. At most `max_episodes_at_once` episodes run together (the pool's size: more
would wait on each other's sandboxes); larger batches are played in waves.

Program faults (a crash, an endless loop, a memory hog, a lost sandbox) become the
model's next observation, the episode's `error` and `faults`, never an exception.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from agentjet.bridge import blocking
from agentjet.episode import Completion, Episode, Generator, SamplingParams
from agentjet.protocol import Task
from sandboxes.base import FAULT_UNAVAILABLE, ExecResult, Language, Sandbox, SandboxError
from sandboxes.envs.chat import UserTurn, chat_prompt_ids
from sandboxes.process import ProcessSandbox

log = logging.getLogger(__name__)

# Characters of program output fed back to the model: enough for a result or a short
# listing, small enough that a chatty program cannot fill the context window.
MAX_TOOL_OUTPUT_CHARS = 300
# Characters of the error line (the traceback's last line) fed back after the output.
MAX_TOOL_ERROR_CHARS = 150
# Tool calls of one turn that run at once: an endless loop in one sample costs one slot
# for `tool_timeout_s`, not the whole batch; mostly idle waiting, so more than the cores.
MAX_CONCURRENT_TOOL_CALLS = 8
# Episodes played together when no pool size says otherwise.
MAX_EPISODES_AT_ONCE = 64
# `Episode.finish_reason` of an episode that still called a tool in its last allowed turn.
FINISH_MAX_TURNS = "max_turns"
# Wall-clock limit of a task's check program.
CHECK_TIMEOUT_S = 10.0
# What the model sees when the sandbox, not its program, failed.
_COULD_NOT_RUN = "Error: the code could not be run"


@dataclass
class Play:
    """One episode in progress and what it owns."""

    task: Task
    episode: Episode
    sandbox: Sandbox | None = None
    errors: list[str] = field(default_factory=list)
    last_text: str = ""  # the decoded final model turn, for scoring


class SandboxedEnv:
    """Subclasses set `name`, `system_prompt` and `language`, and define `tool_code` and
    `score`; see the module docstring for the loop they share."""

    name = "sandboxed"
    language: Language = "python"
    # None keeps the chat template's default system message.
    system_prompt: str | None = None

    def __init__(
        self,
        *,
        max_turns: int = 3,
        tool_timeout_s: float = 5.0,
        system_prompt: str | None = None,
        sandbox_factory: Callable[[], Sandbox] = ProcessSandbox,
        max_episodes_at_once: int = MAX_EPISODES_AT_ONCE,
        max_concurrent_tool_calls: int = MAX_CONCURRENT_TOOL_CALLS,
    ) -> None:
        """`sandbox_factory` makes one unstarted sandbox per episode (a pool's `lease`)."""
        self.max_turns = max_turns
        self.tool_timeout_s = tool_timeout_s
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self.sandbox_factory = sandbox_factory
        self.max_episodes_at_once = max_episodes_at_once
        self.max_concurrent_tool_calls = max_concurrent_tool_calls

    # ── what subclasses define ─────────────────────────────────────────────────────

    def tool_code(self, text: str) -> str | None:
        """The program a model turn asks to run, or None when the turn ends the episode."""
        raise NotImplementedError

    def score(self, play: Play) -> float:
        """The finished episode's reward (may use `self.sandbox(play)`); never raises for
        what the model or its programs did."""
        raise NotImplementedError

    # ── the shared loop ────────────────────────────────────────────────────────────

    async def run_group(
        self, generator: Generator, tasks: list[Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        """`n` episodes per task; result[i][j] is sample j of task i, once all have ended."""
        tokenizer = generator.tokenizer
        prompts = [chat_prompt_ids(tokenizer, self.system_prompt, task) for task in tasks]
        groups = [
            [Play(task, Episode(prompt_ids=list(prompt))) for _ in range(n)]
            for task, prompt in zip(tasks, prompts, strict=True)
        ]
        plays = [play for group in groups for play in group]
        size = max(1, self.max_episodes_at_once)
        for start in range(0, len(plays), size):
            await self._play_wave(generator, plays[start : start + size], params)
        return [[play.episode for play in group] for group in groups]

    async def _play_wave(
        self, generator: Generator, plays: list[Play], params: SamplingParams
    ) -> None:
        tokenizer = generator.tokenizer
        user_turn = UserTurn(tokenizer)
        try:
            version = generator.policy_version
            completions = await _first_turn(generator, plays, params)
            active = plays
            finished: list[Play] = []
            for turn in range(1, self.max_turns + 1):
                callers: list[Play] = []
                codes: list[str] = []
                for play, completion in zip(active, completions, strict=True):
                    text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                    code = self._take_turn(play, completion, text, version, turn == self.max_turns)
                    if code is None:
                        finished.append(play)
                    else:
                        callers.append(play)
                        codes.append(code)
                if not callers:
                    break
                feedback = await self._bridged(self._run_tool, callers, codes, repeat(turn))
                for play, content in zip(callers, feedback, strict=True):
                    play.episode.add_context(user_turn.ids(play.episode.completion_ids, content))
                active = callers
                version = generator.policy_version
                contexts = [play.episode.context_ids for play in active]
                samples = await generator.generate(contexts, 1, params)
                completions = [group[0] for group in samples]
            await self._bridged(self._finish, finished)
        finally:
            # Sandboxes still held (the wave failed or was cancelled) go back, concurrently.
            await self._bridged(_close, [play for play in plays if play.sandbox is not None])

    async def _bridged(self, fn: Callable[..., Any], *iterables: Sequence[Any] | Any) -> list[Any]:
        """`fn` on each tuple of `iterables` across the bridge, at most
        `max_concurrent_tool_calls` at once; the results in order once every call ended (the
        first failure raised only then, so no sandbox goes back while a call uses it). A
        cancelled wave (the node stops) does not wait for calls in flight: threads cannot be
        stopped, and the sandboxes are given back under them."""
        limit = asyncio.Semaphore(self.max_concurrent_tool_calls)

        async def one(args: tuple[Any, ...]) -> Any:
            async with limit:
                return await blocking(fn, *args)

        results = await asyncio.gather(
            *(one(args) for args in zip(*iterables, strict=False)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def _take_turn(
        self, play: Play, completion: Completion, text: str, version: int, last: bool
    ) -> str | None:
        """Record a model turn (decoded as `text`); the code to run next, or None when the
        episode is over."""
        episode = play.episode
        first = episode.turns == 0
        episode.add_model_turn(completion)
        # The oldest version that sampled any of its tokens: staleness is bounded by it.
        episode.policy_version = version if first else min(episode.policy_version, version)
        play.last_text = text
        code = self.tool_code(text)
        if code is not None and not last:
            return code
        if code is not None:
            episode.finish_reason = FINISH_MAX_TURNS
        return None

    def _finish(self, play: Play) -> None:
        """Score a finished episode and give its sandbox back."""
        try:
            play.episode.reward = self.score(play)
        finally:
            play.episode.error = "; ".join(play.errors)
            _close(play)

    def sandbox(self, play: Play) -> Sandbox:
        """The episode's sandbox, taken and set up with the task's files on first use.
        SandboxError when none can be had (recorded as fault "no_sandbox")."""
        if play.sandbox is None:
            box = self.sandbox_factory()
            try:
                box.start()
                for path, text in play.task.setup:
                    box.put_file(path, text.encode())
            except SandboxError:
                _close_box(box, play.task)
                play.episode.faults.append(FAULT_UNAVAILABLE)
                raise
            play.sandbox = box
        return play.sandbox

    def run_in_sandbox(
        self,
        play: Play,
        code: str,
        timeout_s: float,
        language: Language,
        what: str,
        *,
        exit_is_error: bool = True,
    ) -> ExecResult | None:
        """Run `code` in the episode's sandbox; None (with the error recorded) when the
        sandbox itself failed. `what` names the run in the episode's errors; a non-zero
        exit is one of them only with `exit_is_error`."""
        try:
            result = self.sandbox(play).exec(code, timeout_s, language=language)
        except (SandboxError, OSError) as e:
            play.errors.append(f"{what}: sandbox failed: {e}")
            return None
        if result.fault:
            play.episode.faults.append(result.fault)
        if result.timed_out:
            play.errors.append(f"{what}: timed out after {timeout_s:g} s")
        elif result.error:
            play.errors.append(f"{what}: {result.error}")
        elif result.fault:
            play.errors.append(f"{what}: {result.fault}")
        elif result.exit_code != 0 and exit_is_error:
            play.errors.append(f"{what}: exited with code {result.exit_code}")
        return result

    def run_check(self, play: Play) -> float:
        """1.0 when the task's check program exits 0 in the episode's sandbox, else 0.0
        (a failed check is a wrong answer, not an error)."""
        result = self.run_in_sandbox(
            play, play.task.check, CHECK_TIMEOUT_S, "python", "check", exit_is_error=False
        )
        return 1.0 if result is not None and result.ok else 0.0

    def _run_tool(self, play: Play, code: str, turn: int) -> str:
        """Run a tool call; the text the model sees next. This is the boundary where
        sandbox faults become observations."""
        result = self.run_in_sandbox(play, code, self.tool_timeout_s, self.language, f"turn {turn}")
        if result is None:
            return "Output:\n" + _COULD_NOT_RUN
        return tool_feedback(result, self.tool_timeout_s)


async def _first_turn(
    generator: Generator, plays: list[Play], params: SamplingParams
) -> list[Completion]:
    """Turn 1 of a wave, in play order: one engine call with each distinct prompt once and
    its samples together (the engine shares their prefix) when every task has as many."""
    counts: dict[int, int] = {}
    prompts: dict[int, list[int]] = {}
    for play in plays:
        counts[id(play.task)] = counts.get(id(play.task), 0) + 1
        prompts[id(play.task)] = play.episode.prompt_ids
    if len(set(counts.values())) == 1:
        n = next(iter(counts.values()))
        samples = await generator.generate(list(prompts.values()), n, params)
        return [c for group in samples for c in group]
    singles = await generator.generate([p.episode.prompt_ids for p in plays], 1, params)
    return [s[0] for s in singles]


def tool_feedback(result: ExecResult, timeout_s: float) -> str:
    """The user message after a tool call: bounded output, then what went wrong, if anything."""
    output = _clip(result.stdout.strip(), MAX_TOOL_OUTPUT_CHARS)
    if result.timed_out:
        problem = f"Error: timed out after {timeout_s:g} s"
    elif result.error:
        problem = _COULD_NOT_RUN
    elif result.exit_code != 0:
        lines = result.stderr.strip().splitlines()
        last_line = lines[-1] if lines else f"exit code {result.exit_code}"
        problem = "Error: " + _clip(last_line, MAX_TOOL_ERROR_CHARS)
    else:
        problem = "" if output else "(nothing printed)"
    return "Output:\n" + "\n".join(part for part in (output, problem) if part)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " …(truncated)"


def _close(play: Play) -> None:
    box, play.sandbox = play.sandbox, None
    if box is not None:
        _close_box(box, play.task)


def _close_box(box: Sandbox, task: Task) -> None:
    try:
        box.close()
    except SandboxError as e:  # the episode is complete; a leftover is only logged
        log.warning("could not close the sandbox of task %s: %s", task.id, e)
