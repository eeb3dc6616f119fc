"""Verifiable tasks for the sandboxed environments: write a function, or work on files.

    make_code_task  ──▶ Task(prompt, check)         the environment writes the model's code
                                                    block to solution.py, then runs `check`
    make_shell_task ──▶ Task(prompt, setup, check)  `setup` files are written first, the
                                                    model runs ```sh blocks, then `check` runs

`check` is a self-contained Python 3.11 program (stdlib only) that the environment runs in
the episode's sandbox, work dir as cwd, after the episode: exit code 0 is success, anything
else failure, with a one-line reason on stderr. Neither is in the prompt (a shell task's
model sees the `setup` files by looking at them).

A task is named by its family and the parameters drawn from the caller's rng
(`code:mul:7`, `shell:sum:total.txt:4821`); everything else (hidden test inputs, file
contents) is drawn from `random.Random(task id)`, so one id is always one task.

A code check runs the solution in a child interpreter, so a solution that exits early
(`sys.exit(0)`, `os._exit(0)`) or prints cannot pose as a pass; results come back as JSON,
so only plain values cross (no object with a custom `__eq__`), and the harness rejects
any result that is not a plain bool, int, str or list. The expected values live only in
the check's source, which the environment passes as `python -c` code, never as a file.

Pure and torch-free: the coordinator imports it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentjet.protocol import Task

DIFFICULTIES = (1, 2, 3)
# Parameters of a family: what its task id is made of.
Params = dict[str, Any]
# Data-bearing shell families draw one of this many variants of their files.
SHELL_VARIANTS = 10_000
# Wall-clock seconds the check gives the solution for all hidden cases together: a correct
# solution needs milliseconds, even naive recursion on the largest Fibonacci input.
SOLVE_TIMEOUT_S = 5

CODE_REPLY_FORMAT = "Reply with one ```python code block."
# Words for generated strings and files: lowercase, of 2 to 6 letters.
WORDS = (
    "cat", "sun", "tree", "house", "river", "moon", "garden", "yellow", "window", "planet",
    "go", "to", "be", "sky", "bread", "stone", "music", "friend", "ocean", "cloud", "paper",
)  # fmt: skip


@dataclass(frozen=True)
class Made:
    """A task with what the tests need and the model must not see."""

    task: Task
    params: Params
    reference: str  # a solution that passes the check: Python source, or shell commands


@dataclass(frozen=True)
class Family:
    """A kind of task: `draw` picks the parameters that name one, `build` makes it."""

    name: str
    difficulty: int
    draw: Callable[[random.Random], Params]
    build: Callable[[Params, str], Made]  # (parameters, environment name)

    def make(self, rng: random.Random, env: str) -> Made:
        return self.build(self.draw(rng), env)


def make_code_task(rng: random.Random, difficulty: int, env: str = "python_code") -> Task:
    """A "write solve(...)" task of `difficulty`, verified on hidden inputs."""
    return _pick(CODE_FAMILIES, rng, difficulty).make(rng, env).task


def make_shell_task(rng: random.Random, difficulty: int, env: str = "shell") -> Task:
    """A file-system task of `difficulty`, done with shell commands, verified on the files."""
    return _pick(SHELL_FAMILIES, rng, difficulty).make(rng, env).task


def reference_solution(task: Task) -> str:
    """A solution that passes `task.check`, for tests and demos (never for the model): the
    Python source of solution.py for a code task, shell commands for a shell task.

    Rebuilt from the task id; ValueError for a task this module did not make.
    """
    kind, name, *values = task.id.split(":")
    family = {"code": CODE_FAMILIES, "shell": SHELL_FAMILIES}.get(kind, {}).get(name)
    if family is not None:
        names = family.draw(random.Random(0)).keys()  # every draw names the same parameters
        if len(names) == len(values):
            params = {k: int(v) if v.isdigit() else v for k, v in zip(names, values, strict=True)}
            try:
                made = family.build(params, task.env)
            except (TypeError, ValueError):  # a parameter no draw would give: not our task
                made = None
            if made is not None and made.task == task:
                return made.reference
    raise ValueError(f"task {task.id!r} was not made by agentjet.sandbox_tasks")


def _pick(families: dict[str, Family], rng: random.Random, difficulty: int) -> Family:
    choices = [f for f in families.values() if f.difficulty == difficulty]
    if not choices:
        raise ValueError(f"no task family of difficulty {difficulty}; pick from {DIFFICULTIES}")
    return rng.choice(choices)


def _task_id(kind: str, name: str, params: Params) -> str:
    return ":".join([kind, name, *(str(v) for v in params.values())])


# ── write-a-function tasks ────────────────────────────────────────────────────────


@dataclass(frozen=True)
class _CodeSpec:
    """One code task: what solve must do, a reference, and hidden inputs (edge cases too)."""

    signature: str  # "solve(xs)"
    does: str  # completes "Write a Python function solve(xs) that …"
    solve: Callable[[Any], Any]
    source: str  # the same reference, as a solution.py
    inputs: list[Any]


# Opens every check. `python -c` puts the work dir first on sys.path: without this, a
# json.py planted there would be the json the check imports.
_CHECK_PRELUDE = """\
import os
import sys

sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != os.path.realpath(".")]


def fail(reason):
    print(reason, file=sys.stderr)
    sys.exit(1)


"""

# Runs in a child interpreter, so nothing the solution does can end the check with code 0.
_SOLUTION_HARNESS = """\
import json
import sys

inputs = json.loads(sys.argv[1])
results_out, sys.stdout = sys.stdout, sys.stderr  # the solution's prints are not results
from solution import solve


def plain(value):
    if type(value) in (bool, int, str):
        return value
    if type(value) is list:
        return [plain(item) for item in value]
    raise TypeError(f"solve returned a {type(value).__name__}, not a bool, int, str or list")


results_out.write(json.dumps([plain(solve(x)) for x in inputs]))
"""

# Preceded by _CHECK_PRELUDE and the constants HARNESS, INPUTS, EXPECTED, SOLVE_TIMEOUT_S.
_CODE_CHECK_BODY = """
import json
import subprocess

if not os.path.isfile("solution.py"):
    fail("solution.py is missing")
try:
    run = subprocess.run(
        [sys.executable, "-c", HARNESS, json.dumps(INPUTS)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=SOLVE_TIMEOUT_S,
    )
except subprocess.TimeoutExpired:
    fail(f"solve did not return within {SOLVE_TIMEOUT_S} s")
if run.returncode != 0:
    last = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
    fail(f"solution failed: {last}")
try:
    results = json.loads(run.stdout)
except ValueError:
    fail("solution.py ended the program before solve returned")
if type(results) is not list or len(results) != len(INPUTS):
    fail("solution.py wrote something other than the results")
for x, got, want in zip(INPUTS, results, EXPECTED):
    # JSON text tells True from 1: == alone would not.
    if json.dumps(got) != json.dumps(want):
        fail(f"solve({x!r}) returned {got!r}, expected {want!r}")
"""


def _code_family(
    name: str,
    difficulty: int,
    draw: Callable[[random.Random], Params],
    build: Callable[[Params, random.Random], _CodeSpec],
) -> Family:
    def build_task(params: Params, env: str) -> Made:
        task_id = _task_id("code", name, params)
        spec = build(params, random.Random(task_id))
        expected = [spec.solve(x) for x in spec.inputs]
        constants = {
            "HARNESS": _SOLUTION_HARNESS,
            "INPUTS": spec.inputs,
            "EXPECTED": expected,
            "SOLVE_TIMEOUT_S": SOLVE_TIMEOUT_S,
        }
        task = Task(
            id=task_id,
            env=env,
            prompt=f"Write a Python function {spec.signature} that {spec.does}. "
            + CODE_REPLY_FORMAT,
            op=name,
            difficulty=difficulty,
            check=_CHECK_PRELUDE + _constants(constants) + _CODE_CHECK_BODY,
        )
        return Made(task=task, params=params, reference=spec.source)

    return Family(name, difficulty, draw, build_task)


def _constants(values: dict[str, Any]) -> str:
    return "".join(f"{name} = {value!r}\n" for name, value in values.items())


def _ints(r: random.Random, count: int, low: int = -50, high: int = 99) -> list[int]:
    return [r.randint(low, high) for _ in range(count)]


def _letters(r: random.Random, count: int, alphabet: str = "abcdefghijklmnopqrstuvwxyz") -> str:
    return "".join(r.choice(alphabet) for _ in range(count))


def _mul(p: Params, r: random.Random) -> _CodeSpec:
    k = p["k"]
    return _CodeSpec(
        signature="solve(x)",
        does=f"returns the integer x multiplied by {k}",
        solve=lambda x: x * k,
        source=f"def solve(x):\n    return x * {k}\n",
        inputs=[0, r.randint(1, 9), -r.randint(1, 50), r.randint(10, 999), r.randint(-999, -10)],
    )


def _add(p: Params, r: random.Random) -> _CodeSpec:
    k = p["k"]
    return _CodeSpec(
        signature="solve(x)",
        does=f"returns the integer x plus {k}",
        solve=lambda x: x + k,
        source=f"def solve(x):\n    return x + {k}\n",
        inputs=[0, r.randint(1, 9), -r.randint(1, 50), r.randint(10, 999), r.randint(-999, -10)],
    )


def _divisible(p: Params, r: random.Random) -> _CodeSpec:
    k = p["k"]
    return _CodeSpec(
        signature="solve(n)",
        does=f"returns True if the integer n is divisible by {k}, else False",
        solve=lambda n: n % k == 0,
        source=f"def solve(n):\n    return n % {k} == 0\n",
        inputs=[
            0,
            k * r.randint(2, 30),
            k * r.randint(2, 30) + r.randint(1, k - 1),
            -k * r.randint(1, 10),
            r.randint(1, 300),
        ],
    )


def _reverse(p: Params, r: random.Random) -> _CodeSpec:
    return _CodeSpec(
        signature="solve(s)",
        does="returns the string s reversed",
        solve=lambda s: s[::-1],
        source="def solve(s):\n    return s[::-1]\n",
        inputs=["", _letters(r, 1), r.choice(WORDS), " ".join(r.sample(WORDS, 2)), "Hello"],
    )


def _sum(p: Params, r: random.Random) -> _CodeSpec:
    return _CodeSpec(
        signature="solve(xs)",
        does="returns the sum of the numbers in the list xs (0 for an empty list)",
        solve=sum,
        source="def solve(xs):\n    return sum(xs)\n",
        inputs=[[], _ints(r, 1), _ints(r, r.randint(3, 6)), _ints(r, 4, 0, 99), [0, 0, 0]],
    )


def _extreme(p: Params, r: random.Random) -> _CodeSpec:
    which = p["which"]
    pick = max if which == "max" else min
    top = r.randint(-50, 99)
    return _CodeSpec(
        signature="solve(xs)",
        does=f"returns the {'largest' if which == 'max' else 'smallest'} number in the "
        "list xs (xs is never empty)",
        solve=pick,
        source=f"def solve(xs):\n    return {which}(xs)\n",
        inputs=[_ints(r, 1), _ints(r, 4, -99, -1), _ints(r, 5), [top, top, 0], _ints(r, 6)],
    )


def _count_char(p: Params, r: random.Random) -> _CodeSpec:
    c = p["char"]
    others = "".join(ch for ch in "abcdefghijklmnopqrstuvwxyz" if ch != c)

    def with_c(times: int) -> str:
        chars = list(_letters(r, r.randint(3, 8), others))
        for _ in range(times):
            chars.insert(r.randint(0, len(chars)), c)
        return "".join(chars)

    return _CodeSpec(
        signature="solve(s)",
        does=f"returns how many times the letter {c!r} appears in the string s",
        solve=lambda s: s.count(c),
        source=f"def solve(s):\n    return s.count({c!r})\n",
        inputs=["", with_c(0), with_c(1), with_c(r.randint(2, 4)), c * r.randint(2, 5)],
    )


def _sort(p: Params, r: random.Random) -> _CodeSpec:
    descending = p["order"] == "desc"
    order = "from largest to smallest" if descending else "from smallest to largest"
    return _CodeSpec(
        signature="solve(xs)",
        does=f"returns a new list with the numbers of the list xs sorted {order}",
        solve=lambda xs: sorted(xs, reverse=descending),
        source=f"def solve(xs):\n    return sorted(xs, reverse={descending})\n",
        inputs=[[], _ints(r, 1), _ints(r, 3, 0, 9) * 2, sorted(_ints(r, 5)), _ints(r, 6)],
    )


def _prefix(p: Params, r: random.Random) -> _CodeSpec:
    k = p["k"]
    return _CodeSpec(
        signature="solve(s)",
        does=f"returns the first {k} characters of the string s (all of s if it is shorter)",
        solve=lambda s: s[:k],
        source=f"def solve(s):\n    return s[:{k}]\n",
        inputs=["", _letters(r, k - 1), _letters(r, k), _letters(r, k + 1), _letters(r, k + 6)],
    )


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _fibonacci(p: Params, r: random.Random) -> _CodeSpec:
    return _CodeSpec(
        signature="solve(n)",
        does="returns the n-th Fibonacci number, where fib(0) = 0 and fib(1) = 1",
        solve=_fib,
        source=(
            "def solve(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
            "        a, b = b, a + b\n    return a\n"
        ),
        # Up to 20 only: a naive recursive solution is correct and must finish in time.
        inputs=[0, 1, 2, r.randint(3, 10), r.randint(11, 20)],
    )


def _palindrome(p: Params, r: random.Random) -> _CodeSpec:
    def mixed_case(s: str) -> str:
        return "".join(ch.upper() if r.random() < 0.3 else ch for ch in s)

    def palindrome() -> str:
        half = _letters(r, r.randint(2, 4))
        return half + _letters(r, r.randint(0, 1)) + half[::-1]

    near = list(palindrome())
    near[0] = "z" if near[-1] != "z" else "y"
    non = _letters(r, 5)
    while non == non[::-1]:
        non = _letters(r, 5)
    return _CodeSpec(
        signature="solve(s)",
        does="returns True if the string s reads the same backwards as forwards, "
        "ignoring upper and lower case, else False",
        solve=lambda s: s.lower() == s.lower()[::-1],
        source="def solve(s):\n    s = s.lower()\n    return s == s[::-1]\n",
        inputs=["", _letters(r, 1), mixed_case(palindrome()), non, "".join(near)],
    )


def _dedupe(p: Params, r: random.Random) -> _CodeSpec:
    distinct = r.sample(range(-20, 50), 4)
    repeated = _ints(r, 7, 0, 5)
    same = r.randint(0, 9)
    return _CodeSpec(
        signature="solve(xs)",
        does="returns the list xs without duplicates, keeping the first occurrence of each "
        "number, in order",
        solve=lambda xs: list(dict.fromkeys(xs)),
        source="def solve(xs):\n    return list(dict.fromkeys(xs))\n",
        inputs=[[], distinct, [same] * 3, repeated, [*distinct[:2], *distinct[::-1]]],
    )


def _long_words(p: Params, r: random.Random) -> _CodeSpec:
    k = p["k"]
    long = [w for w in WORDS if len(w) > k]
    short = [w for w in WORDS if len(w) <= k]
    return _CodeSpec(
        signature="solve(s)",
        does=f"returns how many words in the string s have more than {k} letters "
        "(words are separated by spaces)",
        solve=lambda s: sum(len(w) > k for w in s.split()),
        source=f"def solve(s):\n    return sum(len(w) > {k} for w in s.split())\n",
        inputs=[
            "",
            r.choice(long),
            r.choice(short),
            " ".join(r.choices(WORDS, k=r.randint(4, 7))),
            " ".join([*r.sample(long, 2), *r.sample(short, 2)]),
        ],
    )


CODE_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _code_family("mul", 1, lambda rng: {"k": rng.randint(2, 12)}, _mul),
        _code_family("add", 1, lambda rng: {"k": rng.randint(1, 50)}, _add),
        _code_family("divisible", 1, lambda rng: {"k": rng.randint(2, 9)}, _divisible),
        _code_family("reverse", 1, lambda rng: {}, _reverse),
        _code_family("sum", 2, lambda rng: {}, _sum),
        _code_family("extreme", 2, lambda rng: {"which": rng.choice(("max", "min"))}, _extreme),
        _code_family("count_char", 2, lambda rng: {"char": rng.choice("aeiourstn")}, _count_char),
        _code_family("sort", 2, lambda rng: {"order": rng.choice(("asc", "desc"))}, _sort),
        _code_family("prefix", 2, lambda rng: {"k": rng.randint(1, 6)}, _prefix),
        _code_family("fib", 3, lambda rng: {}, _fibonacci),
        _code_family("palindrome", 3, lambda rng: {}, _palindrome),
        _code_family("dedupe", 3, lambda rng: {}, _dedupe),
        _code_family("long_words", 3, lambda rng: {"k": rng.randint(2, 5)}, _long_words),
    )
}


# ── shell tasks ───────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class _ShellSpec:
    """One shell task: its files, what the check's body tests, and a reference solution."""

    prompt: str
    setup: dict[str, str]
    constants: dict[str, Any]  # named values the body reads
    body: str
    keep: dict[str, str]  # files the task must leave exactly as they were
    reference: str  # shell commands


# After _CHECK_PRELUDE; followed by the constants, the family's body, _SHELL_CHECK_EPILOGUE.
_READ_FILE = """\
def read(path):
    # A link is not the file the task asked for.
    if os.path.islink(path) or not os.path.isfile(path):
        fail(f"{path} is missing or not a regular file")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


"""

_SHELL_CHECK_EPILOGUE = """
for path, text in KEEP.items():
    if read(path) != text:
        fail(f"{path} was changed")
"""

_NUMBER_IN_FILE = """
if read(TARGET).strip() != str(NUMBER):
    fail(f"{TARGET} does not hold just the number {NUMBER}")
"""


def _shell_family(
    name: str,
    difficulty: int,
    draw: Callable[[random.Random], Params],
    build: Callable[[Params, random.Random], _ShellSpec],
) -> Family:
    def build_task(params: Params, env: str) -> Made:
        task_id = _task_id("shell", name, params)
        spec = build(params, random.Random(task_id))
        check = (
            _CHECK_PRELUDE
            + _READ_FILE
            + _constants({**spec.constants, "KEEP": spec.keep})
            + spec.body
            + _SHELL_CHECK_EPILOGUE
        )
        task = Task(
            id=task_id,
            env=env,
            prompt=spec.prompt,
            op=name,
            difficulty=difficulty,
            setup=tuple(sorted(spec.setup.items())),
            check=check,
        )
        return Made(task=task, params=params, reference=spec.reference)

    return Family(name, difficulty, draw, build_task)


def _lines(r: random.Random, low: int = 1, high: int = 3) -> str:
    """A few lines of words, each ended by a newline."""
    return "".join(" ".join(r.sample(WORDS, 3)) + "\n" for _ in range(r.randint(low, high)))


def _create(p: Params, r: random.Random) -> _ShellSpec:
    file, word = p["file"], p["word"]
    return _ShellSpec(
        prompt=f"Create a file named {file} that contains the word {word}.",
        setup={},
        constants={"FILE": file, "WORD": word},
        body="""
if read(FILE).strip() != WORD:
    fail(f"{FILE} does not contain just the word {WORD}")
""",
        keep={},
        reference=f"echo {word} > {file}",
    )


def _rename(p: Params, r: random.Random) -> _ShellSpec:
    old, new = p["old"], p["new"]
    text = _lines(r, 2, 4)
    return _ShellSpec(
        prompt=f"Rename the file {old} to {new}.",
        setup={old: text},
        constants={"OLD": old, "NEW": new, "TEXT": text},
        body="""
if os.path.lexists(OLD):
    fail(f"{OLD} still exists")
if read(NEW) != TEXT:
    fail(f"{NEW} does not hold the text of {OLD}")
""",
        keep={},
        reference=f"mv {old} {new}",
    )


def _append(p: Params, r: random.Random) -> _ShellSpec:
    file, word = p["file"], p["word"]
    lines = [" ".join(r.sample(WORDS, 2)) for _ in range(r.randint(2, 4))]
    return _ShellSpec(
        prompt=f"Add the line {word} to the end of the file {file}.",
        setup={file: "".join(line + "\n" for line in lines)},
        constants={"FILE": file, "LINES": lines, "LINE": word},
        body="""
if read(FILE).splitlines() != LINES + [LINE]:
    fail(f"{FILE} is not its old lines followed by the line {LINE}")
""",
        keep={},
        reference=f"echo {word} >> {file}",
    )


def _sum_file(p: Params, r: random.Random) -> _ShellSpec:
    target = p["target"]
    numbers = [r.randint(1, 99) for _ in range(r.randint(3, 6))]
    text = "".join(f"{n}\n" for n in numbers)
    return _ShellSpec(
        prompt=f"The file numbers.txt holds one integer per line. Write their sum into {target}.",
        setup={"numbers.txt": text},
        constants={"TARGET": target, "NUMBER": sum(numbers)},
        body=_NUMBER_IN_FILE,
        keep={"numbers.txt": text},
        reference=f"s=0; while read n; do s=$((s + n)); done < numbers.txt; echo $s > {target}",
    )


def _backup(p: Params, r: random.Random) -> _ShellSpec:
    directory = p["dir"]
    logs = {f"{stem}.log": _lines(r) for stem in r.sample(("app", "error", "access", "debug"), 2)}
    # Near misses: names that mention "log" without ending in .log.
    others = {name: _lines(r) for name in r.sample(("readme.txt", "changelog.md", "log.txt"), 2)}
    return _ShellSpec(
        prompt=f"Create a directory named {directory} and copy every .log file into it.",
        setup=logs | others,
        constants={"DIR": directory, "LOGS": logs},
        body="""
if os.path.islink(DIR) or not os.path.isdir(DIR):
    fail(f"{DIR} is not a directory")
copied = sorted(os.listdir(DIR))
if copied != sorted(LOGS):
    fail(f"{DIR} holds {copied}, not the .log files {sorted(LOGS)}")
for name, text in LOGS.items():
    if read(os.path.join(DIR, name)) != text:
        fail(f"{DIR}/{name} is not a copy of {name}")
""",
        keep=logs | others,
        reference=f"mkdir {directory} && cp *.log {directory}/",
    )


def _delete(p: Params, r: random.Random) -> _ShellSpec:
    ext = p["ext"]
    stems = r.sample(("cache", "draft", "session", "scratch", "copy", "notes", "plan"), 5)
    doomed = [stem + ext for stem in stems[:3]]
    # The near miss ends in ext + ".txt": it stays.
    kept = {f"{stems[3]}.txt": _lines(r), f"{stems[4]}{ext}.txt": _lines(r)}
    return _ShellSpec(
        prompt=f"Delete every file whose name ends in {ext}.",
        setup={name: _lines(r) for name in doomed} | kept,
        constants={"DOOMED": doomed},
        body="""
for name in DOOMED:
    if os.path.lexists(name):
        fail(f"{name} still exists")
""",
        keep=kept,
        reference=f"rm -- *{ext}",
    )


_CSV_COLUMNS = (
    ("anna", "bruno", "clara", "diego", "elena", "farid"),
    ("paris", "rome", "oslo", "lima", "cairo", "quito"),
    ("apple", "pear", "plum", "mango", "kiwi", "lemon"),
)


def _count_lines(p: Params, r: random.Random) -> _ShellSpec:
    word = p["word"]
    rows = [[r.choice(column) for column in _CSV_COLUMNS] for _ in range(r.randint(5, 8))]
    column = next(i for i, values in enumerate(_CSV_COLUMNS) if word in values)
    rows[r.randrange(len(rows))][column] = word  # at least one line has it
    text = "name,city,fruit\n" + "".join(",".join(row) + "\n" for row in rows)
    return _ShellSpec(
        prompt=f"Write the number of lines of data.csv that contain the word {word} "
        "into count.txt.",
        setup={"data.csv": text},
        constants={
            "TARGET": "count.txt",
            "NUMBER": sum(word in line for line in text.splitlines()),
        },
        body=_NUMBER_IN_FILE,
        keep={"data.csv": text},
        reference=f"grep -c -F {word} data.csv > count.txt",
    )


def _list_files(p: Params, r: random.Random) -> _ShellSpec:
    ext = p["ext"]
    # No stem is a prefix of another, so every locale sorts the names the same way.
    stems = r.sample(("alpha", "bravo", "delta", "echo", "golf", "hotel", "kilo", "oscar"), 6)
    matching = sorted(stem + ext for stem in stems[: r.randint(2, 4)])
    other_exts = [e for e in (".csv", ".md", ".py", ".log", ".txt") if e != ext]
    files = {name: _lines(r) for name in matching} | {
        stem + r.choice(other_exts): _lines(r) for stem in stems[len(matching) :]
    }
    return _ShellSpec(
        prompt=f"Write the names of all {ext} files, sorted, one per line, into list.txt.",
        setup=files,
        constants={"TARGET": "list.txt", "NAMES": matching},
        body="""
names = [line.strip() for line in read(TARGET).splitlines() if line.strip()]
if names != NAMES:
    fail(f"{TARGET} lists {names}, not {NAMES}")
""",
        keep=files,
        reference=f"ls *{ext} > list.txt",
    )


_COLORS = ("red", "blue", "green", "black", "white", "pink", "gray", "brown")


def _replace(p: Params, r: random.Random) -> _ShellSpec:
    old, new = p["old"], p["new"]
    keys = r.sample(("wall", "door", "roof", "fence", "gate", "shed"), r.randint(4, 6))
    values = [r.sample(_COLORS, 2) for _ in keys]
    twice, once = r.sample(range(len(keys)), 2)
    values[twice] = [old, old]  # a line with two: replacing only the first is wrong
    values[once][0] = old
    lines = [f"{key}={','.join(colors)}" for key, colors in zip(keys, values, strict=True)]
    return _ShellSpec(
        prompt=f"In the file config.txt, replace every {old} with {new}.",
        setup={"config.txt": "".join(line + "\n" for line in lines)},
        constants={"FILE": "config.txt", "AFTER": [line.replace(old, new) for line in lines]},
        body="""
if read(FILE).splitlines() != AFTER:
    fail(f"{FILE} is not its old text with the words replaced")
""",
        keep={},
        reference=f"sed -i 's/{old}/{new}/g' config.txt",
    )


def _variant(rng: random.Random) -> int:
    return rng.randrange(SHELL_VARIANTS)


def _two_colors(rng: random.Random) -> Params:
    old, new = rng.sample(_COLORS, 2)
    return {"old": old, "new": new, "variant": _variant(rng)}


SHELL_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _shell_family(
            "create",
            1,
            lambda rng: {
                "file": rng.choice(("hello.txt", "greeting.txt", "word.txt", "note.txt")),
                "word": rng.choice(WORDS),
            },
            _create,
        ),
        _shell_family(
            "rename",
            1,
            lambda rng: {
                "old": rng.choice(("notes.txt", "draft.txt", "todo.txt", "report.txt")),
                "new": rng.choice(("done.txt", "final.txt", "archive.txt", "old.txt")),
            },
            _rename,
        ),
        _shell_family(
            "append",
            1,
            lambda rng: {
                "file": rng.choice(("notes.txt", "todo.txt", "words.txt", "items.txt")),
                "word": rng.choice(WORDS),
            },
            _append,
        ),
        _shell_family(
            "sum",
            2,
            lambda rng: {
                "target": rng.choice(("total.txt", "sum.txt", "result.txt")),
                "variant": _variant(rng),
            },
            _sum_file,
        ),
        _shell_family(
            "backup",
            2,
            lambda rng: {
                "dir": rng.choice(("backup", "logs_backup", "archive")),
                "variant": _variant(rng),
            },
            _backup,
        ),
        _shell_family(
            "delete",
            2,
            lambda rng: {"ext": rng.choice((".tmp", ".bak", ".old")), "variant": _variant(rng)},
            _delete,
        ),
        _shell_family(
            "count_lines",
            3,
            lambda rng: {
                "word": rng.choice([w for column in _CSV_COLUMNS for w in column]),
                "variant": _variant(rng),
            },
            _count_lines,
        ),
        _shell_family(
            "list_files",
            3,
            lambda rng: {
                "ext": rng.choice((".csv", ".md", ".py", ".log")),
                "variant": _variant(rng),
            },
            _list_files,
        ),
        _shell_family("replace", 3, _two_colors, _replace),
    )
}


TASK_MAKERS: dict[str, Callable[[random.Random, int, str], Task]] = {
    "python_code": make_code_task,
    "shell": make_shell_task,
}
