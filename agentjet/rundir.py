"""One run dir, one node of each role: a node holds its run dir for as long as it lives.

    agentjet node --role R / agentjet coordinator / python -m coordinator
        └── hold_run_dir(run dir, R) ──▶ flock <run dir>/R.lock (pid, role, node written in it)
    agentjet local (all roles share one run dir)
        ├── the launcher: <run dir>/local.lock  (a second `agentjet local` there is refused)
        └── each role it starts: <run dir>/<role>.lock, as above
    a rollout node's spool (rollout.spool_dir may lie outside the run dir): <spool>/spool.lock

A second node of the same role pointed at a held directory refuses to start, with one line
that names the holder and what to do. Roles keep apart files in a shared run dir
(metrics/<role>.jsonl, the trainer's checkpoints, the rollout node's spool, the
coordinator's history), so only nodes of one role collide: hence one lock per role. The
kernel drops an flock when the last process holding it ends, however it ends, so a dead
holder's lock is simply taken over. Processes the role forks (hivemind's) share the lock
and end with it (agentjet/lifeline.py); until they have, the run dir stays held.

A node's default run dir names the node (`default_run_dir`): runs/<NAME> with a key file
from `agentjet keys issue --node NAME`, else runs/<role> (runs/<role>-<FILE's name> with
`--identity FILE`), the same at every restart: a trainer resumes from its newest checkpoint
there, a rollout node from its spool, the coordinator from its history.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import IO

from agentjet.config import Config, RunConfig
from agentjet.errors import ConfigError
from agentjet.identity import NAME_PATTERN
from agentjet.keys import read_key_data

# A lock file holds one short line (pid, role, node name); more is not a node's.
MAX_HOLDER_BYTES = 512
# What a node refused its run dir can do instead.
ANOTHER_RUN_DIR = "give this one another run dir (--run-dir DIR, or run.dir)"


class DirectoryHeld(ConfigError):
    """Another live process holds the directory this one was to use."""


class Hold:
    """An flock on one lock file, held until `release` (or the process ends)."""

    def __init__(self, path: Path, file: IO[str]) -> None:
        self.path = path
        self._file = file

    def release(self) -> None:
        self._file.close()  # closing the last descriptor drops the flock

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def hold(lock_path: Path, role: str, node: str, what: str, instead: str) -> Hold:
    """Take `lock_path` for this process, noting who holds it; DirectoryHeld (naming the
    holder, `what` it holds, and `instead`: what to do) if a live process holds it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    file = open(lock_path, "a+")  # noqa: SIM115 (held for the process's life)
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = describe_holder(file.read(MAX_HOLDER_BYTES))
        file.close()
        raise DirectoryHeld(f"{what} is held by {holder}: stop that one, or {instead}") from None
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()} {role} {node}".rstrip() + "\n")
    file.flush()
    return Hold(lock_path, file)


def hold_run_dir(run_dir: Path, role: str, node: str = "") -> Hold:
    """Hold `run_dir` as the one `role` node there (its `node` name, where known)."""
    return hold(run_dir / f"{role}.lock", role, node, f"run dir {run_dir}", ANOTHER_RUN_DIR)


def describe_holder(line: str) -> str:
    """A lock file's line as the error shows it: `a live trainer node (pid 4711, alice)`."""
    pid, _, rest = line.strip().partition(" ")
    role, _, node = rest.partition(" ")
    if not pid.isdigit() or not role:  # written by no node of ours, or not yet written
        return "another process"
    shown = {"coordinator": "coordinator", "local": "`agentjet local`"}.get(role, f"{role} node")
    named = f", {node}" if node else ""
    if not _alive(int(pid)):  # it died; a process it forked is still ending (lifeline.py)
        return f"what is left of a {shown} (pid {pid}{named}, exited; wait a moment)"
    return f"a live {shown} (pid {pid}{named})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def node_name(config: Config) -> str:
    """The name the node's own key file gives it (`agentjet keys issue --node NAME`); ""
    with the swarm's root file or no keys (the role then names the node at start)."""
    if not config.net.keys:
        return ""
    data = read_key_data(config.net.keys)
    name = data.get("name") if data.get("kind") == "node" else None
    return name if isinstance(name, str) and NAME_PATTERN.fullmatch(name) else ""


def default_run_dir(role: str, config: Config) -> str | None:
    """The run dir of a `role` node whose config names none (None: it names one):
    runs/<node name>, else runs/<role>, or runs/<role>-<identity file's name>."""
    if config.run.dir != RunConfig().dir:
        return None
    name = node_name(config)
    if name:
        return f"runs/{name}"
    identity = config.swarm.identity_path
    return f"runs/{role}-{Path(identity).stem}" if identity else f"runs/{role}"
