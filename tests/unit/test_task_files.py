"""Task files: any row shape, in every format datasets come in, each bad row named."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agentjet.errors import TaskFileError
from agentjet.protocol import Message, Task
from agentjet.task_files import TaskColumns, load_tasks, task_row
from agentjet.tasks import TaskSource, generate_tasks, write_task_file

pytestmark = pytest.mark.unit

ROWS: list[dict[str, Any]] = [
    {"id": "q1", "prompt": "Capital of France?", "answer": "Paris", "topic": "geo"},
    {
        "id": "q2",
        "prompt": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Opposite of hot?"},
        ],
        "answer": ["cold", "cool"],
        "meta": {"source": "hand", "tags": [1, 2]},
    },
    {"id": 3, "prompt": "2 + 2?", "answer": 4.0, "difficulty": 1},
]


def jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_rows_carry_chat_prompts_any_answer_and_their_other_fields(tmp_path: Path) -> None:
    tasks = load_tasks(jsonl(tmp_path / "t.jsonl", ROWS), "prompt").tasks
    q1, q2, q3 = tasks
    assert (q1.prompt, q1.answer, q1.fields) == ("Capital of France?", "Paris", {"topic": "geo"})
    assert q2.prompt == (
        Message(role="system", content="Answer in one word."),
        Message(role="user", content="Opposite of hot?"),
    )
    assert q2.answer == ["cold", "cool"]
    assert q2.fields == {"meta": {"source": "hand", "tags": [1, 2]}}
    assert (q3.id, q3.answer, q3.difficulty) == ("3", 4.0, 1)  # an integer id becomes text
    # What a reward function is given: the row, untouched
    assert task_row(q2) == ROWS[1]
    assert task_row(q1) == ROWS[0]
    # ...and what crosses the wire comes back equal
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(q2), type=Task)
    assert wire == q2


def test_a_task_file_round_trips_through_write_task_file(tmp_path: Path) -> None:
    tasks = generate_tasks(12, seed=3) + load_tasks(jsonl(tmp_path / "a.jsonl", ROWS), "x").tasks
    path = tmp_path / "b.jsonl"
    write_task_file([t for t in tasks if t.env == "arithmetic"], path)
    assert load_tasks(path, "arithmetic").tasks == tasks[:12]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", "dataset"])
def test_every_format_reads_the_same_rows_with_a_column_mapping(
    tmp_path: Path, suffix: str
) -> None:
    rows = [
        {"uid": f"r{i}", "question": f"What is {i} + 1?", "solution": str(i + 1), "lang": "en"}
        for i in range(5)
    ]
    path = tmp_path / f"tasks{suffix}"
    if suffix == ".jsonl":
        jsonl(path, rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    else:  # what `datasets` saves, made by `datasets` itself
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    columns = TaskColumns(id="uid", prompt="question", answer="solution")
    tasks = load_tasks(path, "prompt", columns).tasks
    assert [(t.id, t.prompt, t.answer, t.fields) for t in tasks] == [
        (r["uid"], r["question"], r["solution"], {"lang": "en"}) for r in rows
    ]
    # arithmetic environments take "5" (a CSV cell) as the integer it is
    assert [t.answer for t in load_tasks(path, "arithmetic", columns).tasks] == [1, 2, 3, 4, 5]


def test_a_dataset_dicts_split_is_chosen_by_name(tmp_path: Path) -> None:
    import datasets

    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list([{"prompt": "a?", "answer": 1}] * 3),
        test=datasets.Dataset.from_list([{"prompt": "b?", "answer": 2}]),
    )
    splits.save_to_disk(str(tmp_path / "ds"))
    train = load_tasks(tmp_path / "ds", "prompt").tasks  # train by default
    assert [t.prompt for t in train] == ["a?"] * 3
    assert [t.id for t in train] == ["row-0", "row-1", "row-2"]  # no id column: row numbers
    assert [t.prompt for t in load_tasks(tmp_path / "ds", "prompt", split="test").tasks] == ["b?"]
    with pytest.raises(TaskFileError, match="split 'dev' is not one of"):
        load_tasks(tmp_path / "ds", "prompt", split="dev")


BAD_ROWS: list[tuple[Any, str]] = [
    ({"prompt": "no id, though others have one"}, "line 2: field 'id' is missing"),
    ({"id": "b"}, "line 2: field 'prompt' is missing"),
    ({"id": "b", "prompt": ""}, "line 2: field 'prompt': the prompt is empty"),
    ({"id": "b", "prompt": 7}, "line 2: field 'prompt': must be a string or a list"),
    ({"id": "b", "prompt": [{"role": "robot", "content": "x"}]}, "message 0 must be"),
    (
        {
            "id": "b",
            "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        },
        "the last message must be the user's",
    ),  # fmt: skip
    ({"id": "a", "prompt": "duplicate"}, "line 2: field 'id': duplicate id 'a'"),
    ({"id": True, "prompt": "p"}, "field 'id': an id is a non-empty string or integer"),
    ({"id": "b", "prompt": "p", "difficulty": -1}, "field 'difficulty'"),
    ({"id": "b", "prompt": "p", "setup": ["a"]}, "field 'setup'"),
    (["not", "an", "object"], "line 2: a row must be an object with named fields, not list"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_ROWS)
def test_a_bad_row_is_named_by_line_and_field_and_stops_the_load(
    tmp_path: Path, bad: Any, message: str
) -> None:
    path = jsonl(tmp_path / "t.jsonl", [{"id": "a", "prompt": "fine"}, bad])
    with pytest.raises(TaskFileError, match=message) as error:
        load_tasks(path, "prompt")
    assert str(error.value).startswith(f"task file {path} line 2: ")
    assert "\n" not in str(error.value)


def test_bad_rows_can_be_skipped_and_counted_instead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"id": "a", "prompt": "fine"}] + [bad for bad, _ in BAD_ROWS]
    path = jsonl(tmp_path / "t.jsonl", rows)
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(TaskFileError, match="not JSON"):  # unreadable: the file is broken
        load_tasks(path, "prompt", bad_rows="skip")
    jsonl(path, rows)
    with caplog.at_level(logging.WARNING):
        loaded = load_tasks(path, "prompt", bad_rows="skip")
    assert [t.id for t in loaded.tasks] == ["a"]
    assert len(loaded.skipped) == len(BAD_ROWS)
    assert sum("skipped: task file" in r.message for r in caplog.records) == len(BAD_ROWS)
    source = TaskSource("prompt", task_file=str(path), bad_rows="skip")
    assert source.skipped == len(BAD_ROWS) and [t.id for t in source.rows or []] == ["a"]


@pytest.mark.parametrize(
    ("env", "row", "error"),
    [
        (
            "shell",
            {"id": "a", "prompt": "p"},
            "line 1: field 'check': shell tasks need a \"check\"",
        ),
        ("python_code", {"id": "a", "prompt": "p", "answer": 1}, 'need a "check"'),
        ("arithmetic", {"id": "a", "prompt": "p", "check": "x"}, "need an integer answer"),
        ("arithmetic", {"id": "a", "prompt": "p", "answer": "Paris"}, "need an integer answer"),
        ("react", {"id": "a", "prompt": "p", "answer": 1.5}, "need an integer answer"),
    ],
)
def test_built_in_environments_keep_their_checks(
    tmp_path: Path, env: str, row: dict[str, object], error: str
) -> None:
    with pytest.raises(TaskFileError, match=error):
        load_tasks(jsonl(tmp_path / "t.jsonl", [row]), env)


def test_sandboxed_task_rows_carry_setup_files_and_checks(tmp_path: Path) -> None:
    row = {
        "id": "count",
        "prompt": "Count the lines of a.txt into n.txt.",
        "setup": {"a.txt": "1\n2\n", "sub/b.txt": "x"},
        "check": "import sys; sys.exit(open('n.txt').read().strip() != '2')",
        "difficulty": 2,
    }
    [task] = load_tasks(jsonl(tmp_path / "t.jsonl", [row]), "shell").tasks
    assert task == Task(
        id="count",
        env="shell",
        prompt=row["prompt"],  # type: ignore[arg-type]
        difficulty=2,
        setup=(("a.txt", "1\n2\n"), ("sub/b.txt", "x")),
        check=row["check"],  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        ("t.jsonl", "", "has no tasks"),
        ("t.json", '{"rows": []}', "a JSON task file holds a list of rows"),
        ("t.json", "[1, 2", "not JSON"),
        ("t.parquet", "not parquet", "task file"),
        ("missing.jsonl", None, "No such file"),
        ("folder", "dir", "a folder must be a dataset saved by `datasets`"),
    ],
)
def test_unreadable_files_fail_in_one_line(
    tmp_path: Path, name: str, content: str | None, error: str
) -> None:
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(TaskFileError, match=error) as raised:
        load_tasks(path, "prompt")
    assert "\n" not in str(raised.value)
