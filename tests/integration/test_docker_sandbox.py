"""DockerSandbox and its pool against a real docker engine and the offline-built image:
isolation, every fault as an outcome, replacement, crash cleanup, episodes under load."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from transformers import AutoTokenizer

from agentjet.config import EnvConfig, SandboxConfig
from agentjet.protocol import Task
from agentjet.sandbox_tasks import make_code_task, make_shell_task, reference_solution
from sandboxes.base import FAULT_LOST, FAULT_OOM, FAULT_PIDS, FAULT_TIMEOUT, SandboxError
from sandboxes.docker_sandbox import (
    LABEL_OWNER,
    DockerEngine,
    DockerSandbox,
    DockerSettings,
)
from sandboxes.envs import make_env
from sandboxes.image import DEFAULT_IMAGE
from sandboxes.pool import SandboxPool, open_pool
from tests import procs
from tests.factories import RuleGenerator

pytestmark = pytest.mark.docker

QUICK_S = 20.0
SMALL = DockerSettings(memory_bytes=128 << 20, pids=32, work_dir_bytes=8 << 20)


@pytest.fixture(scope="module")
def engine(docker_client: docker.DockerClient) -> Iterator[DockerEngine]:
    try:
        docker_client.images.get(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        reason = f"image {DEFAULT_IMAGE} missing: run `agentjet sandbox build-image`"
        if os.environ.get("AGENTJET_REQUIRE_DOCKER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    engine = DockerEngine("test-node", client=docker_client)
    yield engine
    engine.remove_ours()


@pytest.fixture
def box(engine: DockerEngine) -> Iterator[DockerSandbox]:
    with DockerSandbox(engine, SMALL) as sandbox:
        yield sandbox


# ── isolation ──────────────────────────────────────────────────────────────────────


def test_no_network_read_only_root_unprivileged(box: DockerSandbox) -> None:
    probe = """
import os, socket
print(sorted(os.listdir('/sys/class/net')))
try:
    socket.create_connection(('192.0.2.1', 80), timeout=2)
    print('connected')
except OSError as e:
    print('no network:', e.errno)
for path in ('/etc/x', '/usr/x', '/x'):
    try:
        open(path, 'w')
        print('wrote', path)
    except OSError as e:
        print('read-only:', e.errno)
open('/work/ok', 'w').write('fine')
print(os.getuid(), os.getcwd())
print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])
"""
    result = box.exec(probe, QUICK_S)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "['lo']"
    assert lines[1].startswith("no network")
    assert lines[2:5] == ["read-only: 30"] * 3  # EROFS
    assert lines[5] == "65534 /work"
    assert int(lines[6], 16) == 0  # no capabilities
    assert box.get_file("ok") == b"fine"


def test_files_round_trip_and_paths_stay_inside(box: DockerSandbox) -> None:
    blob = bytes(range(256)) * 1000  # binary, several upload chunks
    box.put_file("deep/dir/blob.bin", blob)
    assert box.get_file("deep/dir/blob.bin") == blob
    assert box.exec("print(len(open('deep/dir/blob.bin','rb').read()))", QUICK_S).stdout == (
        f"{len(blob)}\n"
    )
    for bad in ("../etc/passwd", "/etc/passwd", "", ".", "a/../../x"):
        with pytest.raises(SandboxError, match="inside the sandbox work dir"):
            box.get_file(bad)
    with pytest.raises(SandboxError, match="nope.txt"):
        box.get_file("nope.txt")


def test_output_is_bounded(engine: DockerEngine) -> None:
    with DockerSandbox(engine, SMALL, max_output_bytes=1000) as box:
        result = box.exec("print('x' * 10_000_000)", QUICK_S)
    assert result.exit_code == 0 and result.truncated and len(result.stdout) == 1000


# ── faults are outcomes ────────────────────────────────────────────────────────────


def test_an_endless_loop_hits_the_timeout(box: DockerSandbox) -> None:
    result = box.exec("while True: pass", 1.0)
    assert (result.timed_out, result.fault, result.exit_code) == (True, FAULT_TIMEOUT, -9)
    assert 1.0 <= result.duration_s < QUICK_S
    assert box.exec("print('still here')", QUICK_S).stdout == "still here\n"


def test_a_memory_hog_is_oom_killed(box: DockerSandbox) -> None:
    result = box.exec("x = bytearray(400 << 20)\nprint('allocated')", QUICK_S)
    assert (result.fault, result.exit_code, result.timed_out) == (FAULT_OOM, -9, False)
    assert "allocated" not in result.stdout
    assert box.exec("print('still here')", QUICK_S).ok


def test_a_fork_bomb_hits_the_pids_limit(box: DockerSandbox) -> None:
    bomb = "import os\nwhile True:\n    os.fork()"
    result = box.exec(bomb, 5.0)
    assert result.fault == FAULT_PIDS
    box.reset()  # kills whatever the bomb left
    count = box.exec("import os; print(sum(p.isdigit() for p in os.listdir('/proc')))", QUICK_S)
    assert int(count.stdout) <= 3  # PID 1, this program, at most its timeout wrapper


def test_reset_empties_the_work_dir_and_kills_leftover_processes(box: DockerSandbox) -> None:
    box.put_file("a.txt", b"1")
    leftovers = "setsid sleep 1000 > /dev/null 2>&1 &\nmkdir -p /tmp/t && touch .hidden"
    assert box.exec(leftovers, 5.0, language="sh").ok
    box.reset()
    listing = box.exec(
        "import os; print(os.listdir('.'), os.listdir('/tmp'), "
        "[open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()])",
        QUICK_S,
    ).stdout
    assert listing.startswith("[] [] ")
    assert "sleep" not in listing


def test_the_runner_is_out_of_a_programs_reach(box: DockerSandbox) -> None:
    # PID 1 of the container runs every program: a program cannot kill it, read its
    # channel or trace it, and what it does to its own interpreter ends with it.
    code = """
import ctypes, os, signal, sys
os.kill(1, signal.SIGKILL)
os.kill(1, signal.SIGTERM)
try:
    open('/proc/1/fd/1', 'wb').write(b'forged')
    print('opened')
except OSError:
    print('refused')
print('ptrace', ctypes.CDLL(None).ptrace(16, 1, 0, 0))
sys.modules['json'] = None
"""
    result = box.exec(code, QUICK_S)
    assert result.stdout.split("\n")[:2] == ["refused", "ptrace -1"], result
    after = box.exec("import json, os; print(json.dumps(os.getppid()))", QUICK_S)
    assert after.stdout == "1\n" and box.healthy()


def test_a_container_killed_from_outside_is_reported_and_replaced(engine: DockerEngine) -> None:
    pool = SandboxPool(lambda: DockerSandbox(engine, SMALL), 1, acquire_timeout_s=QUICK_S)
    pool.start()
    try:
        box = pool.acquire()
        assert isinstance(box, DockerSandbox)
        box.container.kill()
        result = box.exec("print(1)", QUICK_S)
        assert (result.fault, result.ok) == (FAULT_LOST, False)
        assert "gone" in result.error and not box.healthy()
        killed = box.container.id if box.container is not None else ""
        pool.release(box)
        fresh = pool.acquire()
        assert fresh.exec("print(2)", QUICK_S).stdout == "2\n"
        assert isinstance(fresh, DockerSandbox) and fresh.container.id != killed
        pool.release(fresh)
        assert pool.stats().replaced == 1
    finally:
        pool.close()
    assert not engine.ours()


# ── cleanup after a crash ──────────────────────────────────────────────────────────

_CRASHING_NODE = """
import sys
from sandboxes.docker_sandbox import DockerEngine, DockerSandbox
engine = DockerEngine("crashing-node")
boxes = [DockerSandbox(engine) for _ in range(2)]
for box in boxes:
    box.start()
print("ready", flush=True)
sys.stdin.read()  # until killed
"""


def test_a_restarted_node_reaps_what_a_crashed_one_left(
    engine: DockerEngine, docker_client: docker.DockerClient
) -> None:
    node = procs.popen(
        [sys.executable, "-c", _CRASHING_NODE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
        text=True,
    )
    try:
        assert node.stdout is not None and node.stdout.readline() == "ready\n"
        owner = f"{node.pid}:"
        left = [
            c
            for c in docker_client.containers.list(all=True, filters={"label": LABEL_OWNER})
            if c.labels[LABEL_OWNER].startswith(owner)
        ]
        assert len(left) == 2
    finally:
        node.send_signal(signal.SIGKILL)  # a crash: no cleanup runs
        node.wait()
    with DockerSandbox(engine, SMALL) as ours:  # a live owner's container
        stranger = docker_client.containers.run(DEFAULT_IMAGE, ["sleep", "600"], detach=True)
        try:
            assert DockerEngine("restarted-node", client=docker_client).reap_orphans() == 2
            for container in left:
                with pytest.raises(docker.errors.NotFound):
                    container.reload()
            assert ours.healthy()
            stranger.reload()
            assert stranger.status == "running"
        finally:
            stranger.remove(force=True)


# ── episodes on the docker backend ─────────────────────────────────────────────────


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def docker_pool(engine: DockerEngine) -> Iterator[SandboxPool]:
    pool = open_pool(SandboxConfig(backend="docker", pool_size=2, memory_mb=256), "test-node")
    yield pool
    pool.close()


def test_python_tool_runs_on_the_docker_backend(tokenizer: Any, docker_pool: SandboxPool) -> None:
    def reply(context: str) -> str:
        if "Output:" in context:
            return "The answer is " + context.rsplit("Output:\n", 1)[1].split("<")[0].strip()
        return "```python\nimport os\nprint(6 * 7 if os.getuid() == 65534 else 0)\n```"

    env = make_env(EnvConfig(name="python_tool", tool_timeout_s=QUICK_S), docker_pool)
    task = Task(id="t", env="python_tool", prompt="What is 6 * 7?", answer=42)
    [group] = asyncio.run(env.run_group(RuleGenerator(tokenizer, reply), [task], 3, _params()))
    assert [(e.reward, e.turns, e.error) for e in group] == [(1.0, 2, "")] * 3


def test_many_episodes_share_few_sandboxes(tokenizer: Any, docker_pool: SandboxPool) -> None:
    """16 stateful shell episodes (setup files, two tool turns, a check) on 2 containers:
    played in waves, every one scored right, never more than 2 sandboxes lent."""
    import random

    rng = random.Random(3)
    tasks = [make_shell_task(rng, 1 + i % 3, "shell") for i in range(8)]
    solutions = {task.prompt: reference_solution(task) for task in tasks}
    most_lent = 0
    watching = threading.Event()

    def watch() -> None:
        nonlocal most_lent
        while not watching.wait(0.01):
            most_lent = max(most_lent, docker_pool.stats().in_use)

    def reply(context: str) -> str:
        if context.count("Output:") >= 1:
            return "Done."
        prompt = next(p for p in solutions if p in context)
        return f"```sh\n{solutions[prompt]}\n```"

    env = make_env(EnvConfig(name="shell", tool_timeout_s=QUICK_S), docker_pool)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        groups = asyncio.run(env.run_group(RuleGenerator(tokenizer, reply), tasks, 2, _params()))
    finally:
        watching.set()
        watcher.join()
    assert [[e.reward for e in g] for g in groups] == [[1.0, 1.0]] * 8, [
        [e.error for e in g] for g in groups
    ]
    assert 1 <= most_lent <= 2
    assert docker_pool.stats().acquired == 16


def test_python_code_is_scored_by_hidden_tests_in_docker(
    tokenizer: Any, docker_pool: SandboxPool
) -> None:
    import random

    task = make_code_task(random.Random(0), 2, "python_code")
    right = f"```python\n{reference_solution(task)}\n```"
    replies = iter([right, "```python\ndef solve(*args):\n    return None\n```"])
    lock = threading.Lock()

    def reply(context: str) -> str:
        with lock:
            return next(replies)

    env = make_env(EnvConfig(name="python_code"), docker_pool)
    groups = asyncio.run(env.run_group(RuleGenerator(tokenizer, reply), [task], 1, _params()))
    groups += asyncio.run(env.run_group(RuleGenerator(tokenizer, reply), [task], 1, _params()))
    assert [g[0].reward for g in groups] == [1.0, 0.0]
    assert [g[0].error for g in groups] == ["", ""]


def test_tool_faults_reach_the_episode(tokenizer: Any, docker_pool: SandboxPool) -> None:
    hogs = {
        "a": "x = bytearray(400 << 20)",
        "b": "while True: pass",
        "c": "import os\nwhile True:\n    os.fork()",
    }

    def reply(context: str) -> str:
        if "Output:" in context:
            return "I give up."
        key = next(k for k in hogs if f"Task {k}." in context)
        return f"```python\n{hogs[key]}\n```"

    env = make_env(EnvConfig(name="python_tool", tool_timeout_s=2.0), docker_pool)
    tasks = [Task(id=k, env="python_tool", prompt=f"Task {k}.", answer=1) for k in hogs]
    groups = asyncio.run(env.run_group(RuleGenerator(tokenizer, reply), tasks, 1, _params()))
    assert [g[0].faults for g in groups] == [[FAULT_OOM], [FAULT_TIMEOUT], [FAULT_PIDS]]
    assert all(g[0].error and g[0].reward == 0.0 for g in groups)


def _params() -> Any:
    from agentjet.episode import SamplingParams

    return SamplingParams(max_new_tokens=64)


def test_a_planted_usercustomize_does_not_run_in_later_programs(box: DockerSandbox) -> None:
    # HOME is the writable work dir; the task's check runs after the model's programs.
    site = ".local/lib/python3.11/site-packages"
    box.put_file(f"{site}/usercustomize.py", b"import os\nos._exit(0)\n")
    result = box.exec("import sys; sys.exit(3)", QUICK_S)
    assert result.exit_code == 3
