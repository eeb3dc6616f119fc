"""Pure text rules of the built-in environments: reading the final answer, finding code.

Verifiers live here, apart from any tokenizer or sandbox, so each rule is a small function
with a table of unit tests.
"""

from __future__ import annotations

import functools
import re

# A number as models write it: an optional sign, digits or comma-grouped thousands, an
# optional fraction. The sign counts only when it does not follow a word character or a
# closing bracket, so the "-" in "10-3" is subtraction, not a negative 3; "−" (U+2212) is
# the typographic minus some tokenizers produce.
_NUMBER = re.compile(
    r"(?<![\w.)\]])(?P<sign>[-−]?)"
    r"(?<![\w.])(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?P<frac>\.\d+)?"
)

# Fenced code blocks by language label; the body runs in a sandbox.
PYTHON_TAGS = ("python", "python3", "py")
SHELL_TAGS = ("sh", "bash", "shell", "console")


@functools.cache
def _code_block(tags: tuple[str, ...]) -> re.Pattern[str]:
    labels = "|".join(re.escape(tag) for tag in tags)
    return re.compile(rf"```(?:{labels})[ \t]*\n(?P<code>.*?)```", re.DOTALL | re.IGNORECASE)


def final_integer(text: str) -> int | None:
    """The last number in `text` when it is an integer ("-12", "1,234", "= 56.", "7.0").

    The last number, not the first, because models restate the question before answering.
    None when there is no number or the last one has a non-zero fraction ("3.5"): a
    non-integer cannot equal an integer answer, and an earlier integer is not the answer.
    """
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    frac = last.group("frac")
    if frac and frac.strip(".0"):
        return None
    value = int(last.group("int").replace(",", ""))
    return -value if last.group("sign") else value


def exact_answer_reward(text: str, answer: int, partial_credit: float = 0.0) -> float:
    """1.0 when the final integer of `text` equals `answer`. Otherwise 0.0, or with
    `partial_credit` > 0 that times the share of the answer's digits it has right
    (`digit_share`): a group whose answers are all wrong then still ranks them."""
    given = final_integer(text)
    if given == answer:
        return 1.0
    if given is None or partial_credit == 0.0 or not isinstance(answer, int):
        return 0.0  # (no digits to compare; arithmetic task files are checked for integers)
    return partial_credit * digit_share(given, answer)


def digit_share(given: int, answer: int) -> float:
    """The share of digit places, aligned from the ones place, where `given` and `answer`
    agree, over the longer of the two (a missing or extra digit counts as wrong); 0 when
    the signs differ. 1036 for 936: 2 of 4; 36 for 936: 2 of 3."""
    if (given < 0) != (answer < 0):
        return 0.0
    a, b = str(abs(given))[::-1], str(abs(answer))[::-1]
    return sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b))


def first_code_block(text: str, tags: tuple[str, ...] = PYTHON_TAGS) -> str | None:
    """The body of the first complete code block labelled with one of `tags`, or None.

    Only a closed fence counts: a block cut off by the token limit is unfinished code,
    and running it would feed the model an error it did not cause.
    """
    match = _code_block(tags).search(text)
    return match.group("code") if match else None


def strip_code_blocks(text: str, tags: tuple[str, ...] = PYTHON_TAGS) -> str:
    """`text` without its code blocks, so numbers inside code are not read as the answer."""
    return _code_block(tags).sub(" ", text)
