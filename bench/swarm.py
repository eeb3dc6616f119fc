"""Swarm benchmark: what training across trainers costs in time and in bytes, and what one
policy version costs to deliver to a rollout node.

    throughput  1, then 2 trainer processes; each a real SwarmOptimizer over the model and
                real Learner.train_step gradients on synthetic groups (--group-size samples,
                --prompt-tokens prompt, --completion-tokens completion, rewards 1, 0, 1, 0,
                ... so every sample carries gradient, sampler logprobs = the policy's own).
                Global batch = every trainer's local batch (target_batch_size = trainers ×
                local batch). After --warmup-steps global steps, one window (--window-steps
                global steps or --window-s, whichever first):
                ──▶ steps_per_s (epoch advances) and samples_per_s (samples inside them)
    bytes       every run's trainers are alone in a fresh network namespace (`ip netns
                add`, `lo` up); its loopback rx byte counter (/proc/<trainer pid>/net/dev),
                read as trainer 0 reports the window's first and last epoch, ÷ global steps.
                Two trainers: full model with fp32 gradients (the throughput run), fp16
                gradients, LoRA adapters only (node/lora.py, model.lora_rank=8). The
                parameters are averaged at every step too (SwarmConfig.average_state_every=1
                here, the worst case; the default is 10); --grads-only repeats the three
                with state averaging off, so gradient bytes alone show.
    delivery    a node/publisher.py Publisher serving a sealed PolicySnapshot of the model,
                as a trainer with the swarm's keys does (PolicyQuery over CURVE with a
                fresh swarm keypair, chunks on its sealed endpoint) ──▶ another process
                fetches it as a rollout node does (node/trainer_link.py fetch_chunks: each
                chunk unsealed and checked as it comes) and calls finish(): median of
                --fetches ──▶ weight_delivery_s; the same sealed chunks over the CURVE
                socket ──▶ over_curve_s; the same byte count streamed over a plain TCP
                socket on loopback between two processes ──▶ weight_delivery_floor_s.

Every child is this script in another role (`--child`), a process of its own in its own
session: it writes JSON lines to the parent on stdout (library output goes to its log),
reads "go" / "stop" on stdin, and is reaped by PID with whatever it spawned. Waits are on
those lines, bounded by the named limits below. The bytes part needs root and network
namespaces; without them it fails with one line and the rest is still measured. Writes
bench/results/swarm.json.

Run: `just bench-swarm` (or `.venv/bin/python bench/swarm.py [--model embedded]`),
machine idle: throughput is CPU-bound, and two trainers share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hivemind  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import uvloop  # noqa: E402

from agentjet import protocol  # noqa: E402
from agentjet.config import (  # noqa: E402
    EMBEDDED_MODEL,
    ModelConfig,
    NetConfig,
    SwarmConfig,
    TrainerConfig,
)
from agentjet.identity import NodeKeys, read_node_keys  # noqa: E402
from agentjet.keys import write_keys  # noqa: E402
from agentjet.lifeline import descendants  # noqa: E402
from agentjet.transport import Client, Server  # noqa: E402
from node.dht import visible_maddrs  # noqa: E402
from node.learner import Learner  # noqa: E402
from node.lora import add_adapters  # noqa: E402
from node.model import build_tiny_model, load_causal_lm, resolve_model  # noqa: E402
from node.publisher import Publisher  # noqa: E402
from node.swarm import SwarmOptimizer  # noqa: E402
from node.trainer_link import fetch_chunks  # noqa: E402
from node.weights import PolicySnapshot, SpareBuffer, WeightAssembly, snapshot  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "swarm.json"

# A trainer loads the model, starts its DHT and (joining) loads the swarm's state within
# this; generous, as a 2-core box shared with other work can be slow to start p2pd.
STARTUP_TIMEOUT_S = 180.0
# Some trainer reports a step at least this often (an embedded-model step is 5-10 s here).
STEP_TIMEOUT_S = 120.0
# The warm-up's global steps must be done within this.
WARMUP_TIMEOUT_S = 300.0
# A stopped trainer finishes its step and shuts hivemind down in order within this (one
# averaging timeout, 30 s, plus shutdown), else its process group gets SIGTERM.
STOP_GRACE_S = 60.0
# SIGTERM → SIGKILL.
KILL_GRACE_S = 5.0
# Daemons a child started (p2pd, torch's shared-memory manager) exit on their own within
# this once it is gone; after it they are killed.
DAEMON_EXIT_S = 15.0
# A weight server or TCP sink answers within this.
SERVICE_TIMEOUT_S = 120.0
# Small learning rate: the policy barely moves, so the synthetic groups' sampler logprobs
# stay the policy's own (importance ratio ≈ 1, no clipping) for the whole run.
LR = 1e-6
# What `--set model.lora_rank=8` (docs/training.md, "LoRA") trains: the project's default
# targets and alpha.
LORA = ModelConfig(lora_rank=8)
# average_state_every for --grads-only: never an epoch inside a benchmark's window.
NO_STATE_AVERAGING = 1_000_000
TCP_BUFFER_BYTES = 1 << 20

_run_seq = itertools.count()


class BenchError(RuntimeError):
    """A child failed or did not answer in time; the message carries its log's tail."""


# ── the synthetic work ───────────────────────────────────────────────────────────


def synthetic_groups(
    model: Any, count: int, group_size: int, prompt_tokens: int, completion_tokens: int, seed: int
) -> list[protocol.TrajectoryGroup]:
    """Well-formed groups like tests/factories.py make_group, at realistic lengths: random
    tokens, rewards alternating 1/0, and the model's own logprobs as the sampler's."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    groups = []
    for g in range(count):
        prompt = torch.randint(vocab, (prompt_tokens,), generator=gen)
        completions = torch.randint(vocab, (group_size, completion_tokens), generator=gen)
        logprobs = policy_logprobs(model, prompt, completions)
        samples = [
            protocol.Sample(
                prompt_ids=protocol.pack_ids(prompt.numpy()),
                completion_ids=protocol.pack_ids(completions[i].numpy()),
                logprobs=protocol.pack_floats(logprobs[i].numpy()),
                loss_mask=protocol.pack_mask(np.ones(completion_tokens)),
                reward=float(i % 2 == 0),
                advantage=0.0,
                policy_version=0,
            )
            for i in range(group_size)
        ]
        group_id = f"bench-{seed}-{g}"
        groups.append(
            protocol.TrajectoryGroup(
                group_id=group_id,
                grant_id=group_id,
                node_id="bench",
                task_id=f"t{g}",
                env="synthetic",
                samples=samples,
                created_at=time.time(),
            )
        )
    return groups


def policy_logprobs(model: Any, prompt: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """log pi(completion token | prompt, earlier tokens), temperature 1: [G, T]."""
    ids = torch.cat([prompt.expand(len(completions), -1), completions], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)


# ── child side ───────────────────────────────────────────────────────────────────


def message_channel() -> TextIO:
    """Our JSON lines get the real stdout; whatever libraries print (p2pd, hivemind) goes
    to stderr, the child's log, so it can never garble a message."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def emit(out: TextIO, event: str, **fields: Any) -> None:
    out.write(json.dumps({"event": event, **fields}) + "\n")


class Commands:
    """Lines the parent writes on this child's stdin; EOF (the parent is gone) means stop."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.buffer = b""
        self.closed = False

    def read(self, timeout_s: float | None) -> list[str]:
        if self.closed or not select.select([self.fd], [], [], timeout_s)[0]:
            return []
        data = os.read(self.fd, 4096)
        if not data:
            self.closed = True
            return []
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        return [line.decode().strip() for line in lines]

    def wait_for(self, command: str) -> None:
        while not self.closed:
            if command in self.read(None):
                return
        raise SystemExit(f"stdin closed before {command!r}")


@dataclass(frozen=True)
class TrainerSettings:
    model_dir: str
    run_id: str
    index: int
    trainers: int
    initial_peers: list[str]
    groups_per_step: int
    group_size: int
    prompt_tokens: int
    completion_tokens: int
    grad_compression: str
    average_state_every: int
    lora: bool
    threads: int


def trainer_child(s: TrainerSettings, out: TextIO) -> None:
    """Train on the same synthetic batch again and again; one "step" line per train_step."""
    commands = Commands()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.index)
    model, tokenizer = load_causal_lm(s.model_dir)
    args = (s.groups_per_step, s.group_size, s.prompt_tokens, s.completion_tokens)
    groups = synthetic_groups(model, *args, seed=s.index)
    if s.lora:
        model = add_adapters(model, LORA)
    params = [p for p in model.parameters() if p.requires_grad]
    config = SwarmConfig(
        run_id=s.run_id,
        initial_peers=s.initial_peers,
        grad_compression=s.grad_compression,  # type: ignore[arg-type]
        average_state_every=s.average_state_every,
    )
    local_batch = s.groups_per_step * s.group_size
    swarm = SwarmOptimizer(
        config,
        params,
        lr=LR,
        weight_decay=0.0,
        target_batch_size=s.trainers * local_batch,
        other_trainers=lambda: s.trainers - 1,  # what the trainer's directory would list
    )
    try:
        if s.initial_peers:
            swarm.load_state_from_peers()
        pad = int(tokenizer.pad_token_id or 0)
        learner = Learner(model, swarm, TrainerConfig(), temperature=1.0, pad_token_id=pad)
        emit(
            out,
            "ready",
            maddrs=visible_maddrs(swarm.dht),
            trainable_params=sum(p.numel() for p in params),
            trainable_bytes=sum(p.numel() * p.element_size() for p in params),
        )
        commands.wait_for("go")
        train_until_stopped(learner, swarm, groups, commands, out)
    finally:
        swarm.shutdown()


def train_until_stopped(
    learner: Learner,
    swarm: SwarmOptimizer,
    groups: list[protocol.TrajectoryGroup],
    commands: Commands,
    out: TextIO,
) -> None:
    """`applied_samples`: the samples whose gradients went into the step that reached
    `epoch` (this trainer's share of that global step); 0 when nothing was applied."""
    pending = 0
    while not commands.closed and "stop" not in commands.read(0):
        reloads = swarm.optimizer.reloads
        row = learner.train_step(groups).row()
        pending += row["charts/samples"]
        applied = discarded = 0
        if row["optimizer_discarded"]:
            discarded, pending = pending, 0
        elif row["optimizer_stepped"]:
            applied, pending = pending, 0
        emit(
            out,
            "step",
            t=time.monotonic(),
            epoch=row["policy_version"],
            applied_samples=applied,
            discarded_samples=discarded,
            step_s=row["perf/step_s"],
            # The swarm's state downloaded in this step: the trainer was out of sync.
            state_reloads=swarm.optimizer.reloads - reloads,
        )


def weight_server_child(settings: dict[str, Any], out: TextIO) -> None:
    model, _ = load_causal_lm(settings["model_dir"])
    published = snapshot(model, 1, settings["chunk_bytes"], seal=True)  # as with keys
    del model
    keys = read_node_keys(settings["keys"], "bench-trainer")
    uvloop.run(serve_policy(published, out, settings["max_message_bytes"], keys))


async def serve_policy(
    published: PolicySnapshot, out: TextIO, max_message_bytes: int, keys: NodeKeys
) -> None:
    """Serve one version as node/trainer.py does with the swarm's keys (a node/publisher.py
    Publisher: PolicyQuery and chunks over CURVE, sealed chunks on its sealed endpoint),
    until stdin says anything (or closes)."""
    server = Server("tcp://127.0.0.1:0", protocol.trainer_request_decoder, max_message_bytes, keys)
    sealed = Server("tcp://127.0.0.1:0", protocol.trainer_request_decoder, max_message_bytes)
    publisher = Publisher(published, "bench", sealed)
    publisher.announce(server.endpoint)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)
    serving = [
        asyncio.create_task(answer_requests(server, publisher), name="bench-serve"),
        asyncio.create_task(publisher.serve_sealed(), name="bench-serve-sealed"),
    ]
    emit(
        out,
        "ready",
        endpoint=server.endpoint,
        nbytes=published.nbytes,
        num_chunks=published.num_chunks,
    )
    try:
        await stop.wait()
    finally:
        for task in serving:
            task.cancel()
        server.close()
        sealed.close()


async def answer_requests(server: Server, publisher: Publisher) -> None:
    while True:
        envelope, msg = await server.recv()
        reply: protocol.TrainerReply
        match msg:
            case protocol.Hello():
                reply = protocol.answer_hello(msg, "bench", publisher.published.version)
            case protocol.PolicyQuery():
                reply = publisher.info(protocol.Lineage(), msg.manifest)
            case protocol.WeightChunkRequest():
                reply = publisher.chunk(msg)
            case _:
                reply = protocol.Error(code="invalid", message=f"unexpected {msg!r}"[:200])
        await server.reply(envelope, reply)


def tcp_sink_child(settings: dict[str, Any], out: TextIO) -> None:
    """Accept one connection; read `nbytes` and answer one byte, until the sender closes."""
    nbytes = settings["nbytes"]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        emit(out, "ready", port=listener.getsockname()[1])
        if listener not in select.select([listener, sys.stdin], [], [])[0]:
            return  # the parent stopped us before connecting
        conn, _ = listener.accept()
    buffer = memoryview(bytearray(TCP_BUFFER_BYTES))
    with conn:
        while True:
            received = 0
            while received < nbytes:
                n = conn.recv_into(buffer, min(len(buffer), nbytes - received))
                if n == 0:
                    return
                received += n
            conn.sendall(b"k")


def run_child(role: str, settings: dict[str, Any]) -> int:
    out = message_channel()
    # SIGTERM unwinds (hivemind shut down in order, in `finally`) instead of dying at once.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    match role:
        case "trainer":
            trainer_child(TrainerSettings(**settings), out)
        case "weight-server":
            weight_server_child(settings, out)
        case "tcp-sink":
            tcp_sink_child(settings, out)
    return 0


# ── parent side: children ────────────────────────────────────────────────────────


class Child:
    """One child process: JSON lines on its stdout, commands on its stdin, stderr to a log."""

    def __init__(self, name: str, argv: list[str], log_path: Path, netns: str | None) -> None:
        self.name = name
        self.log_path = log_path
        prefix = ["ip", "netns", "exec", netns] if netns else []  # it execs: same PID
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*prefix, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # its own process group, with its hivemind daemons
            )
        self.buffer = b""
        self.inbox: deque[dict[str, Any]] = deque()  # messages read, not yet handled
        self.eof = False  # its stdout closed: it exited
        # Every process seen below it (hivemind's DHT, p2pd, torch's shared-memory
        # manager): PID → start time, which names one process even after a PID is reused.
        self.spawned: dict[int, int] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with suppress(BrokenPipeError):
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()

    @property
    def stdout_fd(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def fill(self) -> None:
        """Read what the child wrote: complete lines go to the inbox; EOF sets `eof`."""
        data = os.read(self.stdout_fd, 1 << 16)
        if not data:
            self.eof = True
            return
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        self.inbox.extend(json.loads(line) for line in lines if line.strip())

    def note_spawned(self) -> None:
        if self.proc.poll() is None:
            for pid in descendants(self.pid):
                if (ticks := _start_ticks(pid)) is not None:
                    self.spawned[pid] = ticks

    def tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"── {self.name} (log {self.log_path}):\n" + "\n".join(text)


class Children:
    """Starts this script's child roles, reads their messages, and reaps them all by PID."""

    def __init__(self, log_dir: Path, script: str = __file__) -> None:
        self.log_dir = log_dir
        self.script = str(Path(script).resolve())  # run as `script --child ROLE --settings J`
        self.children: list[Child] = []

    def start(
        self, name: str, role: str, settings: dict[str, Any], netns: str | None = None
    ) -> Child:
        argv = [sys.executable, self.script, "--child", role]
        argv += ["--settings", json.dumps(settings)]
        child = Child(name, argv, self.log_dir / f"{name}.log", netns)
        self.children.append(child)
        return child

    def messages(self, timeout_s: float) -> Iterator[tuple[Child, dict[str, Any]]]:
        """Messages in order of arrival; BenchError when a child exits or none speaks in
        timeout_s. Messages left unhandled stay in the children's inboxes."""
        while True:
            for child in self.children:
                while child.inbox:
                    yield child, child.inbox.popleft()
            readable = self._readable(timeout_s)
            if not readable:
                raise BenchError(f"no child spoke for {timeout_s:.0f} s\n{self.tails()}")
            for child in readable:
                child.fill()
                if child.eof:
                    code = child.proc.wait()
                    raise BenchError(f"{child.name} exited with {code}\n{child.tail()}")

    def expect(self, child: Child, event: str, timeout_s: float) -> dict[str, Any]:
        for sender, message in self.messages(timeout_s):
            if sender is child and message["event"] == event:
                return message
        raise AssertionError("unreachable")

    def stop(self, grace_s: float) -> list[tuple[Child, dict[str, Any]]]:
        """Say "stop" to every child, collect their last messages while they exit, then
        close(): a child still running after grace_s is killed."""
        for child in self.children:
            if child.proc.poll() is None:
                child.note_spawned()
                child.send("stop")
        deadline = time.monotonic() + grace_s
        while any(not c.eof for c in self.children) and time.monotonic() < deadline:
            for child in self._readable(deadline - time.monotonic()):
                child.fill()
        late = [(c, m) for c in self.children for m in c.inbox]
        self.close()
        return late

    def _readable(self, timeout_s: float) -> list[Child]:
        fds = {c.stdout_fd: c for c in self.children if not c.eof}
        ready = select.select(list(fds), [], [], max(timeout_s, 0.0))[0] if fds else []
        return [fds[fd] for fd in ready]

    def close(self) -> None:
        """SIGTERM each live child (it shuts hivemind down in order), SIGKILL its process
        group after KILL_GRACE_S, reap it by PID; then stop what it left behind."""
        for child in self.children:
            child.note_spawned()
            if child.proc.poll() is None:
                with suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        for child in self.children:
            try:
                child.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _signal_group(child.pid, signal.SIGKILL)
                child.proc.wait()
            for pipe in (child.proc.stdin, child.proc.stdout):
                if pipe is not None:
                    with suppress(BrokenPipeError):
                        pipe.close()
        stop_daemons({pid: t for c in self.children for pid, t in c.spawned.items()})
        self.children.clear()

    def tails(self) -> str:
        return "\n".join(child.tail() for child in self.children)


def stop_daemons(processes: dict[int, int]) -> None:
    """Give the processes (PID → start time) a child left behind DAEMON_EXIT_S to exit on
    their own, then SIGKILL the rest. Killed early, torch's shared-memory manager would
    leave its /dev/shm files behind for good. Each process is pinned by a pidfd and
    checked to be the one seen, so a reused PID is never signalled."""
    pinned: dict[int, int] = {}
    for pid, ticks in processes.items():
        with suppress(ProcessLookupError):
            fd = os.pidfd_open(pid)
            if _start_ticks(pid) == ticks:
                pinned[fd] = pid
            else:
                os.close(fd)
    deadline = time.monotonic() + DAEMON_EXIT_S
    try:
        while pinned and (left := deadline - time.monotonic()) > 0:
            for fd in select.select(list(pinned), [], [], left)[0]:  # readable: it exited
                del pinned[fd]
                os.close(fd)
        for fd in pinned:
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        for fd in pinned:
            os.close(fd)


def _start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks after boot), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    """Only while the group's leader is unreaped: until then its PID is not anyone else's."""
    with suppress(ProcessLookupError):
        os.killpg(pgid, signum)


# ── parent side: network namespaces ─────────────────────────────────────────────


def netns_unavailable() -> str | None:
    """None when a private network namespace can be made here, else a one-line reason."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    try:
        with Netns():
            pass
    except subprocess.CalledProcessError as e:
        return f"cannot make a network namespace: {e.stderr.strip()}"
    return None


class Netns:
    """A fresh network namespace holding only `lo` (up), named aj<pid>bench<seq> so a
    leftover is traced back to its run; deleted on exit, strays killed by PID first."""

    def __init__(self) -> None:
        self.name = f"aj{os.getpid()}bench{next(_run_seq)}"

    def __enter__(self) -> Netns:
        _ip("netns", "add", self.name)
        try:
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            _ip("netns", "delete", self.name)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in _ip("netns", "pids", self.name).split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "delete", self.name)


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def loopback_rx_bytes(pid: int) -> int:
    """Bytes received on `lo` in `pid`'s network namespace: on loopback every byte sent is
    received once, so this is the namespace's traffic (IP and TCP headers included)."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])
    raise BenchError(f"no `lo` in /proc/{pid}/net/dev")


# ── parent side: a trainer swarm ────────────────────────────────────────────────


@dataclass(frozen=True)
class Mark:
    """Trainer 0 reporting a step: when, at which epoch, the namespace's bytes so far."""

    t: float
    epoch: int
    lo_bytes: int | None


@dataclass
class SwarmRun:
    trainers: int
    variant: str
    average_state_every: int
    trainable_params: int
    trainable_bytes: int
    start: Mark
    end: Mark
    samples: int  # applied in the window's global steps, all trainers
    discarded_samples: int
    state_reloads: int
    # One trainer's train_step (forward, backward, swarm step), every step of the run.
    step_s: list[float]

    @property
    def steps(self) -> int:
        return self.end.epoch - self.start.epoch

    @property
    def window_s(self) -> float:
        return self.end.t - self.start.t

    @property
    def bytes_per_step(self) -> int | None:
        if self.start.lo_bytes is None or self.end.lo_bytes is None or not self.steps:
            return None
        return round((self.end.lo_bytes - self.start.lo_bytes) / self.steps)

    def summary(self) -> dict[str, Any]:
        return {
            "trainers": self.trainers,
            "variant": self.variant,
            "average_state_every": self.average_state_every,
            "global_steps": self.steps,
            "window_s": round(self.window_s, 2),
            "steps_per_s": round(self.steps / self.window_s, 3),
            "samples": self.samples,
            "samples_per_s": round(self.samples / self.window_s, 2),
            "discarded_samples": self.discarded_samples,
            "state_reloads": self.state_reloads,
            "samples_per_global_step": round(self.samples / max(self.steps, 1), 1),
            "train_step_s_median": round(statistics.median(self.step_s), 3),
            "train_step_s_mean": round(statistics.mean(self.step_s), 3),
            "bytes_per_step": self.bytes_per_step,
            "trainable_params": self.trainable_params,
        }


@dataclass(frozen=True)
class Variant:
    grad_compression: str
    lora: bool


VARIANTS = {
    "full": Variant("none", lora=False),
    "full_fp16": Variant("fp16", lora=False),
    "lora": Variant("none", lora=True),
}


@dataclass
class Observed:
    """Trainer 0's marks (the window) and every trainer's step lines."""

    warmup_steps: int
    start: Mark | None = None
    end: Mark | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)

    def add(self, message: dict[str, Any]) -> None:
        if message["event"] == "step":
            self.steps.append(message)

    def mark(self, mark: Mark) -> None:
        if self.start is None:
            if mark.epoch >= self.warmup_steps:
                self.start = mark
        else:
            self.end = mark

    def done(self, window_s: float, window_steps: int) -> bool:
        """The window closes after window_steps global steps or window_s, whichever first."""
        if self.start is None or self.end is None:
            return False
        steps = self.end.epoch - self.start.epoch
        return steps >= window_steps or self.end.t - self.start.t >= window_s


def run_swarm(
    args: argparse.Namespace,
    model_dir: Path,
    log_dir: Path,
    trainers: int,
    variant: str,
    *,
    average_state_every: int = 1,
    isolate: bool,
) -> SwarmRun:
    """Start `trainers` trainer processes (in a fresh namespace when `isolate`), train past
    the warm-up, observe one window, stop them; see the module docstring."""
    label = f"{trainers}x-{variant}-state{average_state_every}"
    began = time.monotonic()
    settings = TrainerSettings(
        model_dir=str(model_dir),
        run_id=f"bench-swarm-{os.getpid()}-{next(_run_seq)}",
        index=0,
        trainers=trainers,
        initial_peers=[],
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens,
        grad_compression=VARIANTS[variant].grad_compression,
        average_state_every=average_state_every,
        lora=VARIANTS[variant].lora,
        threads=args.threads,
    )
    with ExitStack() as stack:
        netns = stack.enter_context(Netns()).name if isolate else None
        children = Children(log_dir)
        stack.callback(children.close)
        first = children.start(f"{label}-trainer0", "trainer", asdict(settings), netns)
        ready = children.expect(first, "ready", STARTUP_TIMEOUT_S)
        for i in range(1, trainers):
            joining = replace(settings, index=i, initial_peers=ready["maddrs"])
            other = children.start(f"{label}-trainer{i}", "trainer", asdict(joining), netns)
            children.expect(other, "ready", STARTUP_TIMEOUT_S)
        for child in children.children:
            child.note_spawned()
            child.send("go")
        go = time.monotonic()
        observed = observe(children, first, args, count_bytes=netns is not None)
        stopping = time.monotonic()
        for _, message in children.stop(STOP_GRACE_S):
            observed.add(message)
    run = summarize(observed, trainers, variant, average_state_every, ready)
    assert observed.start is not None
    print(
        f"{label}: {run.steps} global steps in {run.window_s:.1f} s; start-up "
        f"{go - began:.0f} s, warm-up {observed.start.t - go:.0f} s, "
        f"stop {time.monotonic() - stopping:.0f} s",
        flush=True,
    )
    return run


def observe(
    children: Children,
    first: Child,
    args: argparse.Namespace,
    *,
    count_bytes: bool,
) -> Observed:
    """Every message until trainer 0 closes the window (see Observed.done)."""
    observed = Observed(args.warmup_steps)
    warmup_deadline = time.monotonic() + WARMUP_TIMEOUT_S
    for child, message in children.messages(STEP_TIMEOUT_S):
        observed.add(message)
        if child is first and message["event"] == "step":
            lo_bytes = loopback_rx_bytes(first.pid) if count_bytes else None
            observed.mark(Mark(message["t"], message["epoch"], lo_bytes))
            if observed.done(args.window_s, args.window_steps):
                return observed
        if observed.start is None and time.monotonic() > warmup_deadline:
            raise BenchError(
                f"the swarm did not reach epoch {args.warmup_steps} in {WARMUP_TIMEOUT_S:.0f} s"
            )
    raise AssertionError("unreachable")


def summarize(
    observed: Observed, trainers: int, variant: str, average_state_every: int, ready: dict[str, Any]
) -> SwarmRun:
    start, end = observed.start, observed.end
    assert start is not None and end is not None
    in_window = [s for s in observed.steps if start.epoch < s["epoch"] <= end.epoch]
    during = [s for s in observed.steps if start.t < s["t"] <= end.t]
    return SwarmRun(
        trainers=trainers,
        variant=variant,
        average_state_every=average_state_every,
        trainable_params=ready["trainable_params"],
        trainable_bytes=ready["trainable_bytes"],
        start=start,
        end=end,
        samples=sum(s["applied_samples"] for s in in_window),
        discarded_samples=sum(s["discarded_samples"] for s in during),
        state_reloads=sum(s["state_reloads"] for s in during),
        step_s=[s["step_s"] for s in observed.steps],
    )


# ── parent side: weight delivery ────────────────────────────────────────────────


async def fetch_and_stream(
    endpoint: str, port: int, nbytes: int, rounds: int, net: NetConfig, keys: NodeKeys
) -> tuple[dict[str, list[dict[str, float]]], list[float]]:
    """Interleaved, so machine noise hits all alike: fetch the served policy as a rollout
    node does (sealed chunks on the sealed endpoint), then the same sealed chunks over
    CURVE (the trainer's own socket), then stream as many bytes to the TCP sink; `rounds`
    + 1 times on one connection each (the first round connects and warms up; left out)."""
    hello = protocol.Hello(node_id=keys.name, role="rollout")
    client = Client(
        endpoint,
        protocol.trainer_reply_decoder,
        hello,
        net.max_message_bytes,
        SERVICE_TIMEOUT_S,
        keys,
    )
    payload = memoryview(bytearray(nbytes))
    fetches: dict[str, list[dict[str, float]]] = {"sealed": [], "over_curve": []}
    spares = {way: SpareBuffer() for way in fetches}  # one per rollout node, as it keeps one
    streams = []
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds + 1):
                for way, rows in fetches.items():
                    rows.append(await fetch_policy(client, spares[way], way == "sealed"))
                streams.append(stream_once(sock, payload))
    finally:
        client.close()
    return {way: rows[1:] for way, rows in fetches.items()}, streams[1:]


async def fetch_policy(
    client: Client, spare: SpareBuffer, sealed_endpoint: bool
) -> dict[str, float]:
    """What node/rollout.py does: PolicyQuery, every chunk (each unsealed and checked as it
    comes) into the last version's buffer, finish() (the tensors), the buffer kept for the
    next fetch; without `sealed_endpoint` every chunk over CURVE."""
    start = time.perf_counter()
    info = await client.request(protocol.PolicyQuery())
    assert isinstance(info, protocol.PolicyInfo), info
    if not sealed_endpoint:
        info = msgspec.structs.replace(info, sealed_endpoint="")
    assembly = WeightAssembly.of(info, spare)
    await fetch_chunks(assembly, info, client)
    transferred = time.perf_counter()
    state = assembly.finish()
    done = time.perf_counter()
    assert state, "an empty policy"
    spare.keep(assembly.blob)
    return {
        "total_s": done - start,
        "transfer_s": transferred - start,
        "finish_s": done - transferred,
    }


def stream_once(sock: socket.socket, payload: memoryview) -> float:
    """Send the payload, wait for the sink's one-byte answer: seconds."""
    start = time.perf_counter()
    sock.sendall(payload)
    if sock.recv(1) != b"k":
        raise BenchError("the TCP sink closed the connection early")
    return time.perf_counter() - start


def measure_delivery(
    args: argparse.Namespace, model_name: str, model_dir: Path, log_dir: Path
) -> dict[str, Any]:
    net = NetConfig()
    keys_path = log_dir / "delivery.keys"  # CURVE, as every node's sockets use
    keys_path.unlink(missing_ok=True)
    write_keys(keys_path)
    keys = read_node_keys(keys_path, "bench-rollout")
    with ExitStack() as stack:
        children = Children(log_dir)
        stack.callback(children.close)
        settings = {
            "model_dir": str(model_dir),
            "chunk_bytes": net.weight_chunk_bytes,
            "max_message_bytes": net.max_message_bytes,
            "keys": str(keys_path),
        }
        server = children.start("weight-server", "weight-server", settings)
        served = children.expect(server, "ready", STARTUP_TIMEOUT_S)
        sink = children.start("tcp-sink", "tcp-sink", {"nbytes": served["nbytes"]})
        port = children.expect(sink, "ready", SERVICE_TIMEOUT_S)["port"]
        fetches, streams = uvloop.run(
            fetch_and_stream(served["endpoint"], port, served["nbytes"], args.fetches, net, keys)
        )
        children.stop(SERVICE_TIMEOUT_S)
    sealed, over_curve = fetches["sealed"], fetches["over_curve"]
    delivery_s = statistics.median(f["total_s"] for f in sealed)
    curve_s = statistics.median(f["total_s"] for f in over_curve)
    floor_s = statistics.median(streams)
    print(f"weight delivery: {len(sealed)} fetches each way", flush=True)
    return {
        "weight_delivery_s": round(delivery_s, 4),
        "weight_delivery_floor_s": round(floor_s, 4),
        "weight_delivery_ratio": round(delivery_s / floor_s, 2),
        "weight_delivery": {
            "model": model_name,
            "snapshot_bytes": served["nbytes"],
            "chunks": served["num_chunks"],
            "chunk_bytes": net.weight_chunk_bytes,
            "fetches": len(sealed),
            "transfer_s_median": round(statistics.median(f["transfer_s"] for f in sealed), 4),
            "finish_s_median": round(statistics.median(f["finish_s"] for f in sealed), 4),
            "fetch_s": [round(f["total_s"], 4) for f in sealed],
            "floor_s": [round(t, 4) for t in streams],
            "loopback_tcp_gbit_s": round(served["nbytes"] * 8 / floor_s / 1e9, 2),
            # the same sealed chunks through the trainer's CURVE socket (no sealed endpoint)
            "over_curve_s": round(curve_s, 4),
            "over_curve_ratio": round(curve_s / floor_s, 2),
            "over_curve_fetch_s": [round(f["total_s"], 4) for f in over_curve],
        },
    }


# ── parent side: the whole benchmark ────────────────────────────────────────────


def prepare_model(choice: str, tmp: Path) -> tuple[str, Path]:
    if choice == "embedded":
        return EMBEDDED_MODEL, resolve_model(EMBEDDED_MODEL, ModelConfig().cache_dir)
    return "tiny (node.model.build_tiny_model, seed 0)", build_tiny_model(tmp / "tiny-model")


def swarm_runs(
    args: argparse.Namespace, model_dir: Path, log_dir: Path, *, isolate: bool
) -> list[SwarmRun]:
    """1 and 2 trainers, full model (throughput; the pair's bytes too when `isolate`), then
    with namespaces the pair again with fp16 gradients and with LoRA, and on --grads-only
    all three pairs with parameter averaging off."""
    runs = [run_swarm(args, model_dir, log_dir, n, "full", isolate=isolate) for n in (1, 2)]
    if not isolate:
        return runs
    runs += [run_swarm(args, model_dir, log_dir, 2, v, isolate=True) for v in ("full_fp16", "lora")]
    if args.grads_only:
        runs += [
            run_swarm(
                args, model_dir, log_dir, 2, v, average_state_every=NO_STATE_AVERAGING, isolate=True
            )
            for v in VARIANTS
        ]
    return runs


def throughput_results(runs: list[SwarmRun]) -> dict[str, Any]:
    full = [r.summary() for r in runs if r.variant == "full" and r.average_state_every == 1]
    if not full:
        return {}
    return {
        "samples_per_s": {str(r["trainers"]): r["samples_per_s"] for r in full},
        "steps_per_s": {str(r["trainers"]): r["steps_per_s"] for r in full},
    }


def bytes_results(runs: list[SwarmRun]) -> dict[str, Any]:
    """Bytes per global step of the two-trainer runs, by variant; and the parameter bytes."""
    pairs = [r for r in runs if r.trainers == 2]
    result: dict[str, Any] = {
        "bytes_per_step": {r.variant: r.bytes_per_step for r in pairs if r.average_state_every == 1}
    }
    grads_only = {r.variant: r.bytes_per_step for r in pairs if r.average_state_every != 1}
    if grads_only:
        result["bytes_per_step_grads_only"] = grads_only
    result["param_bytes"] = {
        r.variant: r.trainable_bytes for r in pairs if r.variant != "full_fp16"
    }
    return result


def machine_notes() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def print_summary(result: dict[str, Any]) -> None:
    sps, steps = result.get("samples_per_s", {}), result.get("steps_per_s", {})
    print(f"\nmodel: {result['model']}")
    for n in sps:
        print(f"  {n} trainer(s): {steps[n]:.2f} global steps/s, {sps[n]:.1f} samples/s")
    for key in ("bytes_per_step", "bytes_per_step_grads_only"):
        for variant, nbytes in result.get(key, {}).items():
            shown = f"{nbytes / 1e6:.3f} MB" if nbytes else "no global step"
            print(f"  {key} {variant}: {shown}")
    if "bytes_per_step_error" in result:
        print(f"  bytes per step: not measured ({result['bytes_per_step_error']})")
    print(
        f"  weight delivery: {result['weight_delivery_s']:.3f} s, floor "
        f"{result['weight_delivery_floor_s']:.3f} s ({result['weight_delivery_ratio']}x), "
        f"{result['weight_delivery']['snapshot_bytes'] / 1e6:.1f} MB"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "embedded"], default="tiny")
    parser.add_argument("--warmup-steps", type=int, default=3, help="global steps not measured")
    parser.add_argument(
        "--window-s", type=float, default=30.0, help="a run's window closes after this..."
    )
    parser.add_argument("--window-steps", type=int, default=20, help="...or this many steps")
    parser.add_argument(
        "--grads-only",
        action="store_true",
        help="also measure bytes with parameter averaging off (3 more runs, ~2.5 min)",
    )
    parser.add_argument("--groups-per-step", type=int, default=2, help="groups per local batch")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trainer")
    parser.add_argument("--fetches", type=int, default=5, help="timed policy fetches")
    parser.add_argument(
        "--delivery-only",
        action="store_true",
        help="skip the trainers (e.g. --model embedded where two trainers do not fit in memory)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=["trainer", "weight-server", "tcp-sink"])
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.child:
        return run_child(args.child, json.loads(args.settings))
    started = time.monotonic()
    notes = machine_notes()
    no_netns = None if args.delivery_only else netns_unavailable()
    isolate = no_netns is None
    work = Path(tempfile.mkdtemp(prefix="bench-swarm-"))  # the tiny model, children's logs
    try:
        model_name, model_dir = prepare_model(args.model, work)
        runs = [] if args.delivery_only else swarm_runs(args, model_dir, work, isolate=isolate)
        result = throughput_results(runs)
        if no_netns is not None:
            print(f"bytes per step: not measured: {no_netns}", file=sys.stderr)
            result["bytes_per_step_error"] = no_netns
        elif runs:
            result |= bytes_results(runs)
        result |= measure_delivery(args, model_name, model_dir, work)
    except BaseException:
        print(f"children's logs kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work)
    result |= {
        "model": model_name,
        "runs": [r.summary() for r in runs],
        "settings": {
            "groups_per_step": args.groups_per_step,
            "group_size": args.group_size,
            "local_batch_samples": args.groups_per_step * args.group_size,
            "target_batch_size": "trainers x local batch",
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "torch_threads_per_trainer": args.threads,
            "warmup_steps": args.warmup_steps,
            "window_s": args.window_s,
            "window_steps": args.window_steps,
            "lora": {"r": LORA.lora_rank, "alpha": LORA.lora_alpha, "targets": LORA.lora_targets},
            "swarm": "SwarmConfig defaults (matchmaking 1 s, average_state_every 1) unless noted",
            "throughput_in_private_netns": no_netns is None,
            "bytes_counted": "rx bytes of lo in a namespace holding only the two trainers "
            "(IP/TCP headers, DHT and matchmaking traffic included)",
        },
        "machine": notes | {"load_avg_1m_end": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result)
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 1 if no_netns else 0


if __name__ == "__main__":
    sys.exit(main())
