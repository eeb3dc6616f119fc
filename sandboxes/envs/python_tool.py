"""The python_tool environment: the model may run Python before it answers.

    turn 1:  task prompts ──generate(n)──────────────▶ model turn ─┬─ no code block: answer, reward
    turn k:  each episode's context ids ──generate(1)─▶ model turn ─┘   ```python block:
                 ▲                                                       run in its sandbox
                 └── + "Output: …" user message and assistant header ◀──┘ (thread pool)

Each turn batches the model calls of every still-active episode into one engine call.
The context grows token-in/token-out (see `chat.py`): the model's ids are appended as
sampled (loss 1), the tool output and turn framing as context (loss 0). An episode ends
on a turn without a code block, or after `max_turns` model calls; the reward is read from
the last model turn, outside its code blocks. Program faults (a crash, an endless loop,
a memory hog) become the model's next observation and the episode's `error`, never an
exception; each episode has its own sandbox, so one sample's fault cannot touch another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat

from agentjet.episode import Completion, Episode, Generator, SamplingParams
from agentjet.protocol import Task
from sandboxes.base import ExecResult, Sandbox, SandboxError
from sandboxes.envs.chat import UserTurn, chat_prompt_ids
from sandboxes.envs.parsing import exact_answer_reward, first_code_block, strip_code_blocks
from sandboxes.process import ProcessSandbox

log = logging.getLogger(__name__)

PYTHON_TOOL_SYSTEM_PROMPT = (
    "You can run Python: write a ```python code block that prints a result and you will "
    "see its output. Then give the final answer as a number."
)
# Characters of program output fed back to the model: enough for a result or a short
# listing, small enough that a chatty program cannot fill the context window.
MAX_TOOL_OUTPUT_CHARS = 300
# Characters of the error line (the traceback's last line) fed back after the output.
MAX_TOOL_ERROR_CHARS = 150
# Tool calls of one turn that run at once: an endless loop in one sample costs one worker
# for `tool_timeout_s`, not the whole batch; mostly idle waiting, so more than the cores.
MAX_CONCURRENT_TOOL_CALLS = 8
# `Episode.finish_reason` of an episode that still called a tool in its last allowed turn.
FINISH_MAX_TURNS = "max_turns"
# What the model sees when the sandbox, not its program, failed.
_COULD_NOT_RUN = "Error: the code could not be run"


@dataclass
class _Play:
    """One episode in progress and what it owns."""

    task: Task
    episode: Episode
    sandbox: Sandbox | None = None
    errors: list[str] = field(default_factory=list)


class PythonToolEnv:
    """Multi-turn arithmetic with a Python tool, verified like `ArithmeticEnv`."""

    name = "python_tool"

    def __init__(
        self,
        *,
        max_turns: int = 3,
        tool_timeout_s: float = 5.0,
        system_prompt: str = PYTHON_TOOL_SYSTEM_PROMPT,
        sandbox_factory: Callable[[], Sandbox] = ProcessSandbox,
        max_concurrent_tool_calls: int = MAX_CONCURRENT_TOOL_CALLS,
    ) -> None:
        """`sandbox_factory` makes one (unstarted) sandbox per episode that runs code."""
        self.max_turns = max_turns
        self.tool_timeout_s = tool_timeout_s
        self.system_prompt = system_prompt
        self.sandbox_factory = sandbox_factory
        self.max_concurrent_tool_calls = max_concurrent_tool_calls

    def run_group(
        self, generator: Generator, tasks: list[Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        """`n` episodes per task; result[i][j] is sample j of task i. Blocks until all end."""
        tokenizer = generator.tokenizer
        user_turn = UserTurn(tokenizer)
        prompts = [chat_prompt_ids(tokenizer, self.system_prompt, task.prompt) for task in tasks]
        groups = [
            [_Play(task, Episode(prompt_ids=list(prompt))) for _ in range(n)]
            for task, prompt in zip(tasks, prompts, strict=True)
        ]
        try:
            active = [play for group in groups for play in group]
            version = generator.policy_version
            completions = [c for samples in generator.generate(prompts, n, params) for c in samples]
            for turn in range(1, self.max_turns + 1):
                callers: list[_Play] = []
                codes: list[str] = []
                for play, completion in zip(active, completions, strict=True):
                    text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                    code = self._take_turn(play, completion, text, version, turn == self.max_turns)
                    if code is not None:
                        callers.append(play)
                        codes.append(code)
                if not callers:
                    break
                with ThreadPoolExecutor(
                    max_workers=min(self.max_concurrent_tool_calls, len(callers)),
                    thread_name_prefix="python-tool",
                ) as pool:
                    feedback = list(pool.map(self._run_tool, callers, codes, repeat(turn)))
                for play, content in zip(callers, feedback, strict=True):
                    play.episode.add_context(user_turn.ids(play.episode.completion_ids, content))
                active = callers
                version = generator.policy_version
                contexts = [play.episode.context_ids for play in active]
                completions = [samples[0] for samples in generator.generate(contexts, 1, params)]
        finally:
            for group in groups:
                for play in group:
                    _close(play)
        return [[play.episode for play in group] for group in groups]

    def _take_turn(
        self, play: _Play, completion: Completion, text: str, version: int, last: bool
    ) -> str | None:
        """Record a model turn (decoded as `text`); the code to run next, or None when the
        episode is over."""
        episode = play.episode
        first = episode.turns == 0
        episode.add_model_turn(completion)
        # The oldest version that sampled any of its tokens: staleness is bounded by it.
        episode.policy_version = version if first else min(episode.policy_version, version)
        code = first_code_block(text)
        if code is not None and not last:
            return code
        if code is not None:
            episode.finish_reason = FINISH_MAX_TURNS
        episode.reward = exact_answer_reward(strip_code_blocks(text), play.task.answer)
        episode.error = "; ".join(play.errors)
        return None

    def _run_tool(self, play: _Play, code: str, turn: int) -> str:
        """Run `code` in the episode's sandbox; the text the model sees next. Never raises
        for a sandbox fault: this is the boundary where such faults become observations."""
        try:
            if play.sandbox is None:
                play.sandbox = self.sandbox_factory()
                play.sandbox.start()
            result = play.sandbox.exec(code, self.tool_timeout_s)
        except (SandboxError, OSError) as e:
            play.errors.append(f"turn {turn}: sandbox failed: {e}")
            return "Output:\n" + _COULD_NOT_RUN
        if result.timed_out:
            play.errors.append(f"turn {turn}: tool timed out after {self.tool_timeout_s:g} s")
        elif result.error:
            play.errors.append(f"turn {turn}: {result.error}")
        elif result.exit_code != 0:
            play.errors.append(f"turn {turn}: tool exited with code {result.exit_code}")
        return tool_feedback(result, self.tool_timeout_s)


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


def _close(play: _Play) -> None:
    if play.sandbox is None:
        return
    try:
        play.sandbox.close()
    except SandboxError as e:  # the episode is complete; a leftover temp dir is only logged
        log.warning("could not close the sandbox of task %s: %s", play.task.id, e)
