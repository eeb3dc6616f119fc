"""`python -m tests.lifeline_role [clean]`: a stand-in role for the lifeline tests.

It starts its lifeline watcher as `run_role` does, then one process of each kind a role
starts: a forked child (as hivemind's DHT and averagers are), an exec'd program (as p2pd
and the beacon are) and a sandbox program (its own session, an environment of its own).
It registers two cleanups with its watcher (`on_unclean_end`: one before the watcher
starts, one after), each writing a file under $TMPDIR (NOTES) when called.
It prints one JSON line, {"forked", "started", "sandboxed", "watcher": pids, "token",
"pipe": the marks}, then waits to be killed; with `clean` it waits for a line on stdin
(the test has seen its processes), says its cleanup ran and exits, leaving the three
behind for its watcher to end.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from agentjet.lifeline import ENV, Lifeline, on_unclean_end
from agentjet.roles import setup_logging
from sandboxes.process import ProcessSandbox

# Longer than any test: these processes end only when something ends them.
FOREVER_S = 600
START_TIMEOUT_S = 30.0
POLL_S = 0.05
# The files the registered cleanups write, in $TMPDIR: registered before the watcher
# started, and after.
NOTES = ("cleaned-before", "cleaned-after")
# `leave_note` by name (this module runs as __main__; the watcher imports it by this name).
LEAVE_NOTE = "tests.lifeline_role:leave_note"


def leave_note(path: str) -> int:
    """A registered cleanup: the watcher calls it by name after an unclean end."""
    Path(path).write_text("cleaned\n")
    return 1


def main(clean: bool) -> int:
    setup_logging("test-role")
    notes = [str(Path(tempfile.gettempdir()) / note) for note in NOTES]
    on_unclean_end(LEAVE_NOTE, notes[0], "notes")
    lifeline = Lifeline.start("test-role")
    assert lifeline is not None and lifeline.process.stdin is not None
    on_unclean_end(LEAVE_NOTE, notes[1], "notes")
    forked = multiprocessing.get_context("fork").Process(
        target=time.sleep, args=(FOREVER_S,), daemon=True
    )
    forked.start()
    started = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({FOREVER_S})"])
    box = ProcessSandbox(use_bwrap=False)  # under bwrap the program would see its own pids
    box.start()
    program = f"import os, time; open('pid', 'w').write(str(os.getpid())); time.sleep({FOREVER_S})"
    threading.Thread(target=box.exec, args=(program, FOREVER_S), daemon=True).start()
    pid_file = box.work_dir / "pid"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (pid_file.exists() and pid_file.read_text()):
        if time.monotonic() > deadline:
            raise TimeoutError("the sandbox program did not start")
        time.sleep(POLL_S)  # polling a file the program writes
    marks = {
        "forked": forked.pid,
        "started": started.pid,
        "sandboxed": int(pid_file.read_text()),
        "watcher": lifeline.process.pid,
        "token": os.environ[ENV],
        "pipe": os.fstat(lifeline.process.stdin.fileno()).st_ino,
    }
    print(json.dumps(marks), flush=True)
    if clean:
        sys.stdin.readline()
        lifeline.close()
        os._exit(0)  # as a role whose cleanup missed these three
    time.sleep(FOREVER_S)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] == ["clean"]))
