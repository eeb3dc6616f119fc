"""DockerSandbox: programs run inside a long-lived, locked-down docker container.

    DockerEngine (one per node: client, owner labels, orphan reaping)
        └── DockerSandbox.start() ──▶ container: PID 1 = a tiny reaper, sleeping
              exec(code) ──▶ docker exec: timeout -s KILL T python3 -c code ──▶ ExecResult
              put_file / get_file ──▶ small execs (base64 in, head -c out)
              reset() ──▶ kill every process but PID 1, empty /work and /tmp

The container is created once and reused (a pool keeps several warm): an exec into a
running container costs ~40 ms here, a `docker run` ~0.5-2 s. Its limits:

- no network (`--network none`) unless the settings allow it;
- read-only root filesystem; /work (the cwd and HOME) and /tmp are size-capped tmpfs;
- memory (swap included), CPU share and a process-count limit (pids cgroup), every
  capability dropped, no-new-privileges, an unprivileged user (nobody) by default.

What a program does wrong comes back in the `ExecResult`: `timeout` kills its process
group at the deadline (fault "timeout"); after a failed run the container's cgroup
counters tell an out-of-memory kill ("oom_killed") and a refused fork ("pids_limit")
apart. A container that vanished (killed from outside) gives `error` and fault
"sandbox_lost", and `healthy()` turns False so the pool replaces it.

Containers carry labels naming this host and the owning process (pid + start time). When
a node dies its lifeline watcher removes its containers (agentjet/lifeline.py); what is
still left (the watcher killed too, the engine unreachable) `DockerEngine.reap_orphans`
removes at the next start: exactly those whose owner process is gone, no one else's.

The image must provide /bin/sh, coreutils (`timeout`, `head`) and python3 (the reaper,
file upload and Python programs): `agentjet sandbox build-image` makes one offline.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors
import requests.exceptions

from agentjet.lifeline import owner_token
from sandboxes.base import (
    FAULT_LOST,
    FAULT_OOM,
    FAULT_PIDS,
    FAULT_TIMEOUT,
    MAX_OUTPUT_BYTES,
    PROGRAM_ENVIRONMENT,
    BoundedBuffer,
    ExecResult,
    Language,
    Sandbox,
    SandboxError,
)

log = logging.getLogger(__name__)

# What `agentjet sandbox build-image` builds (sandboxes/image.py); any image works that has
# /bin/sh, coreutils and python3.
DEFAULT_IMAGE = "agentjet-sandbox:bookworm"
WORK_DIR = "/work"
# Labels on every container we make; `reap_orphans` and `remove_ours` select by them.
LABEL_SANDBOX = "agentjet.sandbox"
LABEL_HOST = "agentjet.host"
LABEL_OWNER = "agentjet.owner"  # "<pid>:<process start time>" of the creating process
LABEL_NODE = "agentjet.node"  # the node id, for people reading `docker ps`
# The engine's answer to a stuck program is the in-container `timeout`; if the exec's
# stream is still open this long after the deadline, every process in the container is
# killed, and after as long again the stream is abandoned and the sandbox marked broken.
WATCHDOG_GRACE_S = 5.0
# Bytes of a file `get_file` reads; larger files are an error, not a memory spike.
MAX_GET_FILE_BYTES = 16 << 20
# Raw bytes per upload exec: base64 makes it ~87 KiB, under Linux's 128 KiB per argument.
PUT_CHUNK_BYTES = 64 << 10
# Connections the client keeps to the engine: execs of one pool run concurrently.
CLIENT_POOL_SIZE = 32
# Python PID 1: blocks SIGCHLD and reaps every orphan, so killed programs leave no zombie
# eating the pids limit; as PID 1 of the container's namespace `kill -9 -1` spares it.
_REAPER = """\
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    signal.sigwait({signal.SIGCHLD})
"""
# Writes base64 argv[3] to argv[1] (argv[2]: "wb" for the first chunk, then "ab").
_WRITER = """\
import base64, os, sys
path = sys.argv[1]
if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, sys.argv[2]) as f:
    f.write(base64.b64decode(sys.argv[3]))
"""
# Every process but PID 1 (and this shell) dies; both scratch dirs end up empty.
_RESET = """\
kill -9 -1 2>/dev/null
chmod -R u+rwx /work /tmp 2>/dev/null
rm -rf /work/..?* /work/.[!.]* /work/* /tmp/..?* /tmp/.[!.]* /tmp/*
[ -z "$(ls -A /work)" ] && [ -z "$(ls -A /tmp)" ]
"""
# The container's cgroup counters (v1 and v2 layouts), each file after a "== path" line.
_COUNTERS = """\
for f in /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events \
         /sys/fs/cgroup/pids/pids.events /sys/fs/cgroup/pids.events; do
  [ -r "$f" ] && echo "== $f" && cat "$f"
done
true
"""
_ENVIRONMENT = {"HOME": WORK_DIR, "TMPDIR": "/tmp", **PROGRAM_ENVIRONMENT}
_ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)


@dataclass(frozen=True)
class DockerSettings:
    """How each sandbox container is made (`[sandbox]` in the config)."""

    image: str = DEFAULT_IMAGE
    # Memory of all its processes together, swap included (tmpfs files count too).
    memory_bytes: int = 512 << 20
    # CPU share: 1.0 = one core.
    cpus: float = 1.0
    # Processes and threads at once: a fork bomb stops here.
    pids: int = 64
    # Size of the writable work dir (and of /tmp).
    work_dir_bytes: int = 64 << 20
    network: bool = False
    # uid:gid inside the container; "65534:65534" is nobody.
    user: str = "65534:65534"
    python: str = "python3"


class DockerEngine:
    """A connection to the docker engine and the labels that mark this process's containers."""

    def __init__(
        self, node_id: str = "", client: docker.DockerClient | None = None, owner: str = ""
    ) -> None:
        """`owner`: whose containers `ours` are (`owner_token`); default this process."""
        self.client = client if client is not None else connect()
        self.host = socket.gethostname()
        self.owner = owner or owner_token(os.getpid())
        self.labels = {
            LABEL_SANDBOX: "1",
            LABEL_HOST: self.host,
            LABEL_OWNER: self.owner,
            LABEL_NODE: node_id,
        }

    def ours(self) -> list[Any]:
        """Containers the owner (this process) made, running or not."""
        return self._list({LABEL_OWNER: self.owner, LABEL_HOST: self.host})

    def reap_orphans(self) -> int:
        """Remove sandbox containers of this host whose owning process no longer runs
        (a crashed node's leftovers); the number removed. Other owners' are left alone."""
        reaped = 0
        for container in self._list({LABEL_HOST: self.host}):
            owner = container.labels.get(LABEL_OWNER, "")
            pid = owner.split(":")[0]
            if owner == self.owner or (pid.isdigit() and owner_token(int(pid)) == owner):
                continue  # ours, or a live process's
            if _remove(container):
                reaped += 1
        if reaped:
            log.info("removed %d sandbox containers left by processes that are gone", reaped)
        return reaped

    def remove_ours(self) -> int:
        """Remove every container the owner made; the number removed."""
        return sum(_remove(container) for container in self.ours())

    def _list(self, labels: dict[str, str]) -> list[Any]:
        selector = [LABEL_SANDBOX] + [f"{key}={value}" for key, value in labels.items()]
        try:
            return list(self.client.containers.list(all=True, filters={"label": selector}))
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot list containers: {_reason(e)}") from None


def remove_containers_of(owner: str) -> int:
    """Remove this host's sandbox containers made by the process `owner` names (its
    `owner_token`), once it died: its lifeline watcher calls this (agentjet/lifeline.py)."""
    engine = DockerEngine(client=connect(), owner=owner)
    try:
        return engine.remove_ours()
    finally:
        engine.client.close()


def connect() -> docker.DockerClient:
    """A client for the engine named by DOCKER_HOST (default: the local socket)."""
    try:
        client = docker.from_env(max_pool_size=CLIENT_POOL_SIZE)
        client.ping()
    except _ENGINE_ERRORS as e:
        where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        raise SandboxError(
            f"cannot reach the docker engine at {where} ({_reason(e)}): start it (as root: "
            "`dockerd --iptables=false --bridge=none &`), point DOCKER_HOST at its socket, "
            "or use the process backend"
        ) from None
    return client


class DockerSandbox(Sandbox):
    """One container, exec'd into for every program; see the module docstring."""

    def __init__(
        self,
        engine: DockerEngine,
        settings: DockerSettings | None = None,
        *,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> None:
        self.engine = engine
        self.settings = settings or DockerSettings()
        self.max_output_bytes = max_output_bytes
        self.container: Any = None
        self.broken = False
        # cgroup counters at the last look: a rise after a failed run names its fault.
        self._counters = {"oom_kill": 0, "pids_max": 0}

    @property
    def api(self) -> Any:
        return self.engine.client.api

    def start(self) -> None:
        if self.container is not None:
            return
        s = self.settings
        try:
            container = self.engine.client.containers.create(
                s.image,
                [s.python, "-c", _REAPER],
                name=f"agentjet-sandbox-{uuid.uuid4().hex[:12]}",
                **container_options(s, self.engine.labels),
            )
        except docker.errors.ImageNotFound:
            raise SandboxError(
                f"docker image {s.image!r} is not on this machine: build it with "
                "`agentjet sandbox build-image`, or pull it"
            ) from None
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot create a sandbox container: {_reason(e)}") from None
        try:
            container.start()
        except _ENGINE_ERRORS as e:
            _remove(container)
            raise SandboxError(f"cannot start a sandbox container: {_reason(e)}") from None
        self.container = container
        self.broken = False
        self._counters = {"oom_kill": 0, "pids_max": 0}

    def close(self) -> None:
        if self.container is not None:
            _remove(self.container)
            self.container = None

    def healthy(self) -> bool:
        if self.container is None or self.broken:
            return False
        try:
            self.container.reload()
        except _ENGINE_ERRORS:
            return False
        return bool(self.container.status == "running")

    def reset(self) -> None:
        """Kill every process but PID 1 and empty /work and /tmp (the container stays)."""
        exit_code, output = self._run(["/bin/sh", "-c", _RESET])
        if exit_code != 0:
            self.broken = True
            raise SandboxError(f"cannot reset the sandbox container: {output[-200:]!r}")

    def put_file(self, path: str, data: bytes) -> None:
        target = _work_path(path)
        for offset in range(0, max(len(data), 1), PUT_CHUNK_BYTES):
            chunk = base64.b64encode(data[offset : offset + PUT_CHUNK_BYTES]).decode()
            mode = "wb" if offset == 0 else "ab"
            exit_code, output = self._run(
                [self.settings.python, "-c", _WRITER, target, mode, chunk]
            )
            if exit_code != 0:
                raise SandboxError(f"cannot write {path!r} into the sandbox: {_last_line(output)}")

    def get_file(self, path: str) -> bytes:
        target = _work_path(path)
        exit_code, output = self._run(["head", "-c", str(MAX_GET_FILE_BYTES + 1), "--", target])
        if exit_code != 0:
            raise SandboxError(f"cannot read {path!r} from the sandbox: {_last_line(output)}")
        if len(output) > MAX_GET_FILE_BYTES:
            raise SandboxError(f"{path!r} is larger than {MAX_GET_FILE_BYTES} bytes")
        return output

    def exec(self, code: str, timeout_s: float, *, language: Language = "python") -> ExecResult:
        started = time.monotonic()
        if "\x00" in code:
            return _failed(started, "cannot start the program: embedded null byte")
        shell = self.settings.python if language == "python" else "/bin/sh"
        argv = ["timeout", "-s", "KILL", f"{timeout_s:.3f}", shell, "-c", code]
        try:
            exec_id = self.api.exec_create(
                self._started().id, argv, workdir=WORK_DIR, environment=_ENVIRONMENT
            )["Id"]
            stream = self.api.exec_start(exec_id, stream=True, demux=True)
        except _ENGINE_ERRORS as e:
            return self._lost(started, e)
        stdout = BoundedBuffer(self.max_output_bytes)
        stderr = BoundedBuffer(self.max_output_bytes)
        try:
            with self._watchdog(stream, timeout_s):
                for out, err in stream:
                    if out:
                        stdout.append(out)
                    if err:
                        stderr.append(err)
            raw_code = self.api.exec_inspect(exec_id)["ExitCode"]
        except _ENGINE_ERRORS as e:
            return self._lost(started, e)
        duration = time.monotonic() - started
        if raw_code is None:  # the stream was abandoned by the watchdog: still running
            self.broken = True
            return _failed(started, "the sandbox stopped answering", fault=FAULT_LOST)
        exit_code = -(raw_code - 128) if 128 < raw_code < 160 else raw_code
        timed_out = exit_code == -9 and duration >= timeout_s
        fault = FAULT_TIMEOUT if timed_out else ""
        if exit_code != 0:
            fault = self._limit_hit() or fault
            if fault == FAULT_OOM:
                timed_out = False
        return ExecResult(
            stdout=stdout.text(),
            stderr=stderr.text(),
            exit_code=exit_code,
            duration_s=duration,
            timed_out=timed_out,
            truncated=stdout.dropped > 0 or stderr.dropped > 0,
            fault=fault,
        )

    @contextlib.contextmanager
    def _watchdog(self, stream: Any, timeout_s: float) -> Iterator[None]:
        """Rescue a read that outlives the in-container timeout (a stuck engine)."""

        def rescue() -> None:
            log.warning("sandbox %s: exec outlived its timeout; killing its processes", self)
            with contextlib.suppress(*_ENGINE_ERRORS):
                self._run(["/bin/sh", "-c", "kill -9 -1"])
            if not finished.wait(WATCHDOG_GRACE_S):
                self.broken = True
                stream.close()

        finished = threading.Event()
        timer = threading.Timer(timeout_s + WATCHDOG_GRACE_S, rescue)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            finished.set()
            timer.cancel()

    def _limit_hit(self) -> str:
        """FAULT_OOM or FAULT_PIDS when the container's counters rose since the last look."""
        try:
            _, output = self._run(["/bin/sh", "-c", _COUNTERS])
        except SandboxError:
            return ""
        counters = _parse_counters(output.decode(errors="replace"))
        before, self._counters = self._counters, counters
        if counters["oom_kill"] > before["oom_kill"]:
            return FAULT_OOM
        if counters["pids_max"] > before["pids_max"]:
            return FAULT_PIDS
        return ""

    def _run(self, argv: list[str]) -> tuple[int, bytes]:
        """A short helper command: (exit code, stdout + stderr). SandboxError if it cannot run."""
        try:
            result = self._started().exec_run(argv, workdir=WORK_DIR, environment=_ENVIRONMENT)
        except _ENGINE_ERRORS as e:
            self.broken = True
            raise SandboxError(f"the sandbox container is gone: {_reason(e)}") from None
        return result.exit_code, result.output or b""

    def _lost(self, started: float, error: BaseException) -> ExecResult:
        self.broken = True
        return _failed(started, f"the sandbox container is gone: {_reason(error)}", FAULT_LOST)

    def _started(self) -> Any:
        if self.container is None:
            raise SandboxError("the sandbox is not started: call start() first")
        return self.container

    def __repr__(self) -> str:
        name = self.container.name if self.container is not None else "not started"
        return f"DockerSandbox({name})"


def _failed(started: float, error: str, fault: str = "") -> ExecResult:
    return ExecResult(
        stdout="",
        stderr="",
        exit_code=-1,
        duration_s=time.monotonic() - started,
        error=error,
        fault=fault,
    )


def container_options(settings: DockerSettings, labels: dict[str, str]) -> dict[str, Any]:
    """The isolation and limits of a sandbox container, as docker SDK keyword arguments."""
    tmpfs = _tmpfs_options(settings)
    return {
        "labels": labels,
        "network_mode": "bridge" if settings.network else "none",
        "read_only": True,
        "tmpfs": {WORK_DIR: tmpfs, "/tmp": tmpfs},
        "user": settings.user,
        "mem_limit": settings.memory_bytes,
        "memswap_limit": settings.memory_bytes,
        "nano_cpus": int(settings.cpus * 1e9),
        "pids_limit": settings.pids,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "environment": _ENVIRONMENT,
    }


def _tmpfs_options(settings: DockerSettings) -> str:
    """A writable, size-capped tmpfs owned by the sandbox user (programs may run files)."""
    options = f"rw,exec,nosuid,nodev,size={settings.work_dir_bytes}"
    uid, _, gid = settings.user.partition(":")
    if uid.isdigit() and (gid or uid).isdigit():
        return f"{options},uid={uid},gid={gid or uid},mode=0700"
    return f"{options},mode=1777"  # a user by name: its uid is only known inside the image


def _work_path(path: str) -> str:
    """`path` as an absolute path inside /work; SandboxError for anything outside it."""
    normal = posixpath.normpath(posixpath.join(WORK_DIR, path))
    if "\x00" in path or not normal.startswith(WORK_DIR + "/"):
        raise SandboxError(f"{path!r} is not a file path inside the sandbox work dir")
    return normal


def _parse_counters(text: str) -> dict[str, int]:
    """oom_kill and pids max counts from `_COUNTERS` output (missing files count 0)."""
    counters = {"oom_kill": 0, "pids_max": 0}
    section = ""
    for line in text.splitlines():
        if line.startswith("== "):
            section = line[3:]
            continue
        key, _, value = line.partition(" ")
        if not value.strip().isdigit():
            continue
        if "memory" in section and key == "oom_kill":
            counters["oom_kill"] = int(value)
        elif "pids" in section and key == "max":
            counters["pids_max"] = int(value)
    return counters


def _remove(container: Any) -> bool:
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        return False
    except _ENGINE_ERRORS as e:
        log.warning("could not remove sandbox container %s: %s", container.name, _reason(e))
        return False
    return True


def _reason(error: BaseException) -> str:
    if isinstance(error, docker.errors.APIError) and error.explanation:
        return str(error.explanation)
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _last_line(output: bytes) -> str:
    lines = output.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"
