"""`just bench-links-rounds`: gradient rounds between trainers over real links (issue 51).

    links      tests/netns.py Swarmnet, as bench/links.py: every trainer in its own network
               namespace behind one veth, limited each way to the profile's rate with tc tbf
               ("loopback": the veth as it is); bytes on the wire: each veth's tx counter.
               A Swarmnet per profile.
    trainers   --trainers processes (2), fresh for each cell (one DHT and optimizer per
               process: a second SwarmOptimizer over a kept DHT broke its shutdown), model
               loads in parallel, then trainer 0's DHT first and the others joining it. Each
               runs a real node/swarm.py SwarmOptimizer and real Learner.train_step gradients
               on synthetic groups (bench/swarm.py synthetic_groups and train_until_stopped:
               --groups-per-step groups of --group-size samples, --prompt-tokens +
               --completion-tokens tokens, the same batch every step, lr 1e-6). Every
               trainer starts from the same weights (LoRA adapters seeded alike), so none
               downloads state. SwarmConfig.average_state_every = 1000: no parameter round
               ever runs, so the bytes are the gradient rounds' (plus the DHT's and
               matchmaking's). averaging_timeout_s: the default 30 s, or on slow links
               ROUND_TIMEOUT_FLOORS times the round's expected floor plus that (an exact
               full round at 100 Mbit/s alone takes 43 s); the rest SwarmConfig's defaults.
    kinds      "full" (SmolLM2-135M, every weight trained, float32) and "lora" (node/lora.py
               adapters, rank 8)
    modes      exact (grad_compression "none": float32), fp16, uint8 (hivemind's
               Uniform8BitQuantization), quantile8 (not by default), local_steps and
               local_steps_fp16 (SwarmConfig.local_steps = H, --local-steps: the learner's
               optimizer is node/local_steps.py LocalSteps around the SwarmOptimizer, as
               node/trainer.py makes it: H inner AdamW steps, then one outer round of the
               pseudo-gradient)
    a cell     (profile, kind, mode): --warmup-rounds rounds, then a window of
               --window-rounds rounds (per profile by default: WARMUP_ROUNDS,
               WINDOW_ROUNDS); every trainer trains exactly that many steps (StepLimit),
               then shuts its averagers and DHT down (`shut_down`). A GLOBAL step = one
               local batch trained by every trainer (H of them per round with local steps)
        bytes_per_step    the window's tx bytes of every trainer / global steps / trainers:
                          what one trainer sends per global step (receives about as much)
        round_s           each SwarmOptimizer.step_outcome in the window, every trainer
                          (the wait for the others' batches, matchmaking, the all-reduce,
                          the optimizer step): median and max
        floor_s           the bytes each trainer sent per round / the link's rate
        global_step_s     the window's wall time / its global steps; compute_s: a
                          train_step's median time less its round
        failed            SwarmOptimizer.counts() over the window, all trainers
                          (failed_rounds, incomplete_rounds, partial_rounds, ...)
        share_of_exact    bytes_per_step / the exact mode's, same kind (and profile)
    skipped    by default (SKIPPED) full exact and full local_steps at 20mbit (minutes a
               round), LoRA but exact at 1gbit, LoRA uint8 and local_steps at 20mbit:
               EXTRAPOLATED, marked "measured": false: bytes from the same cell on another
               link, round_s from this profile's per-byte line (--measure-all runs them)
    per_byte   per profile, a least-squares line through the measured cells' (MB each
               trainer sent per round, median round_s): s_per_mb and fixed_s per round

Children are this script (`--child trainer`), each in its own session and namespace:
JSON lines on stdout, commands on stdin, reaped by PID with what they spawned
(bench/swarm.py Children). Needs root (namespaces, tc). Results: the "rounds" key of
bench/results/links.json (--out; other keys kept; cells of earlier runs kept unless
measured again): {"cells": {profile: {kind: {mode: numbers}}}, "per_byte": {profile: ...},
"settings": ...}, read by bench/rounds_model.py; --quick writes nothing unless --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import msgspec  # noqa: E402
import torch  # noqa: E402
from links import PROFILES  # noqa: E402
from swarm import (  # noqa: E402
    LORA,
    LR,
    STARTUP_TIMEOUT_S,
    STEP_TIMEOUT_S,
    BenchError,
    Child,
    Children,
    Commands,
    emit,
    machine_notes,
    message_channel,
    prepare_model,
    synthetic_groups,
    train_until_stopped,
)

from agentjet.config import SwarmConfig, TrainerConfig  # noqa: E402
from node.dht import visible_maddrs  # noqa: E402
from node.learner import Learner  # noqa: E402
from node.local_steps import with_local_steps  # noqa: E402
from node.lora import add_adapters  # noqa: E402
from node.model import load_causal_lm  # noqa: E402
from node.rounds import StepOutcome  # noqa: E402
from node.swarm import SwarmOptimizer  # noqa: E402
from tests.netns import Node, Swarmnet, netns_available  # noqa: E402

# No parameter round inside a run: the wire carries gradient rounds only.
AVERAGE_STATE_EVERY = 1000
# A slow link's rounds may take this many times their floor before they time out.
ROUND_TIMEOUT_FLOORS = 3.0
# Rounds in a cell's window, per profile (--window-rounds overrides): fewer where a round
# of the full model takes minutes.
WINDOW_ROUNDS = {"loopback": 2, "1gbit": 2, "100mbit": 1, "20mbit": 1}
# Rounds before the window, per profile (--warmup-rounds overrides): none at 20 Mbit/s,
# where the first round's set-up is a few seconds in minutes.
WARMUP_ROUNDS = {"loopback": 1, "1gbit": 1, "100mbit": 1, "20mbit": 0}
# Cells not run by default (--measure-all runs them): extrapolated instead.
# LoRA's rounds are ~4 MB (rank-8 adapters, 3.7 MB in float32): the link barely shows at
# 1 Gbit/s, and at 20 Mbit/s its exact, fp16 and local-steps fp16 cells say what the
# others would.
SKIPPED = (
    {("20mbit", "full", "exact"), ("20mbit", "full", "local_steps")}
    | {("1gbit", "lora", mode) for mode in ("fp16", "uint8", "local_steps", "local_steps_fp16")}
    | {("20mbit", "lora", mode) for mode in ("uint8", "local_steps")}
)
# After its last step a trainer says "stopped" within this; it shuts its swarm down and
# exits, when told, within this again (else it is killed, with what it spawned).
STOP_GRACE_S = 60.0
# The wire's bytes per float32 byte of a round's tensors, by grad_compression.
WIRE_SHARE = {"none": 1.0, "fp16": 0.5, "uint8": 0.25, "quantile8": 0.25}
KINDS = ("full", "lora")


@dataclass(frozen=True)
class Mode:
    grad_compression: str
    local: bool  # local steps: H inner steps per round


MODES = {
    "exact": Mode("none", local=False),
    "fp16": Mode("fp16", local=False),
    "uint8": Mode("uint8", local=False),
    "quantile8": Mode("quantile8", local=False),
    "local_steps": Mode("none", local=True),
    "local_steps_fp16": Mode("fp16", local=True),
}
DEFAULT_MODES = ["exact", "fp16", "uint8", "local_steps", "local_steps_fp16"]


# ── child side ───────────────────────────────────────────────────────────────────


class TimedSwarm(SwarmOptimizer):
    """A SwarmOptimizer that writes a "round" line after each of its steps: how long it
    took, what became of it, and the trainer's counts so far."""

    out: TextIO | None = None

    def step_outcome(self, batch_size: int, lr: float | None = None) -> StepOutcome:
        began = time.monotonic()
        outcome = super().step_outcome(batch_size, lr)
        if self.out is not None:
            emit(
                self.out,
                "round",
                s=round(time.monotonic() - began, 3),
                epoch=outcome.epoch,
                applied=outcome.applied,
                discarded=outcome.discarded,
                peers=len(outcome.peer_batches),
                counts=self.counts(),
            )
            print(f"round: {time.monotonic() - began:.2f} s, {outcome}", file=sys.stderr)
        return outcome


class StepLimit(Commands):
    """The parent's lines, and "stop" once `steps` steps were taken (train_until_stopped
    reads once before each step): every trainer trains exactly the cell's steps."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.left = steps

    def read(self, timeout_s: float | None) -> list[str]:
        if self.left == 0:
            return ["stop"]
        self.left -= 1
        return super().read(timeout_s)


def trainer_child(s: dict[str, Any], out: TextIO) -> None:
    """Load the model ("loaded"); on "start {order}" make the swarm (its own DHT, joining
    the order's peers: "ready"); on "go" train the order's steps, say "stopped" with the
    swarm's counts, shut it down, and exit when the parent says so."""
    commands = Commands()
    torch.set_num_threads(s["threads"])
    torch.manual_seed(0)  # the same LoRA adapters on every trainer
    model, tokenizer = load_causal_lm(s["model_dir"])
    sizes = (s["groups_per_step"], s["group_size"], s["prompt_tokens"], s["completion_tokens"])
    groups = synthetic_groups(model, *sizes, seed=s["index"])
    if s["lora"]:
        model = add_adapters(model, LORA)
    params = [p for p in model.parameters() if p.requires_grad]
    emit(out, "loaded")
    line = ""
    while not line.startswith("start ") and not commands.closed:
        line = next((x for x in commands.read(None) if x), "")
    if not line.startswith("start "):
        return
    order = json.loads(line[len("start ") :])
    config = msgspec.convert(
        order["config"] | {"host_maddrs": [f"/ip4/{s['ip']}/tcp/0"]}, SwarmConfig
    )
    trainers = s["trainers"]
    swarm = TimedSwarm(
        config,
        params,
        lr=LR,
        weight_decay=0.0,
        target_batch_size=trainers * s["groups_per_step"] * s["group_size"],
        other_trainers=lambda: trainers - 1,  # what the trainer's directory would list
    )
    try:
        # as node/trainer.py makes it: LocalSteps around the swarm when local_steps > 1
        optimizer = with_local_steps(swarm, params, config, LR, 0.0, lock=swarm.step_lock)
        pad = int(tokenizer.pad_token_id or 0)
        learner = Learner(model, optimizer, TrainerConfig(), temperature=1.0, pad_token_id=pad)
        compression = swarm.optimizer.grad_averager.allreduce_kwargs.get("compression")
        emit(
            out,
            "ready",
            maddrs=visible_maddrs(swarm.dht),
            compression=type(compression).__name__,
            trainable_params=sum(p.numel() for p in params),
            trainable_bytes=sum(p.numel() * p.element_size() for p in params),
        )
        commands.wait_for("go")
        swarm.out = out
        train_until_stopped(learner, swarm, groups, StepLimit(order["steps"]), out)
        emit(out, "stopped", counts=swarm.counts())
    finally:
        shut_down(swarm)
    # Until the parent's next word (or its end): an exit it did not ask for would read as
    # a failure. (It waits for the exit a while, then kills what is left.)
    commands.read(None)
    # hivemind leaves a thread behind that holds the interpreter's exit for minutes (its
    # DHT process's pipe broken at shutdown); the swarm is down: leave at once. What it
    # spawned is reaped by PID (bench/swarm.py Children.close).
    out.flush()
    os._exit(0)


def shut_down(swarm: SwarmOptimizer) -> None:
    """hivemind's averager processes, then the DHT, each shut down in order; not through
    hivemind.Optimizer.shutdown, which first joins a gradient round already matched for
    the next step with zero weight: the whole model's bytes again after the window (on a
    slow link, minutes)."""
    for averager in (swarm.optimizer.grad_averager, swarm.optimizer.state_averager):
        if averager is not None and averager.is_alive():
            averager.shutdown()
    swarm.dht.shutdown()


def run_child(role: str, settings: dict[str, Any]) -> int:
    out = message_channel()
    # SIGTERM unwinds (hivemind shut down in order, in `finally`) instead of dying at once.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    assert role == "trainer", role
    trainer_child(settings, out)
    return 0


# ── parent side ──────────────────────────────────────────────────────────────────


def supported(compression: str) -> bool:
    """Whether SwarmConfig takes this grad_compression (uint8 came with issue 51)."""
    try:
        msgspec.convert({"grad_compression": compression}, SwarmConfig)
    except msgspec.ValidationError:
        return False
    return True


def averaging_timeout(
    trainable_bytes: int, compression: str, trainers: int, rate: float | None
) -> float:
    """The least a round may take: the default, or ROUND_TIMEOUT_FLOORS times the floor of
    what each trainer sends in a round (a butterfly all-reduce: 2 (n-1)/n of its tensors)."""
    default = SwarmConfig().averaging_timeout_s
    if rate is None:
        return default
    sent = trainable_bytes * WIRE_SHARE[compression] * 2 * (trainers - 1) / trainers
    return round(max(default, ROUND_TIMEOUT_FLOORS * sent * 8 / (rate * 1e6) + default), 1)


@dataclass
class Cell:
    """What one cell's trainers said, and the wire's counters at the window's ends."""

    warmup: int  # global steps before the window
    end: int  # the window's last global step
    marks: dict[int, tuple[float, list[int]]]  # global step -> (time, each trainer's tx)
    rounds: list[dict[str, Any]]  # "round" lines, with trainer and step
    steps: list[dict[str, Any]]  # "step" lines, with trainer and step
    stopped: dict[str, dict[str, int]]  # each trainer's counts at the end
    ready: dict[str, Any]  # trainer 0's "ready"


def run_cell(
    args: argparse.Namespace,
    hosts: list[Node],
    settings: dict[str, Any],
    cell_name: str,
    mode_name: str,
    rate: float | None,
    rounds: tuple[int, int],
    work: Path,
) -> dict[str, Any]:
    """One (profile, kind, mode): fresh trainer processes, the warm-up and the window (see
    the module docstring)."""
    mode = MODES[mode_name]
    h = args.local_steps if mode.local else 1
    warmup_rounds, window_rounds = rounds
    began = time.monotonic()
    with ExitStack() as stack:
        children = Children(work, __file__)
        stack.callback(children.close)
        trainers = [
            children.start(
                f"{cell_name}-t{i}", "trainer", settings | {"index": i, "ip": host.ip}, host.ns
            )
            for i, host in enumerate(hosts)
        ]
        gather(children, trainers, "loaded", STARTUP_TIMEOUT_S)
        timeout_s = averaging_timeout(
            settings["trainable_bytes"], mode.grad_compression, len(trainers), rate
        )
        config: dict[str, Any] = {
            "run_id": f"rounds-{cell_name}-{time.time_ns()}",
            "grad_compression": mode.grad_compression,
            "average_state_every": AVERAGE_STATE_EVERY,
            "averaging_timeout_s": timeout_s,
        }
        if mode.local:
            config["local_steps"] = h
        order: dict[str, Any] = {
            "config": config,
            "steps": (warmup_rounds + window_rounds) * h,
        }
        trainers[0].send(f"start {json.dumps(order)}")
        ready = children.expect(trainers[0], "ready", STARTUP_TIMEOUT_S)
        order["config"]["initial_peers"] = ready["maddrs"]
        for child in trainers[1:]:
            child.send(f"start {json.dumps(order)}")
        others = gather(children, trainers[1:], "ready", STARTUP_TIMEOUT_S)
        compressions = sorted({m["compression"] for m in [ready, *others.values()]})
        for child in trainers:
            child.send("go")
        # (the window starts here when there is no warm-up)
        go = (time.monotonic(), [host.tx_bytes() for host in hosts])
        cell = observe(children, trainers, hosts, h, (warmup_rounds, window_rounds), timeout_s, go)
        cell.ready = ready
    return summarize(cell, rate, rounds, h, len(trainers)) | {
        "compression": compressions,
        "averaging_timeout_s": timeout_s,
        "cell_s": round(time.monotonic() - began, 1),
    }


def observe(
    children: Children,
    trainers: list[Child],
    hosts: list[Node],
    h: int,
    rounds: tuple[int, int],
    timeout_s: float,
    go: tuple[float, list[int]],
) -> Cell:
    """Every message until each trainer trained the window's last global step (each stops
    there: StepLimit) and said "stopped" with its counts; the tx counters as the last
    trainer reports the warm-up's and the window's last step (`go`'s without a warm-up)."""
    warmup, end = rounds[0] * h, (rounds[0] + rounds[1]) * h
    cell = Cell(warmup, end, {0: go}, [], [], {}, {})
    steps = {child.name: 0 for child in trainers}
    for child, message in children.messages(STEP_TIMEOUT_S + 2 * timeout_s):
        if message["event"] == "round":
            cell.rounds.append(message | {"trainer": child.name, "step": steps[child.name] + 1})
        elif message["event"] == "step":
            steps[child.name] += 1
            cell.steps.append(message | {"trainer": child.name, "step": steps[child.name]})
            done = min(steps.values())
            if done in (warmup, end) and done not in cell.marks:
                cell.marks[done] = (time.monotonic(), [host.tx_bytes() for host in hosts])
        elif message["event"] == "stopped":  # (one can stop before another's last step)
            cell.stopped[child.name] = message["counts"]
        if min(steps.values()) >= end and len(cell.stopped) == len(trainers):
            break
    # each shuts its swarm down, then exits; one that takes longer is killed (its round
    # counts are in already)
    children.stop(STOP_GRACE_S)
    return cell


def summarize(
    cell: Cell, rate: float | None, rounds: tuple[int, int], h: int, trainers: int
) -> dict[str, Any]:
    warmup_rounds, window_rounds = rounds
    warmup, end = cell.warmup, cell.end
    (t0, tx0), (t1, tx1) = cell.marks[warmup], cell.marks[end]
    in_window = [r for r in cell.rounds if warmup < r["step"] <= end]
    before = [r for r in cell.rounds if r["step"] <= warmup]
    window_steps = end - warmup
    sent = [b - a for a, b in zip(tx0, tx1, strict=True)]
    per_round = sum(sent) / len(sent) / window_rounds
    round_s = [r["s"] for r in in_window]
    floor = per_round * 8 / (rate * 1e6) if rate else None
    round_of = {(r["trainer"], r["step"]): r["s"] for r in cell.rounds}
    window = [s for s in cell.steps if warmup < s["step"] <= end]
    compute = [s["step_s"] - round_of.get((s["trainer"], s["step"]), 0.0) for s in window]
    median = statistics.median(round_s) if round_s else None
    return {
        "measured": True,
        "trainers": trainers,
        "local_steps": h,
        "warmup_rounds": warmup_rounds,
        "window_rounds": window_rounds,
        "global_steps": window_steps,
        "rounds": len(in_window),
        "bytes_per_step": round(sum(sent) / len(sent) / window_steps),
        "bytes_per_round": round(per_round),
        "tx_bytes": sent,
        "trainable_bytes": cell.ready["trainable_bytes"],
        "round_s": round(median, 3) if median is not None else None,
        "round_s_max": max(round_s) if round_s else None,
        "round_s_all": round_s,
        "floor_s": round(floor, 3) if floor else None,
        "over_floor": round(median / floor, 2) if floor and median else None,
        "global_step_s": round((t1 - t0) / window_steps, 3),
        "compute_s": round(statistics.median(compute), 3) if compute else None,
        "failed": counts_delta(before, in_window),
        "counts": {k: sum(c.get(k, 0) for c in cell.stopped.values()) for k in _keys(cell.stopped)},
        "discarded_samples": sum(s["discarded_samples"] for s in window),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def gather(
    children: Children, trainers: list[Child], event: str, timeout_s: float
) -> dict[str, dict[str, Any]]:
    """Each trainer's `event` message, by name, once all sent theirs."""
    got: dict[str, dict[str, Any]] = {}
    for child, message in children.messages(timeout_s):
        if message["event"] == event and child in trainers:
            got[child.name] = message
        if len(got) == len(trainers):
            return got
    raise AssertionError("unreachable")


def _keys(counts: dict[str, dict[str, int]]) -> list[str]:
    return sorted({k for c in counts.values() for k in c})


def counts_delta(before: list[dict[str, Any]], window: list[dict[str, Any]]) -> dict[str, int]:
    """What the window's rounds added to SwarmOptimizer.counts(), summed over trainers."""
    out: dict[str, int] = {}
    for trainer in {r["trainer"] for r in window}:
        last = [r["counts"] for r in window if r["trainer"] == trainer][-1]
        earlier = [r["counts"] for r in before if r["trainer"] == trainer]
        first = earlier[-1] if earlier else {}
        for key, value in last.items():
            out[key] = out.get(key, 0) + value - first.get(key, 0)
    return out


def trainable_bytes(model_dir: Path, lora: bool) -> int:
    """The float32 bytes a trainer of this kind trains (sizes the slow links' timeouts)."""
    model, _ = load_causal_lm(str(model_dir))
    if lora:
        model = add_adapters(model, LORA)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def run_all(
    args: argparse.Namespace, model_dir: Path, work: Path, save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Every selected cell, into cells[profile][kind][mode], `save`d after each: one
    Swarmnet per profile, its trainers' links limited to the profile's rate."""
    cells: dict[str, Any] = {}
    base = {
        "model_dir": str(model_dir),
        "trainers": args.trainers,
        "groups_per_step": args.groups_per_step,
        "group_size": args.group_size,
        "prompt_tokens": args.prompt_tokens,
        "completion_tokens": args.completion_tokens,
        "threads": args.threads,
    }
    sizes = {kind: trainable_bytes(model_dir, kind == "lora") for kind in args.kinds}
    for profile in args.profiles:
        rate = PROFILES[profile]
        rounds = (
            WARMUP_ROUNDS[profile] if args.warmup_rounds is None else args.warmup_rounds,
            args.window_rounds or WINDOW_ROUNDS[profile],
        )
        with Swarmnet() as net:
            hosts = [net.add_node(f"t{i}") for i in range(args.trainers)]
            if rate is not None:
                for host in hosts:
                    host.limit(rate)
            for kind in args.kinds:
                settings = base | {"lora": kind == "lora", "trainable_bytes": sizes[kind]}
                # other than 2 trainers: a kind of its own ("full_3trainers"), out of the
                # per-byte lines and extrapolations
                label_kind = kind if args.trainers == 2 else f"{kind}_{args.trainers}trainers"
                for mode in args.modes:
                    if (profile, kind, mode) in SKIPPED and not args.measure_all:
                        continue
                    label = f"{profile} {label_kind} {mode}"
                    name = f"{profile}-{label_kind}-{mode}"
                    try:
                        cell = run_cell(args, hosts, settings, name, mode, rate, rounds, work)
                    except BenchError as e:
                        print(f"{label}: FAILED: {str(e)[:3000]}", flush=True)
                        cell = {"measured": True, "error": str(e).splitlines()[0][:300]}
                    cells.setdefault(profile, {}).setdefault(label_kind, {})[mode] = cell
                    print(f"{label}: {row(cell)}", flush=True)
                    save(cells)
    return cells


# ── derived numbers ──────────────────────────────────────────────────────────────


def per_byte(cells: dict[str, Any]) -> dict[str, Any]:
    """Per profile: round_s = fixed_s + s_per_mb x MB each trainer sent in the round, a
    least-squares line through the measured cells of 2 trainers whose window's rounds all
    succeeded (a failed round's time is its timeout's, its bytes a part of the round's)."""
    out: dict[str, Any] = {}
    for profile, kinds in cells.items():
        fitted = [
            (f"{kind} {mode}", c)
            for kind, modes in kinds.items()
            if kind in KINDS
            for mode, c in modes.items()
            if c.get("measured") and c.get("round_s") is not None
        ]
        left_out = [name for name, c in fitted if failed(c)]
        points = [(c["bytes_per_round"] / 1e6, c["round_s"]) for _, c in fitted if not failed(c)]
        if not points:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if len(points) > 1 and sxx > 0:
            slope = sum((x - mx) * (y - my) for x, y in points) / sxx
            fixed = my - slope * mx
        else:
            slope, fixed = my / mx, 0.0
        rate = PROFILES.get(profile)
        out[profile] = {
            "s_per_mb": round(slope, 5),
            "fixed_s": round(fixed, 2),
            "effective_mbit_s": round(8 / slope, 1) if slope > 0 else None,
            "link_mbit_s": rate,
            "floor_s_per_mb": round(8 / rate, 5) if rate else None,
            "n_cells": len(points),
            "left_out_failed": left_out,
            "points_mb_s": [[round(x, 2), y] for x, y in points],
        }
    return out


def failed(cell: dict[str, Any]) -> bool:
    """Whether a round of the cell's window failed or was incomplete on some trainer."""
    counts = cell.get("failed", {})
    return bool(counts.get("failed_rounds") or counts.get("incomplete_rounds"))


def extrapolate(cells: dict[str, Any], fits: dict[str, Any]) -> None:
    """Fill the skipped cells (SKIPPED) not measured: bytes from the same kind and mode
    on the nearest other link, round time from this profile's fit."""
    order = ["100mbit", "1gbit", "loopback", "20mbit"]
    for profile, kind, mode in sorted(SKIPPED):
        if profile not in fits:
            continue
        have = cells.get(profile, {}).get(kind, {}).get(mode)
        if have is not None and have.get("measured"):
            continue
        sources = [
            p
            for p in order
            if p != profile and cells.get(p, {}).get(kind, {}).get(mode, {}).get("round_s")
        ]
        if not sources:
            continue
        source = cells[sources[0]][kind][mode]
        fit, rate = fits[profile], PROFILES[profile]
        assert rate is not None
        mb = source["bytes_per_round"] / 1e6
        round_s = fit["fixed_s"] + fit["s_per_mb"] * mb
        floor = mb * 8 / rate
        h = source["local_steps"]
        cells.setdefault(profile, {}).setdefault(kind, {})[mode] = {
            "measured": False,
            "extrapolated_from": f"bytes: {sources[0]}'s cell; round_s: {profile}'s per-byte "
            "line (fixed_s + s_per_mb x MB); global_step_s: the source's compute + that round",
            "local_steps": h,
            "bytes_per_step": source["bytes_per_step"],
            "bytes_per_round": source["bytes_per_round"],
            "trainable_bytes": source["trainable_bytes"],
            "round_s": round(round_s, 1),
            "floor_s": round(floor, 3),
            "over_floor": round(round_s / floor, 2),
            "global_step_s": round(source["global_step_s"] + (round_s - source["round_s"]) / h, 1),
        }


def shares(cells: dict[str, Any]) -> None:
    """share_of_exact: bytes per global step / the exact mode's (same profile and kind, else
    the kind's exact cell on another link: bytes do not depend on the link)."""
    exact: dict[str, int] = {}
    for kinds in cells.values():
        for kind, modes in kinds.items():
            if modes.get("exact", {}).get("bytes_per_step"):
                exact.setdefault(kind, modes["exact"]["bytes_per_step"])
    for kinds in cells.values():
        for kind, modes in kinds.items():
            here = modes.get("exact", {}).get("bytes_per_step") or exact.get(kind)
            for cell in modes.values():
                if cell.get("bytes_per_step") and here:
                    cell["share_of_exact"] = round(cell["bytes_per_step"] / here, 4)
                if cell.get("bytes_per_step"):
                    cell["share_of_params"] = round(
                        cell["bytes_per_step"] / cell["trainable_bytes"], 4
                    )


def row(cell: dict[str, Any]) -> str:
    if "error" in cell:
        return f"error: {cell['error']}"

    def num(key: str, fmt: str) -> str:
        value = cell.get(key)
        return "-" if value is None else format(value, fmt)

    failed = cell.get("failed", {})
    bad = {k: v for k, v in failed.items() if v and k in ("failed_rounds", "incomplete_rounds")}
    return (
        f"{cell['bytes_per_step'] / 1e6:9.2f} MB/step  share {num('share_of_exact', '.3f')}  "
        f"round {num('round_s', '.2f')} s (floor {num('floor_s', '.2f')}, "
        f"{num('over_floor', '.2f')}x)  step {num('global_step_s', '.2f')} s  "
        f"compute {num('compute_s', '.2f')} s  cell {num('cell_s', '.0f')} s  "
        + ("EXTRAPOLATED" if not cell.get("measured") else f"failed {bad or 0}")
    )


def print_table(rounds: dict[str, Any]) -> None:
    print("\nprofile  kind mode              per trainer per global step, round vs floor")
    for profile, kinds in rounds["cells"].items():
        for kind, modes in kinds.items():
            for mode, cell in modes.items():
                print(f"{profile:8} {kind:4} {mode:17} {row(cell)}")
    print("\nper byte (round_s = fixed_s + s_per_mb x MB sent per trainer):")
    for profile, fit in rounds["per_byte"].items():
        print(
            f"  {profile:8} {fit['s_per_mb']:.4f} s/MB (~{fit['effective_mbit_s']} Mbit/s), "
            f"fixed {fit['fixed_s']:.2f} s, {fit['n_cells']} cells"
        )


def write(out: Path, cells: dict[str, Any], args: argparse.Namespace, wall_s: float) -> dict:
    """Merge this run's cells into out's "rounds" (other keys and earlier cells kept)."""
    data = json.loads(out.read_text()) if out.exists() else {}
    rounds = data.get("rounds", {})
    merged: dict[str, Any] = rounds.get("cells", {})
    for profile, kinds in cells.items():
        for kind, modes in kinds.items():
            merged.setdefault(profile, {}).setdefault(kind, {}).update(modes)
    rounds = finish(merged, args, wall_s)
    data["rounds"] = rounds
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return rounds


def finish(cells: dict[str, Any], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    for kinds in cells.values():  # extrapolations are redone from the cells measured
        for modes in kinds.values():
            for mode in [m for m, c in modes.items() if not c.get("measured")]:
                del modes[mode]
    fits = per_byte(cells)
    extrapolate(cells, fits)
    shares(cells)
    ordered = {p: cells[p] for p in PROFILES if p in cells}
    return {
        "cells": ordered,
        "per_byte": fits,
        "settings": {
            "trainers": args.trainers,
            "groups_per_step": args.groups_per_step,
            "group_size": args.group_size,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "local_steps": args.local_steps,
            "average_state_every": AVERAGE_STATE_EVERY,
            "bytes": "tx bytes of each trainer's veth (IP/TCP headers, DHT and matchmaking "
            "included) / global steps / trainers",
            "round_s": "SwarmOptimizer.step_outcome calls that did a round, median",
            "machine": machine_notes(),
            "wall_s": round(wall_s),
        },
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--local-steps", type=int, default=4, help="H of the local_steps modes")
    parser.add_argument(
        "--warmup-rounds", type=int, default=None, help=f"default per profile, {WARMUP_ROUNDS}"
    )
    parser.add_argument(
        "--window-rounds", type=int, default=0, help=f"0: per profile, {WINDOW_ROUNDS}"
    )
    parser.add_argument("--measure-all", action="store_true", help=f"run {sorted(SKIPPED)} too")
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trainer")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: loopback and 100mbit, exact and fp16, 2 global steps",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/links.json")
    parser.add_argument("--child", default="")
    parser.add_argument("--settings", default="{}")
    args = parser.parse_args()
    if args.quick:
        args.profiles, args.modes, args.window_rounds = (
            ["loopback", "100mbit"],
            ["exact", "fp16"],
            2,
        )
    elif args.out is None:
        args.out = ROOT / "bench" / "results" / "links.json"
    return args


def main() -> int:
    args = parse_args()
    if args.child:
        return run_child(args.child, json.loads(args.settings))
    # SIGTERM unwinds as Ctrl-C does: children stopped and reaped, namespaces deleted.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    reason = netns_available()
    if reason is not None:
        print(f"bench-links-rounds needs network namespaces: {reason}", file=sys.stderr)
        return 2
    for mode in list(args.modes):
        if not supported(MODES[mode].grad_compression):
            print(f"{mode}: SwarmConfig has no grad_compression {MODES[mode].grad_compression!r}")
            args.modes.remove(mode)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-links-rounds-"))
    out = args.out

    def save(cells: dict[str, Any]) -> None:  # after every cell: a run cut short keeps them
        if out is not None:
            write(out, cells, args, time.monotonic() - started)

    try:
        _, model_dir = prepare_model("embedded", work)
        cells = run_all(args, model_dir, work, save)
    except BaseException:
        print(f"children's logs kept in {work}", file=sys.stderr)
        raise
    wall_s = time.monotonic() - started
    if out is not None:
        rounds = write(out, cells, args, wall_s)
        print(f'wrote {out} (key "rounds")')
    else:
        rounds = finish(cells, args, wall_s)
    print_table(rounds)
    print(f"wall {wall_s:.0f} s")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
