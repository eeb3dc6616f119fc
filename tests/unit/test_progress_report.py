"""Progress of the long operations a user waits on (agentjet/progress.py): a bar redrawn in place
on a terminal, a few plain lines in a log, and where `agentjet eval`, a hub download and a
trainer's resume send theirs. The clock is a fake one that tests move by hand."""

from __future__ import annotations

import functools
import io
import re
import types
from pathlib import Path
from typing import Any, BinaryIO, cast

import pytest
import torch

import node.evaluate
from agentjet.config import Config
from agentjet.episode import Episode
from agentjet.progress import PLAIN_LINE_EVERY_S, REDRAW_S, CountingReader, ProgressReport
from agentjet.protocol import Task
from agentjet.tasks import generate_tasks, write_task_file
from node.model import _HubBar, _HubProgress
from node.weights import RESUME_STATE, read_resume_state

pytestmark = pytest.mark.unit


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # whatever terminal runs the tests


def test_on_a_terminal_one_bar_is_redrawn_in_place_and_ended_with_a_newline() -> None:
    out, clock = Terminal(), Clock()
    with ProgressReport("eval arithmetic", 50, "tasks", out, clock=clock) as report:
        clock.now += 4.0
        report.update(20)
        clock.now += 0.05
        report.update(1)  # too soon after the last redraw: not drawn
        clock.now += 0.35
        report.update(1)
    assert 0.05 < REDRAW_S <= 0.35
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    frames = text.removesuffix("\n").split("\r")[1:]
    assert frames[0].startswith("eval arithmetic [------------------------] 0/50 tasks 0%")
    assert frames[1].rstrip() == (
        "eval arithmetic [##########--------------] 20/50 tasks 40% 5.0 tasks/s ETA 6 s"
    )
    assert "21/50" not in text
    assert frames[2].startswith("eval arithmetic [###########-------------] 22/50 tasks 44%")
    assert frames[3].rstrip().endswith("22/50 tasks 44% 5.0 tasks/s in 4.4 s")
    assert len(frames) == 4


def test_a_shorter_redraw_covers_the_longer_one_before_it() -> None:
    out, clock = Terminal(), Clock()
    report = ProgressReport("load", None, "steps", out, clock=clock)
    clock.now += 1.0
    report.update(2, "a long note that the next frame does not have")
    clock.now += 1.0
    report.update(2, "")
    first, second = out.getvalue().split("\r")[2:]
    assert len(second) == len(first) and second.rstrip() == "load 4 steps 2.0 steps/s"


def test_without_a_terminal_a_line_comes_at_most_every_few_seconds_then_a_summary() -> None:
    out, clock = io.StringIO(), Clock()
    with ProgressReport("eval arithmetic", 40, "tasks", out, clock=clock) as report:
        for _ in range(40):
            clock.now += 0.5
            report.update(1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # 20 s in all: a line at 5, 10 and 15 s, none at 20 s (the summary says it), the summary
    assert PLAIN_LINE_EVERY_S == 5.0
    assert lines == [
        "eval arithmetic: 10/40 tasks (25%), 2.0 tasks/s, ETA 15 s",
        "eval arithmetic: 20/40 tasks (50%), 2.0 tasks/s, ETA 10 s",
        "eval arithmetic: 30/40 tasks (75%), 2.0 tasks/s, ETA 5 s",
        "eval arithmetic: 40/40 tasks in 20.0 s (2.0 tasks/s)",
    ]


def test_a_quick_operation_prints_only_its_summary() -> None:
    out, clock = io.StringIO(), Clock()
    with ProgressReport("docker import", 3_000_000, "B", out, clock=clock) as report:
        clock.now += 2.0
        report.update(3_000_000)
    assert out.getvalue() == "docker import: 3.0 MB/3.0 MB in 2.0 s (1.5 MB/s)\n"


def test_an_unknown_total_shows_counts_and_rate_without_percent_or_eta() -> None:
    out, clock = io.StringIO(), Clock()
    with ProgressReport("debootstrap", None, "steps", out, clock=clock) as report:
        for step in range(12):
            clock.now += 0.5
            report.update(1, f"Unpacking package-{step}...")
    assert out.getvalue().splitlines() == [
        "debootstrap: 10 steps, Unpacking package-9..., 2.0 steps/s",
        "debootstrap: 12 steps in 6.0 s (2.0 steps/s)",
    ]
    terminal = Terminal()
    with ProgressReport("debootstrap", None, "steps", terminal, clock=clock) as report:
        clock.now += 1.0
        report.update(3, "Configuring libc6...")
    assert "%" not in terminal.getvalue() and "ETA" not in terminal.getvalue()
    assert terminal.getvalue().split("\r")[-1] == (
        "debootstrap 3 steps 3.0 steps/s in 1.0 s Configuring libc6...\n"
    )


def test_steps_of_unlike_length_get_a_line_each_without_rate_or_eta() -> None:
    out, clock = io.StringIO(), Clock()
    report = ProgressReport("convert", 2, "steps", out, line_every_s=0, rates=False, clock=clock)
    with report:
        report.update(0, "dequantizing")
        clock.now += 40.0
        report.update(1, "saving")
        clock.now += 2.0
        report.update(1, "saved")  # the summary follows: no line of its own
    assert out.getvalue().splitlines() == [
        "convert: 0/2 steps (0%), dequantizing",
        "convert: 1/2 steps (50%), saving",
        "convert: 2/2 steps in 42.0 s",
    ]


def test_a_slow_rate_keeps_two_significant_digits() -> None:
    out, clock = io.StringIO(), Clock()
    with ProgressReport("debootstrap", None, "steps", out, clock=clock) as report:
        clock.now += 120.0
        report.update(3)
    assert out.getvalue().splitlines() == [
        "debootstrap: 3 steps, 0.025 steps/s",
        "debootstrap: 3 steps in 120.0 s (0.025 steps/s)",
    ]


def test_a_zero_total_is_complete_from_the_start() -> None:
    out, clock = io.StringIO(), Clock()
    with ProgressReport("eval arithmetic", 0, "tasks", out, clock=clock):
        pass
    assert out.getvalue() == "eval arithmetic: 0/0 tasks in 0.0 s (0.0 tasks/s)\n"
    terminal = Terminal()
    with ProgressReport("eval arithmetic", 0, "tasks", terminal, clock=clock):
        pass
    assert terminal.getvalue().split("\r")[-1] == (
        "eval arithmetic [########################] 0/0 tasks 100% in 0.0 s\n"
    )


def test_a_failed_operation_ends_the_bar_and_prints_no_summary() -> None:
    out, terminal, clock = io.StringIO(), Terminal(), Clock()
    for stream in (out, terminal):
        with pytest.raises(OSError), ProgressReport("load", 10, "B", stream, clock=clock) as report:
            report.update(4)
            raise OSError("disk gone")
    assert out.getvalue() == ""
    assert terminal.getvalue().endswith("\n") and "4 B/10 B" in terminal.getvalue()


def test_without_a_summary_the_caller_prints_its_own_last_line() -> None:
    out, clock = io.StringIO(), Clock()
    with ProgressReport("download", 10, "B", out, summary=False, clock=clock) as report:
        report.update(10)
    assert out.getvalue() == ""


def test_the_reader_counts_every_byte_a_library_reads(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save({"w": torch.arange(1000)}, path)
    counted: list[int] = []
    with open(path, "rb") as file:
        reader = cast(BinaryIO, CountingReader(file, counted.append))
        state = torch.load(reader, weights_only=True)
    assert torch.equal(state["w"], torch.arange(1000))
    assert sum(counted) >= path.stat().st_size


def test_resuming_says_what_it_loaded_how_much_and_how_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "v000003").mkdir(parents=True)
    (checkpoints / "latest").write_text("v000003\n")
    path = checkpoints / "v000003" / RESUME_STATE
    torch.save({"policy_version": 3, "params": {}, "optimizer": {}}, path)
    state = read_resume_state(checkpoints)
    assert state is not None and state["policy_version"] == 3
    err = capsys.readouterr().err
    assert re.fullmatch(rf"loading {path}: [\d.]+ [kM]?B/[\d.]+ [kM]?B in [\d.]+ s \(.+/s\)\n", err)


def test_a_hub_download_shows_bytes_written_and_files_done() -> None:
    """The calls huggingface_hub's snapshot_download makes on the bars it builds from the
    `tqdm_class` it is given (see node/model.py `_HubProgress`)."""
    out, clock = Terminal(), Clock()
    report = ProgressReport("downloading org/m", unit="B", out=out, clock=clock)
    bar = functools.partial(_HubBar, _HubProgress(report))
    received: Any = bar(desc="Downloading bytes", total=0, initial=0, unit="B", unit_scale=True)
    written: Any = bar(desc="Reconstructing (incomplete total...)", total=0, unit="B")
    files: Any = bar(desc="Fetching 2 files", total=2)
    for size in (1_000, 2_000_000):  # each file's download adds its size to the totals
        written.total = (written.total or 0) + size
        received.total = (received.total or 0) + size
    clock.now += 1.0
    written.update(1_000)
    received.update(1_000)
    files.update(1)
    assert (report.done, report.total) == (1_000, 2_001_000)
    clock.now += 1.0
    written.update(2_000_000)
    received.update(2_000_000)
    files.update(1)
    written.set_postfix_str("", refresh=False)
    written.refresh()
    report.close()
    assert out.getvalue().split("\r")[-1].rstrip() == (
        "downloading org/m [########################] 2.0 MB/2.0 MB 100% 1.0 MB/s in 2.0 s "
        "2/2 files"
    )


class Answers:
    """An environment whose every answer is right, played without a model."""

    async def run_group(self, engine: object, tasks: list[Task], n: int, params: object) -> Any:
        return [[Episode(prompt_ids=[], reward=1.0)] * n for _ in tasks]


def test_agentjet_eval_reports_its_tasks_on_stderr_and_only_json_on_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    write_task_file(generate_tasks(5, 0, [1], ["+"], "arithmetic"), tasks)
    monkeypatch.setattr(node.evaluate, "resolve_model", lambda name, cache: tmp_path)
    engine = types.SimpleNamespace(close=lambda: None)  # nothing to stop (Engine.close)
    monkeypatch.setattr(node.evaluate, "open_engine", lambda *args: engine)
    monkeypatch.setattr(node.evaluate, "make_env", lambda config, pool: Answers())
    summary = node.evaluate.evaluate_checkpoint(Config(), "base", tasks, "arithmetic", 2)
    assert summary["overall"] == 1.0 and summary["n"] == 5
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(
        r"eval arithmetic: 5/5 tasks in [\d.]+ s \([\d.]+ tasks/s\)\n", captured.err
    )
