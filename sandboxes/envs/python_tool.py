"""The python_tool environment: the model may run Python before it answers.

Multi-turn arithmetic on the shared sandboxed loop (`sandboxed.py`): a turn with a
```python block runs it and shows the model its output; the first turn without one ends
the episode, and its final integer, outside any code block, is checked against the
task's answer like `ArithmeticEnv`. A block still written in the last allowed turn ends
the episode unrun (`finish_reason` "max_turns").
"""

from __future__ import annotations

from sandboxes.envs.parsing import exact_answer_reward, first_code_block, strip_code_blocks
from sandboxes.envs.sandboxed import Play, SandboxedEnv

PYTHON_TOOL_SYSTEM_PROMPT = (
    "You can run Python: write a ```python code block that prints a result and you will "
    "see its output. Then give the final answer as a number."
)


class PythonToolEnv(SandboxedEnv):
    """Multi-turn arithmetic with a Python tool, verified like `ArithmeticEnv`."""

    name = "python_tool"
    language = "python"
    system_prompt = PYTHON_TOOL_SYSTEM_PROMPT

    def tool_code(self, text: str) -> str | None:
        return first_code_block(text)

    def score(self, play: Play) -> float:
        return exact_answer_reward(strip_code_blocks(play.last_text), play.task.answer)
