"""The python_code environment: write a function; hidden tests decide the reward.

One model turn (it never calls a tool, so `max_turns` does not matter). Its first
```python block is written to `solution.py` in the episode's sandbox, and the task's
`check` program (hidden tests, never shown to the model) runs there: reward 1.0 when
every test passes, else 0.0. A reply without a complete code block scores 0.0 without
running anything.
"""

from __future__ import annotations

from sandboxes.base import SandboxError
from sandboxes.envs.parsing import first_code_block
from sandboxes.envs.sandboxed import Play, SandboxedEnv

CODE_SYSTEM_PROMPT = "You write correct Python. Reply with one ```python code block."
SOLUTION_FILE = "solution.py"


class PythonCodeEnv(SandboxedEnv):
    """Function-writing tasks verified by hidden tests run in the sandbox."""

    name = "python_code"
    language = "python"
    system_prompt = CODE_SYSTEM_PROMPT

    def tool_code(self, text: str) -> str | None:
        return None  # the code block is the answer, not a tool call

    def score(self, play: Play) -> float:
        code = first_code_block(play.last_text)
        if code is None:
            return 0.0
        try:
            self.sandbox(play).put_file(SOLUTION_FILE, code.encode())
        except SandboxError as e:  # a sandbox fault is an episode outcome
            play.errors.append(f"check: sandbox failed: {e}")
            return 0.0
        return self.run_check(play)
