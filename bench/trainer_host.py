"""`just bench-trainer-host`: what a trainer costs per policy it serves (issue 26) when one
process serves several policies (node/trainer_host.py: one DHT, one copy of the base
weights under every policy's adapters) against a process per policy.

    for n in --counts (1, 2, 4 policies; LoRA rank 16 on q/k/v/o_proj, SmolLM2-135M):
      one      `agentjet node --role trainer` serving the n policies
      each     n `agentjet node --role trainer --policy NAME` processes (n > 1)
    every arm: started alone (no peers, no rollout node), measured from the moment every
    policy's trainer logged "ready" for --settle-s seconds: the peak, over 0.5 s samples,
    of the PSS of the trainer processes and all their children (hivemind's DHT daemon and
    averagers; pages shared between processes count once) ──▶ "trainer_pss_mb":
    {"one": {"1", "2", "4"}, "each": {"2", "4"}} and "each_vs_one" per count

This is a trainer's standing cost (weights, optimizer, DHT, runtime), not a training step's
transient activations, which are the same per step either way. Results are merged into
bench/results/policies.json (--out) under "trainer_host".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learn import memory_mb  # noqa: E402

from agentjet.lifeline import descendants  # noqa: E402
from agentjet.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AGENTJET = [sys.executable, "-m", "agentjet_app.cli"]
READY_TIMEOUT_S = 600.0


def policy_settings(count: int) -> list[str]:
    """`count` LoRA policies over configs/local.toml's one environment."""
    settings = ["net.insecure=true", "trainer.torch_threads=1"]
    for i in range(count):
        settings += [f'policies.{i}.name="p{i}"', f"policies.{i}.lora_rank=16"]
    return [a for s in settings for a in ("--set", s)]


def measure(commands: list[list[str]], policies: int, settle_s: float, work: Path) -> float:
    """Start `commands` (trainer processes serving `policies` in all), wait until every
    policy's trainer is ready, and return the peak PSS (MB) of their process trees."""
    procs = []
    logs = []
    try:
        for i, argv in enumerate(commands):
            log = open(work / f"trainer-{i}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
                )
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            text = "".join((work / f"trainer-{i}.log").read_text() for i in range(len(procs)))
            if text.count(" ready: ") >= policies:
                break
            dead = [p for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"trainers did not start:\n{text[-3000:]}")
            time.sleep(0.5)
        peak = 0.0
        until = time.monotonic() + settle_s
        while time.monotonic() < until:
            pids = {p.pid for p in procs}
            for p in procs:
                pids |= descendants(p.pid)
            peak = max(peak, memory_mb(pids))
            time.sleep(0.5)
        return peak
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()


def trainer(run_dir: Path, count: int, policy: str | None = None) -> list[str]:
    argv = [*AGENTJET, "node", "--role", "trainer", "--run-dir", str(run_dir)]
    argv += policy_settings(count)
    argv += ["--set", f'net.trainer_endpoint="tcp://127.0.0.1:{free_port()}"']
    return argv + (["--policy", policy] if policy else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--settle-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "policies.json")
    args = parser.parse_args()
    result: dict = {"date": time.strftime("%Y-%m-%d"), "settle_s": args.settle_s}
    one: dict[str, int] = {}
    each: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-host-") as tmp:
        for count in args.counts:
            work = Path(tmp) / f"one-{count}"
            work.mkdir()
            one[str(count)] = round(
                measure([trainer(work / "run", count)], count, args.settle_s, work)
            )
            print(f"one process, {count} policies: {one[str(count)]} MB", flush=True)
            if count == 1:
                continue
            work = Path(tmp) / f"each-{count}"
            work.mkdir()
            commands = [trainer(work / f"run-{i}", count, f"p{i}") for i in range(count)]
            each[str(count)] = round(measure(commands, count, args.settle_s, work))
            print(f"a process per policy, {count} policies: {each[str(count)]} MB", flush=True)
    result["trainer_pss_mb"] = {"one": one, "each": each}
    result["each_vs_one"] = {k: round(v / one[k], 3) for k, v in each.items()}
    merged = json.loads(args.out.read_text()) if args.out.exists() else {}
    merged["trainer_host"] = result
    args.out.write_text(json.dumps(merged, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
