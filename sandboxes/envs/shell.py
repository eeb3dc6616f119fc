"""The shell environment: a multi-turn file-system task done with shell commands.

The episode's sandbox starts with the task's `setup` files in its work dir. Each model
turn with a ```sh block runs it there (state persists across turns: files, directories)
and shows the model the output; the first turn without one ends the episode. The reward
is the task's `check` program, run in the same sandbox afterwards: it inspects the work
dir, so only what the commands actually did counts, never what the model claims.
"""

from __future__ import annotations

from sandboxes.envs.parsing import SHELL_TAGS, first_code_block
from sandboxes.envs.sandboxed import Play, SandboxedEnv

SHELL_SYSTEM_PROMPT = (
    "You work in a Linux shell. To run commands, write them in a ```sh code block; you "
    "will see their output. When the task is done, reply without a code block."
)


class ShellEnv(SandboxedEnv):
    """File-system tasks, verified by inspecting the sandbox after the episode."""

    name = "shell"
    language = "sh"
    system_prompt = SHELL_SYSTEM_PROMPT

    def tool_code(self, text: str) -> str | None:
        return first_code_block(text, SHELL_TAGS)

    def score(self, play: Play) -> float:
        return self.run_check(play)
