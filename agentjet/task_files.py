"""Task files: your dataset as tasks, in the formats datasets come in.

    file ──read_rows──▶ raw rows (dicts) ──TaskColumns: rename id/prompt/answer──▶ row checks
         .jsonl  one JSON object per line          id      a string or integer ("row-N"
         .json   a list of objects                          when the file has no id column)
         .csv    a header row, then text cells     prompt  a string, or chat messages
         .parquet (pyarrow)                                 [{"role", "content"}, ...]
         a folder `datasets` saved (save_to_disk;  answer  any JSON value
           a DatasetDict's split by name)          other   kept untouched in Task.fields
                                                    ──▶ Task(env, ...), or one line per bad row

Pure and torch-free (the coordinator loads task files too). A row is checked once, here:
a bad row is named by its line (JSONL, CSV) or row number (the others) and its field, and
stops the load (`bad_rows = "stop"`) or is left out and counted (`"skip"`). What the
built-in environments need keeps its meaning: arithmetic ones need an integer `answer`
(CSV's "42" counts), sandboxed ones a `check` program (and optional `setup` files).
Parquet and dataset folders need pyarrow (the `data` extra); other formats need nothing.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentjet.errors import TaskFileError
from agentjet.protocol import MESSAGE_ROLES, Message, Task

log = logging.getLogger(__name__)

MAX_TASK_FILE_ROWS = 1_000_000
# Bad rows named one by one in the log when they are skipped; the rest are counted.
MAX_LOGGED_BAD_ROWS = 20
# Environments whose tasks are scored against an integer `answer`.
INTEGER_ANSWER_ENVS = ("arithmetic", "python_tool", "react")
# Environments whose tasks are scored by running their `check` program in a sandbox.
CHECKED_ENVS = ("python_code", "shell")
# Row fields with a meaning of their own (beyond id, prompt and answer).
_BUILT_IN = ("op", "difficulty", "setup", "check")

BadRows = Literal["stop", "skip"]


@dataclass(frozen=True)
class TaskColumns:
    """Which of a file's columns hold the id, the prompt and the answer."""

    id: str = "id"
    prompt: str = "prompt"
    answer: str = "answer"


DEFAULT_COLUMNS = TaskColumns()


@dataclass
class LoadedTasks:
    tasks: list[Task]
    skipped: list[str] = field(default_factory=list)  # one line per bad row left out


def load_tasks(
    path: str | Path,
    env: str,
    columns: TaskColumns = DEFAULT_COLUMNS,
    bad_rows: BadRows = "stop",
    split: str = "",
) -> LoadedTasks:
    """The tasks of a task file (see the module docstring); TaskFileError for a file that
    cannot be read, a bad row (with `bad_rows = "stop"`) or a file with no good row."""
    path = Path(path).expanduser()
    where = f"task file {path}"
    rows = list(_read_rows(path, split))
    if not rows:
        raise TaskFileError(f"{where} has no tasks")
    if len(rows) > MAX_TASK_FILE_ROWS:
        raise TaskFileError(f"{where}: more than {MAX_TASK_FILE_ROWS} rows")
    has_ids = any(isinstance(row, dict) and columns.id in row for _, row in rows)
    tasks: list[Task] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for number, (place, row) in enumerate(rows):
        try:
            task = row_task(row, env, columns, None if has_ids else f"row-{number}")
            if task.id in seen:
                raise TaskFileError(f"field {columns.id!r}: duplicate id {task.id!r}")
        except TaskFileError as e:
            problem = f"{where} {place}: {e}"
            if bad_rows == "stop":
                raise TaskFileError(problem) from None
            skipped.append(problem)
            continue
        seen.add(task.id)
        tasks.append(task)
    for problem in skipped[:MAX_LOGGED_BAD_ROWS]:
        log.warning("skipped: %s", problem)
    if len(skipped) > MAX_LOGGED_BAD_ROWS:
        log.warning("skipped %d more bad rows of %s", len(skipped) - MAX_LOGGED_BAD_ROWS, path)
    if not tasks:
        raise TaskFileError(f"{where} has no good rows ({len(skipped)} bad, e.g. {skipped[0]})")
    return LoadedTasks(tasks, skipped)


def row_task(row: Any, env: str, columns: TaskColumns, default_id: str | None) -> Task:
    """One raw row as a task of `env`; TaskFileError naming the field that is wrong."""
    if not isinstance(row, dict):
        raise TaskFileError(f"a row must be an object with named fields, not {_kind(row)}")
    row = dict(row)
    if columns.id in row:
        task_id = row.pop(columns.id)
        if isinstance(task_id, bool) or not isinstance(task_id, str | int) or task_id == "":
            raise TaskFileError(f"field {columns.id!r}: an id is a non-empty string or integer")
        task_id = str(task_id)
    elif default_id is not None:
        task_id = default_id
    else:
        raise TaskFileError(f"field {columns.id!r} is missing")
    if columns.prompt not in row:
        raise TaskFileError(f"field {columns.prompt!r} is missing")
    prompt = _prompt(row.pop(columns.prompt), columns.prompt)
    answer = row.pop(columns.answer, None)
    op = row.pop("op", "")
    difficulty = row.pop("difficulty", 0)
    setup = row.pop("setup", {})
    check = row.pop("check", "")
    if not isinstance(op, str):
        raise TaskFileError("field 'op': must be a string")
    if isinstance(difficulty, str) and difficulty.isdigit():  # a CSV cell
        difficulty = int(difficulty)
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or difficulty < 0:
        raise TaskFileError("field 'difficulty': must be a non-negative integer")
    if not isinstance(setup, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in setup.items()
    ):
        raise TaskFileError("field 'setup': must map file paths to their text")
    if not isinstance(check, str):
        raise TaskFileError("field 'check': must be a Python program (a string)")
    if env in INTEGER_ANSWER_ENVS:
        answer = _integer(answer, columns.answer, env)
    if env in CHECKED_ENVS and not check:
        raise TaskFileError(f"field 'check': {env} tasks need a \"check\" program")
    return Task(
        id=task_id,
        env=env,
        prompt=prompt,
        answer=answer,
        op=op,
        difficulty=difficulty,
        setup=tuple(setup.items()),
        check=check,
        fields=row,
    )


def _prompt(value: Any, name: str) -> str | tuple[Message, ...]:
    if isinstance(value, str):
        if not value.strip():
            raise TaskFileError(f"field {name!r}: the prompt is empty")
        return value
    if not isinstance(value, list) or not value:
        raise TaskFileError(f"field {name!r}: must be a string or a list of chat messages")
    messages = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or message.get("role") not in MESSAGE_ROLES
            or not isinstance(message.get("content"), str)
        ):
            roles = "/".join(MESSAGE_ROLES)
            raise TaskFileError(
                f'field {name!r}: message {i} must be {{"role": {roles}, "content": text}}'
            )
        messages.append(Message(role=message["role"], content=message["content"]))
    if messages[-1].role != "user":
        raise TaskFileError(f"field {name!r}: the last message must be the user's")
    return tuple(messages)


def _integer(value: Any, name: str, env: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():  # a CSV cell
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TaskFileError(f"field {name!r}: {env} tasks need an integer answer")
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ── reading the formats ─────────────────────────────────────────────────────────────


def _read_rows(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    """(where in the file, raw row) for every row."""
    try:
        if path.is_dir():
            yield from _numbered(_dataset_folder(path, split))
        elif path.suffix == ".json":
            yield from _numbered(_json_rows(path))
        elif path.suffix == ".csv":
            with path.open(newline="") as f:
                # DictReader's line_num is the line a row ends on: right for one-line rows.
                reader = csv.DictReader(f)
                for row in reader:
                    yield f"line {reader.line_num}", row
        elif path.suffix == ".parquet":
            yield from _numbered(_arrow().parquet.read_table(path).to_pylist())
        else:  # JSONL, whatever its name
            with path.open() as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield f"line {lineno}", _json_line(line, lineno, path)
    except OSError as e:
        raise TaskFileError(f"task file {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, csv.Error, ValueError) as e:  # pyarrow: ArrowInvalid
        raise TaskFileError(f"task file {path}: {e}") from None


def _numbered(rows: Any) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(rows, 1):
        yield f"row {i}", row


def _json_line(line: str, lineno: int, path: Path) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskFileError(f"task file {path} line {lineno}: not JSON ({e.msg})") from None


def _json_rows(path: Path) -> list[Any]:
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TaskFileError(f"task file {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(rows, list):
        raise TaskFileError(f"task file {path}: a JSON task file holds a list of rows")
    return rows


def _dataset_folder(path: Path, split: str) -> list[Any]:
    """The rows of a folder `datasets` saved: a Dataset (state.json and Arrow stream files)
    or a DatasetDict (dataset_dict.json and a folder per split; `split` names one, default
    "train", or the only one)."""
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = json.loads(splits_file.read_text()).get("splits", [])
        chosen = split or ("train" if "train" in splits else splits[0] if len(splits) == 1 else "")
        if chosen not in splits:
            raise TaskFileError(
                f"task file {path}: split {chosen or '(none given)'!r} is not one of {splits} "
                "(set task_split)"
            )
        path = path / chosen
    state_file = path / "state.json"
    if not state_file.is_file():
        raise TaskFileError(
            f"task file {path}: a folder must be a dataset saved by `datasets` (save_to_disk)"
        )
    files = [f["filename"] for f in json.loads(state_file.read_text()).get("_data_files", [])]
    ipc = _arrow().ipc
    rows: list[Any] = []
    for name in files:
        with ipc.open_stream(str(path / name)) as stream:
            rows += stream.read_all().to_pylist()
    return rows


def _arrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise TaskFileError(
            'Parquet files and dataset folders need pyarrow: pip install "agentjet[data]"'
        ) from None
    return pyarrow


def task_row(task: Task) -> dict[str, Any]:
    """A task as its row: what a reward function and an external agent are given (the
    file's own column names are not kept: id, prompt and answer go by these names)."""
    row: dict[str, Any] = {"id": task.id, "prompt": task.prompt_json()}
    if task.answer is not None:
        row["answer"] = task.answer
    for name in _BUILT_IN:
        value = getattr(task, name)
        if value:
            row[name] = dict(value) if name == "setup" else value
    return dict(task.fields) | row  # a column named like a built-in field is shadowed
