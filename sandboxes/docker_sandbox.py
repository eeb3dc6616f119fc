"""DockerSandbox: programs run inside a long-lived, locked-down docker container.

    DockerEngine (one per node: client, owner labels, orphan reaping)
        └── DockerSandbox.start() ──▶ container: PID 1 = the runner (sandboxes/runner.py),
              talking over the container's attached stdin and stdout
              exec(code) ──▶ runner: fork ──▶ child: the program ──▶ frames ──▶ ExecResult
              put_file / get_file ──▶ the runner writes and reads /work
              reset() ──▶ the runner kills every process but itself, empties /work and /tmp

The container is created once and reused (a pool keeps several warm); the runner forks a
program in about a millisecond, where a `docker exec` costs ~40 ms here and a `docker run`
0.5-2 s. Its limits:

- no network (`--network none`) unless the settings allow it;
- read-only root filesystem; /work (the cwd and HOME) and /tmp are size-capped tmpfs;
- memory (swap included), CPU share and a process-count limit (pids cgroup), every
  capability dropped, no-new-privileges, an unprivileged user (nobody) by default.

What a program does wrong comes back in the `ExecResult`: the runner kills its process
group at the deadline (fault "timeout"); after a failed run the container's cgroup
counters tell an out-of-memory kill ("oom_killed") and a refused fork ("pids_limit")
apart. As PID 1 the runner reaps orphans (killed programs leave no zombie eating the pids
limit) and cannot be killed from inside the container. A container that vanished (killed
from outside), or a runner that stops answering, gives `error` and fault "sandbox_lost",
and `healthy()` turns False so the pool replaces it.

Containers carry labels naming this host and the owning process (pid + start time). When
a node dies its lifeline watcher removes its containers (a `DockerEngine` registers
`remove_containers_of` with it: agentjet/lifeline.py `on_unclean_end`); what is still
left (the watcher killed too, the engine unreachable) `DockerEngine.reap_orphans` removes
at the next start: exactly those whose owner process is gone, no one else's.

The image must provide /bin/sh and python3 (3.9 or later: the runner):
`agentjet sandbox build-image` makes one offline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import socket
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors
import requests.exceptions

from agentjet.lifeline import on_unclean_end, owner_token
from sandboxes import runner
from sandboxes.base import (
    FAULT_LOST,
    FAULT_OOM,
    FAULT_PIDS,
    FAULT_TIMEOUT,
    MAX_OUTPUT_BYTES,
    PROGRAM_ENVIRONMENT,
    ExecResult,
    Language,
    ProgramOutput,
    Sandbox,
    SandboxError,
)

log = logging.getLogger(__name__)

# What `agentjet sandbox build-image` builds (sandboxes/image.py); any image works that has
# /bin/sh and python3.
DEFAULT_IMAGE = "agentjet-sandbox:bookworm"
WORK_DIR = "/work"
# Labels on every container we make; `reap_orphans` and `remove_ours` select by them.
LABEL_SANDBOX = "agentjet.sandbox"
LABEL_HOST = "agentjet.host"
LABEL_OWNER = "agentjet.owner"  # "<pid>:<process start time>" of the creating process
LABEL_NODE = "agentjet.node"  # the node id, for people reading `docker ps`
# `remove_containers_of` by name, for a lifeline watcher to import and call.
REMOVE_CONTAINERS = "sandboxes.docker_sandbox:remove_containers_of"
# The runner ends a program at its timeout; one that has not answered this long after it
# is stuck, and its sandbox is marked broken (fault sandbox_lost).
WATCHDOG_GRACE_S = 5.0
# How long a new container's runner may take to answer (python3 start-up, a busy engine).
RUNNER_START_TIMEOUT_S = 30.0
# How long a health check waits for the runner's answer.
HEALTH_TIMEOUT_S = 5.0
# Deadline of the runner's file and reset requests.
REQUEST_TIMEOUT_S = 30.0
# Bytes of a file `get_file` reads; larger files are an error, not a memory spike.
MAX_GET_FILE_BYTES = 16 << 20
# Largest file `put_file` writes in one request (the work dir's tmpfs caps it anyway).
MAX_PUT_FILE_BYTES = runner.MAX_REQUEST_BYTES - (1 << 20)
# Connections the client keeps to the engine: sandboxes of one pool work concurrently.
CLIENT_POOL_SIZE = 32
# The container's cgroup counters, v1 and v2 layouts (those missing are skipped).
_COUNTER_FILES = [
    "/sys/fs/cgroup/memory/memory.oom_control",
    "/sys/fs/cgroup/memory.events",
    "/sys/fs/cgroup/pids/pids.events",
    "/sys/fs/cgroup/pids.events",
]
# What every program (and the runner) sees: the runner's children get exactly this.
_ENVIRONMENT = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": WORK_DIR,
    "TMPDIR": "/tmp",
    **PROGRAM_ENVIRONMENT,
}
_ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)
# docker's header on each chunk of an attached stream without a tty: stream, 0, 0, 0, size.
_STREAM_HEADER = struct.Struct(">BxxxL")


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
        if not owner:  # this process's: should it die, its lifeline watcher removes them
            on_unclean_end(REMOVE_CONTAINERS, self.owner, "sandbox containers")
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
    `owner_token`), once it died: its lifeline watcher calls this by name (REMOVE_CONTAINERS,
    registered by `DockerEngine`)."""
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
    """One container whose PID 1 runs every program; see the module docstring."""

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
        self._channel: _AttachedStream | None = None
        self._link: runner.RunnerLink | None = None
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
                [s.python, "-c", runner.source()],
                name=f"agentjet-sandbox-{uuid.uuid4().hex[:12]}",
                stdin_open=True,
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
            params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            channel = _AttachedStream(self.api.attach_socket(container.id, params=params))
        except _ENGINE_ERRORS as e:
            _remove(container)
            raise SandboxError(f"cannot start a sandbox container: {_reason(e)}") from None
        self.container, self._channel = container, channel
        self._link = runner.RunnerLink(channel.send, channel.receive)
        self.broken = False
        self._counters = {"oom_kill": 0, "pids_max": 0}
        try:
            self._request({"op": "text", "paths": []}, timeout_s=RUNNER_START_TIMEOUT_S)
        except SandboxError as e:
            self.close()
            raise SandboxError(
                f"the sandbox container's runner did not start ({s.image} needs python3 "
                f"3.9 or later as {s.python!r}): {e}"
            ) from None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._link = None
        if self.container is not None:
            _remove(self.container)
            self.container = None

    def healthy(self) -> bool:
        """Whether the runner answers: a container killed from outside has closed its stream
        (a round trip of well under a millisecond, where asking the engine costs ~10)."""
        if self._link is None or self.broken:
            return False
        try:
            self._request({"op": "text", "paths": []}, timeout_s=HEALTH_TIMEOUT_S)
        except SandboxError:
            return False
        return True

    def reset(self) -> None:
        """Kill every process but PID 1 and empty /work and /tmp (the container stays)."""
        try:
            self._request({"op": "reset", "dirs": [WORK_DIR, "/tmp"]})
        except SandboxError as e:
            self.broken = True
            raise SandboxError(f"cannot reset the sandbox container: {e}") from None

    def put_file(self, path: str, data: bytes) -> None:
        target = _work_path(path)
        if len(data) > MAX_PUT_FILE_BYTES:
            raise SandboxError(f"{path!r} is larger than {MAX_PUT_FILE_BYTES} bytes")
        try:
            self._request({"op": "write", "path": target}, data)
        except SandboxError as e:
            raise SandboxError(f"cannot write {path!r} into the sandbox: {e}") from None

    def get_file(self, path: str) -> bytes:
        target = _work_path(path)
        parts: list[bytes] = []
        try:
            self._request(
                {"op": "read", "path": target, "max": MAX_GET_FILE_BYTES},
                on_frame=lambda _, payload: parts.append(payload),
            )
        except SandboxError as e:
            raise SandboxError(f"cannot read {path!r} from the sandbox: {e}") from None
        data = b"".join(parts)
        if len(data) > MAX_GET_FILE_BYTES:
            raise SandboxError(f"{path!r} is larger than {MAX_GET_FILE_BYTES} bytes")
        return data

    def exec(self, code: str, timeout_s: float, *, language: Language = "python") -> ExecResult:
        started = time.monotonic()
        try:
            source = runner.program_bytes(code)
        except ValueError as e:
            return _failed(started, f"cannot start the program: {e}")
        link = self._started_link()
        header = {
            "op": "exec",
            "language": language,
            "cwd": WORK_DIR,
            "env": _ENVIRONMENT,
            "timeout_s": timeout_s,
            "max_output": self.max_output_bytes,
        }
        output = ProgramOutput(self.max_output_bytes)
        deadline = started + timeout_s + WATCHDOG_GRACE_S
        try:
            result = link.request(header, source, deadline, output.frame)
        except runner.RunnerGone as e:
            self.broken = True
            log.warning("sandbox %s: %s", self, e)
            return _failed(started, f"the sandbox container is gone: {e}", FAULT_LOST)
        if result.get("error"):
            return _failed(started, f"cannot start the program: {result['error']}")
        exit_code = int(result["exit_code"])
        timed_out = bool(result["timed_out"])
        fault = FAULT_TIMEOUT if timed_out else ""
        if exit_code != 0:
            fault = self._limit_hit() or fault
            if fault == FAULT_OOM:
                timed_out = False
        return ExecResult(
            stdout=output.stdout.text(),
            stderr=output.stderr.text(),
            exit_code=exit_code,
            duration_s=time.monotonic() - started,
            timed_out=timed_out,
            truncated=output.truncated(int(result["dropped"])),
            fault=fault,
        )

    def _limit_hit(self) -> str:
        """FAULT_OOM or FAULT_PIDS when the container's counters rose since the last look."""
        try:
            files = self._request({"op": "text", "paths": _COUNTER_FILES})["files"]
        except SandboxError:
            return ""
        counters = _parse_counters(files)
        before, self._counters = self._counters, counters
        if counters["oom_kill"] > before["oom_kill"]:
            return FAULT_OOM
        if counters["pids_max"] > before["pids_max"]:
            return FAULT_PIDS
        return ""

    def _request(
        self,
        header: dict[str, Any],
        blob: bytes = b"",
        on_frame: Any = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> dict[str, Any]:
        """A runner request that is not a program; SandboxError when it fails."""
        link = self._started_link()
        try:
            result = link.request(header, blob, time.monotonic() + timeout_s, on_frame)
        except runner.RunnerGone as e:
            self.broken = True
            raise SandboxError(f"the sandbox container is gone: {e}") from None
        if result.get("error"):
            raise SandboxError(str(result["error"]))
        return result

    def _started_link(self) -> runner.RunnerLink:
        if self._link is None:
            raise SandboxError("the sandbox is not started: call start() first")
        return self._link

    def __repr__(self) -> str:
        name = self.container.name if self.container is not None else "not started"
        return f"DockerSandbox({name})"


class _AttachedStream:
    """A container's attached stdin and stdout: `send` writes its stdin, `receive` returns
    the next bytes of its stdout, taken out of docker's multiplexed stream (the runner's
    own stderr is logged)."""

    def __init__(self, raw: Any) -> None:
        self._socket: socket.socket = getattr(raw, "_sock", raw)
        self._raw = raw
        self._pending = bytearray()

    def send(self, data: bytes) -> None:
        self._socket.sendall(data)

    def receive(self, deadline: float) -> bytes:
        while True:
            while len(self._pending) < _STREAM_HEADER.size or len(self._pending) < (
                _STREAM_HEADER.size + _STREAM_HEADER.unpack_from(self._pending)[1]
            ):
                runner.wait_readable(self._socket.fileno(), deadline)
                chunk = self._socket.recv(1 << 16)
                if not chunk:
                    return b""
                self._pending += chunk
            stream, size = _STREAM_HEADER.unpack_from(self._pending)
            end = _STREAM_HEADER.size + size
            payload = bytes(self._pending[_STREAM_HEADER.size : end])
            del self._pending[:end]
            if stream == 1:
                return payload
            log.warning("sandbox runner: %s", payload.decode(errors="replace").strip()[-500:])

    def close(self) -> None:
        for closing in (self._socket, self._raw):
            with contextlib.suppress(OSError):
                closing.close()


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


def _parse_counters(files: dict[str, str]) -> dict[str, int]:
    """oom_kill and pids max counts from the cgroup counter files (missing ones count 0)."""
    counters = {"oom_kill": 0, "pids_max": 0}
    for path, text in files.items():
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if not value.strip().isdigit():
                continue
            if "memory" in path and key == "oom_kill":
                counters["oom_kill"] = int(value)
            elif "pids" in path and key == "max":
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
