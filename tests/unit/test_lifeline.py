"""agentjet/lifeline.py's pure parts: /proc parsing, the process tree, the role's marks,
how a dead child is reported, `watch_children` on stand-in processes, and the cleanups a
layer above registers with the watcher (sent on a pipe, called by name)."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentjet import lifeline
from agentjet.errors import AgentjetError
from agentjet.lifeline import (
    ENV,
    ChildProcessDied,
    ProcInfo,
    descendants,
    exit_reason,
    holds_mark,
    owner_token,
    parse_stat,
    process_table,
    running,
    watch_children,
)

pytestmark = pytest.mark.unit

TOKEN = "1234-0123456789abcdef"
PIPE = 987654


def test_stat_is_parsed_after_a_command_name_with_spaces_and_parentheses():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime ...
    stat = "42 (a) b (c) S 7 42 42 0 -1 4194304 1 0 0 0 3 4 0 0 20 0 1 0 98765 1000 50"
    assert parse_stat(stat) == ProcInfo(state="S", ppid=7, pgid=42, start_time=98765)


def test_descendants_walk_the_whole_tree_below_a_pid_and_nothing_else():
    table = {
        1: ProcInfo("S", 0, 1, 1),
        10: ProcInfo("S", 1, 10, 2),
        11: ProcInfo("S", 10, 10, 3),  # child
        12: ProcInfo("Z", 11, 10, 4),  # grandchild
        13: ProcInfo("S", 12, 13, 5),  # below a zombie: still found
        20: ProcInfo("S", 1, 20, 6),  # a sibling's
    }
    assert descendants(10, table) == {11, 12, 13}
    assert descendants(13, table) == set()


def test_the_process_table_holds_this_process_and_its_parent():
    table = process_table()
    me = table[os.getpid()]
    assert me.ppid == os.getppid() and me.state != "Z"
    assert running(os.getpid())
    assert os.getpid() in descendants(os.getppid())


def test_an_owner_token_names_this_process_by_pid_and_start_time():
    token = owner_token(os.getpid())
    pid, start = token.split(":")
    assert int(pid) == os.getpid() and int(start) > 0
    assert owner_token(os.getpid()) == token  # stable for the life of the process
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert owner_token(pid_max + 1) == ""  # no such process
    assert not running(pid_max + 1)


def test_a_process_is_the_roles_by_its_exec_environment_or_the_roles_pipe():
    mine = f"PATH=/bin\0{ENV}={TOKEN}\0HOME=/root\0".encode()
    assert holds_mark(mine, [], TOKEN, PIPE)
    assert holds_mark(f"{ENV}={TOKEN}\0".encode(), [], TOKEN, PIPE)  # the first entry
    # a forked child shows the role's exec-time environment, but holds the pipe
    assert holds_mark(b"PATH=/bin\0", ["/dev/null", f"pipe:[{PIPE}]"], TOKEN, PIPE)


@pytest.mark.parametrize(
    "environ",
    [
        b"PATH=/bin\0",
        f"{ENV}={TOKEN}0\0".encode(),  # another role's token that starts like this one
        f"{ENV}=1234\0".encode(),
        f"OTHER={ENV}={TOKEN}\0".encode(),  # the text inside another variable
        f"X{ENV}={TOKEN}\0".encode(),
    ],
)
def test_other_processes_are_not_the_roles(environ: bytes):
    links = ["/dev/null", f"pipe:[{PIPE + 1}]", f"socket:[{PIPE}]", f"/tmp/pipe:[{PIPE}]"]
    assert not holds_mark(environ, links, TOKEN, PIPE)


def test_the_mark_is_handed_to_programs_with_an_environment_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.delenv(ENV, raising=False)
    assert lifeline.mark() == {}
    monkeypatch.setenv(ENV, TOKEN)
    assert lifeline.mark() == {ENV: TOKEN}


def test_an_exit_reads_as_a_signal_name_or_an_exit_code():
    assert exit_reason(-signal.SIGKILL) == "SIGKILL: out of memory?"
    assert exit_reason(-signal.SIGSEGV) == "SIGSEGV"
    assert exit_reason(1) == "exit code 1"
    assert exit_reason(0) == "exit code 0"
    assert exit_reason(-200) == "signal 200"


@dataclass
class FakeProcess:
    """A multiprocessing.Process as `watch_children` sees it: it dies at the n-th look."""

    pid: int
    dies_at: int | None = None
    code: int = -signal.SIGKILL
    looks: list[int] = field(default_factory=list)

    @property
    def exitcode(self) -> int | None:
        self.looks.append(1)
        return self.code if self.dies_at is not None and len(self.looks) >= self.dies_at else None


def test_watch_children_names_the_child_that_died_and_how():
    children: dict[str, Any] = {
        "hivemind DHT": FakeProcess(11),
        "hivemind state averager": FakeProcess(12, dies_at=3),
    }
    with pytest.raises(ChildProcessDied) as failure:
        asyncio.run(watch_children(children, "trainer", interval_s=0))
    assert str(failure.value) == (
        "hivemind state averager process 12 died (SIGKILL: out of memory?); the trainer stops"
    )
    assert isinstance(failure.value, AgentjetError)  # the CLI prints it as one line
    assert len(children["hivemind DHT"].looks) == 3  # every child at every look


def test_watch_children_runs_until_cancelled_while_every_child_lives():
    child = FakeProcess(11)
    children: dict[str, Any] = {"child": child}

    async def scenario() -> None:
        task = asyncio.create_task(watch_children(children, "role", interval_s=0))
        while len(child.looks) < 5:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


# ── cleanups a layer above registers (`on_unclean_end`) ───────────────────────────────

REMOVED: list[str] = []


def remove_things(argument: str) -> int:
    """A registered cleanup's stand-in: the watcher calls it by name."""
    REMOVED.append(argument)
    return 3


def test_the_watcher_reads_clean_and_the_registered_cleanups_line_by_line():
    first = lifeline.Cleanup("a.b:c", "1:2", "sandbox containers")
    second = lifeline.Cleanup("d:e", 'with "quotes" and spaces', "things")
    wire = first.line() + b"\n" + second.line() + b"\n" + first.line() + b"\nclean\n"
    messages = lifeline.Messages()
    for i in range(len(wire)):  # however the pipe cuts it
        messages.feed(wire[i : i + 1])
    assert messages.cleanups == [first, second]  # each once, in order
    assert messages.clean
    junk = lifeline.Messages()
    junk.feed(b"cleanup not json\ncleanup [1]\ncleaning\n")
    assert junk.cleanups == [] and not junk.clean


def test_a_cleanup_is_called_by_name_with_its_argument(caplog: pytest.LogCaptureFixture):
    REMOVED.clear()
    cleanup = lifeline.Cleanup(f"{__name__}:remove_things", "1:2", "things")
    with caplog.at_level("WARNING"):
        lifeline.run_cleanups([cleanup], "rollout")
    assert REMOVED == ["1:2"]
    assert "removed 3 things of the rollout" in caplog.text


def test_a_failing_cleanup_is_a_warning_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    from sandboxes.docker_sandbox import REMOVE_CONTAINERS

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    unreachable = lifeline.Cleanup(REMOVE_CONTAINERS, "1:2", "sandbox containers")
    assert unreachable.run() == 0
    assert "could not remove the sandbox containers of 1:2" in caplog.text
    assert lifeline.Cleanup("no_such_module:f", "x", "things").run() == 0
    assert lifeline.Cleanup(f"{__name__}:no_such_function", "x", "things").run() == 0


class FakeWatcher:
    """The watcher's side of its pipe, for a Lifeline made without starting one."""

    def __init__(self) -> None:
        read, write = os.pipe()
        self.read = os.fdopen(read, "rb")
        self.stdin = os.fdopen(write, "wb")

    def said(self) -> lifeline.Messages:
        """Everything written on the pipe, once the writer closed it."""
        messages = lifeline.Messages()
        messages.feed(self.read.read())
        self.read.close()
        return messages


def test_cleanups_registered_before_and_after_the_watcher_started_reach_it(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(lifeline, "_cleanups", [])
    monkeypatch.setattr(lifeline, "_running", None)
    monkeypatch.delenv(ENV, raising=False)
    before = lifeline.Cleanup("m:before", "1:2", "things")
    after = lifeline.Cleanup("m:after", "1:2", "things")
    lifeline.on_unclean_end(before.function, before.argument, before.what)
    watcher: Any = FakeWatcher()
    running = lifeline.Lifeline(watcher, None)
    running._take_cleanups()  # as `Lifeline.start` does once its watcher answered
    assert lifeline._running is running
    lifeline.on_unclean_end(after.function, after.argument, after.what)
    lifeline.on_unclean_end(after.function, after.argument, after.what)  # sent once
    running.close()
    assert lifeline._running is None
    lifeline.on_unclean_end("m:late", "1:2", "things")  # after close: nowhere to go, no error
    said = watcher.said()
    assert said.cleanups == [before, after]
    assert said.clean


def test_a_docker_engine_of_this_process_registers_its_containers_with_the_watcher(
    monkeypatch: pytest.MonkeyPatch,
):
    from sandboxes.docker_sandbox import REMOVE_CONTAINERS, DockerEngine, remove_containers_of

    monkeypatch.setattr(lifeline, "_cleanups", [])
    client: Any = type("Client", (), {"containers": FakeContainers()})()
    DockerEngine(client=client, owner="1234:5678")  # a dead node's, to remove: not ours
    assert lifeline._cleanups == []
    engine = DockerEngine(client=client)
    assert lifeline._cleanups == [
        lifeline.Cleanup(REMOVE_CONTAINERS, engine.owner, "sandbox containers")
    ]
    module, _, name = REMOVE_CONTAINERS.partition(":")
    assert getattr(importlib.import_module(module), name) is remove_containers_of


class FakeContainers:
    def __init__(self) -> None:
        self.filters: list[Any] = []

    def list(self, all: bool, filters: dict[str, Any]) -> list[Any]:
        self.filters.append(filters)
        return []


def test_a_dead_nodes_containers_are_found_by_its_owner_label_on_this_host():
    from sandboxes.docker_sandbox import LABEL_HOST, LABEL_OWNER, LABEL_SANDBOX, DockerEngine

    client: Any = type("Client", (), {"containers": FakeContainers()})()
    engine = DockerEngine(client=client, owner="1234:5678")
    assert engine.remove_ours() == 0
    [filters] = client.containers.filters
    assert sorted(filters["label"]) == sorted(
        [LABEL_SANDBOX, f"{LABEL_HOST}={engine.host}", f"{LABEL_OWNER}=1234:5678"]
    )
    assert DockerEngine(client=client).owner == owner_token(os.getpid())  # by default: ours
