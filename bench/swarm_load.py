"""Swarm-under-load benchmark: the swarm commands of docs/swarm.md on one box whose other core a
busy loop takes for the whole run, with two trainers and with one.

    keys init, keys issue per node ──▶ coordinator ──▶ trainer(s) ──▶ rollout node
    (built-in defaults: no --config; the embedded SmolLM2-135M), plus a CPU hog
    (`python -c "while True: pass"`), each a process of its own session, reaped by PID.

Per arm ("two_trainers", "lone_trainer"), for --minutes after the first policy version:
    versions_per_min   the newest version any trainer reached, per minute of that window
    rounds_ok          steps that applied a gradient round (from metrics/trainer.jsonl)
    rounds_failed      the trainers' `counts/swarm_failed_rounds` at their last step
    peak_pss_mb        per node: its main process, and its whole process tree (hivemind's
                       DHT and averagers; /proc/<pid>/smaps_rollup, read every PSS_EVERY_S)
    stop_s             per node: SIGINT to exit
Writes bench/results/swarm_load.json. Run: `just bench-swarm-load` (about 25 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agentjet.lifeline import descendants, process_table  # noqa: E402
from agentjet.metrics import read_metrics  # noqa: E402
from agentjet.ports import free_port  # noqa: E402

# How long a node may take to print what the bench waits for (a model load on a busy box).
START_TIMEOUT_S = 600.0
# A node given SIGINT must be gone within this long, else its group is SIGKILLed.
STOP_TIMEOUT_S = 90.0
PSS_EVERY_S = 5.0
STATUS_TIMEOUT_S = 120.0
POLL_S = 1.0


def pss_mb(pid: int) -> float:
    """`pid`'s proportional set size in MB (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0.0
    found = re.search(r"^Pss:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else 0.0


class Arm:
    """One run: its processes (name ─▶ Popen), all in `root`, reaped by PID at the end."""

    def __init__(self, root: Path, agentjet: list[str]) -> None:
        self.root = root
        self.agentjet = agentjet
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def run(self, *args: str) -> None:
        subprocess.run([*self.agentjet, *args], cwd=self.root, check=True, capture_output=True)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (
            open(self.root / f"{name}.out", "wb") as out,
            open(self.root / f"{name}.log", "wb") as err,
        ):
            proc = subprocess.Popen(
                argv, cwd=self.root, stdout=out, stderr=err, start_new_session=True
            )
        self.procs[name] = proc
        return proc

    def wait_for(self, name: str, pattern: str, where: str = "out") -> re.Match[str]:
        deadline = time.monotonic() + START_TIMEOUT_S
        path = self.root / f"{name}.{where}"
        while time.monotonic() < deadline:
            found = re.search(pattern, path.read_text(errors="replace"))
            if found:
                return found
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited: {path.read_text()[-2000:]}")
            time.sleep(POLL_S)
        raise TimeoutError(f"{name} printed no {pattern!r} within {START_TIMEOUT_S:.0f} s")

    def status(self, join: str) -> str:
        """What `agentjet status --join` prints now (or why it printed nothing)."""
        argv = [*self.agentjet, "status", "--keys", "swarm.keys", "--join", join]
        try:
            done = subprocess.run(
                argv, cwd=self.root, capture_output=True, text=True, timeout=STATUS_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return f"(no answer within {STATUS_TIMEOUT_S:.0f} s)"
        return done.stdout + done.stderr[-500:]

    def stop(self, name: str) -> float:
        """SIGINT, then seconds until it exited (its group SIGKILLed past the bound)."""
        proc = self.procs[name]
        if proc.poll() is not None:
            return 0.0
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return time.monotonic() - began

    def reap(self) -> None:
        """SIGKILL every process still running, with what it started (by PID)."""
        table = process_table()
        for proc in self.procs.values():
            for pid in descendants(proc.pid, table):
                with suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def trainer_steps(root: Path, name: str) -> list[dict[str, Any]]:
    path = root / "runs" / name / "metrics" / "trainer.jsonl"
    rows = read_metrics(path) if path.exists() else []
    return [r for r in rows if r.get("event") == "step"]


def run_arm(trainers: int, minutes: float, extra: list[str], hog: bool = True) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="agentjet-swarm-load-"))
    arm = Arm(root, [sys.executable, "-m", "agentjet_app.cli"])
    names = [f"trainer-{chr(ord('a') + i)}" for i in range(trainers)]
    try:
        arm.run("keys", "init", "--out", "swarm.keys")
        for name in [*names, "rollout-1"]:
            arm.run("keys", "issue", "--node", name, "--keys", "swarm.keys")
        if hog:
            arm.start("hog", [sys.executable, "-c", "while True: pass"])
        port = free_port(span=2)
        arm.start(
            "coordinator",
            [
                *arm.agentjet,
                "coordinator",
                "--keys",
                "swarm.keys",
                "--listen",
                f"127.0.0.1:{port}",
                "--run-dir",
                "runs/coordinator",
                *extra,
            ],
        )
        join = arm.wait_for("coordinator", r"--join (\S+)").group(1)
        for name in names:
            arm.start(
                name,
                [
                    *arm.agentjet,
                    "node",
                    "--role",
                    "trainer",
                    "--keys",
                    f"{name}.keys",
                    "--join",
                    join,
                    "--listen",
                    f"127.0.0.1:{free_port(span=2)}",
                    "--run-dir",
                    f"runs/{name}",
                    *extra,
                ],
            )
        arm.start(
            "rollout-1",
            [
                *arm.agentjet,
                "node",
                "--role",
                "rollout",
                "--keys",
                "rollout-1.keys",
                "--join",
                join,
                "--run-dir",
                "runs/rollout-1",
                *extra,
            ],
        )
        nodes = [*names, "rollout-1", "coordinator"]
        peak_main = dict.fromkeys(nodes, 0.0)
        peak_tree = dict.fromkeys(nodes, 0.0)
        began: float | None = None
        status = ""  # `agentjet status --join`, as a user would ask, halfway through
        versions: list[tuple[float, int]] = []
        started = time.monotonic()
        next_pss = 0.0
        while began is None or time.monotonic() - began < minutes * 60:
            now = time.monotonic()
            if now >= next_pss:
                table = process_table()
                for name in nodes:
                    pid = arm.procs[name].pid
                    main = pss_mb(pid)
                    tree = main + sum(pss_mb(p) for p in descendants(pid, table))
                    peak_main[name] = max(peak_main[name], main)
                    peak_tree[name] = max(peak_tree[name], tree)
                next_pss = now + PSS_EVERY_S
            newest = max(
                (r["policy_version"] for n in names for r in trainer_steps(root, n)), default=0
            )
            if began is None and newest >= 1:
                began = now
                print(f"  first version after {now - started:.0f} s", flush=True)
            if began is not None and (not versions or versions[-1][1] != newest):
                versions.append((now - began, newest))
                print(f"  [{now - began:6.0f} s] v{newest}", flush=True)
            if began is not None and not status and now - began >= minutes * 30:
                status = arm.status(join)
            for name, proc in arm.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited early ({proc.returncode}); see {root}")
            if began is None and now - started > START_TIMEOUT_S:
                raise TimeoutError(f"no policy version within {START_TIMEOUT_S:.0f} s; see {root}")
            time.sleep(POLL_S)
        stop_s = {name: arm.stop(name) for name in [*names, "rollout-1", "coordinator"]}
        newest = versions[-1][1] if versions else 0
        steps = {n: trainer_steps(root, n) for n in names}
        failed = sum(
            int(rows[-1].get("counts/swarm_failed_rounds", 0)) for rows in steps.values() if rows
        )
        result = {
            "trainers": trainers,
            "hog": hog,
            "minutes": minutes,
            "versions": newest,
            "versions_per_min": (newest - 1) / minutes,
            "rounds_ok": sum(bool(r["optimizer_stepped"]) for rows in steps.values() for r in rows),
            "rounds_failed": failed,
            "steps_discarded": sum(
                bool(r["optimizer_discarded"]) for rows in steps.values() for r in rows
            ),
            "peak_pss_mb": {n: round(peak_main[n]) for n in nodes},
            "peak_tree_pss_mb": {n: round(peak_tree[n]) for n in nodes},
            "stop_s": {k: round(v, 1) for k, v in stop_s.items()},
            "version_times_s": [[round(t, 1), v] for t, v in versions],
            "status_halfway": status,
        }
    finally:
        arm.reap()
    # Kept only when the arm failed (its errors name it): a run's checkpoints are GBs.
    shutil.rmtree(root)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--arms", default="two_trainers,lone_trainer")
    parser.add_argument("--set", action="append", default=[], help="passed to every node")
    parser.add_argument(
        "--no-hog", action="store_true", help="an idle box: no CPU hog (stop times, baselines)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/swarm_load.json")
    args = parser.parse_args()
    extra = [a for s in args.set for a in ("--set", s)]
    results: dict[str, Any] = {}
    for arm in args.arms.split(","):
        trainers = {"two_trainers": 2, "lone_trainer": 1}[arm]
        hog = "" if args.no_hog else ", a CPU hog"
        print(f"{arm}: {trainers} trainer(s), a rollout node, a coordinator{hog}", flush=True)
        results[arm] = run_arm(trainers, args.minutes, extra, hog=not args.no_hog)
        print(json.dumps(results[arm], indent=1), flush=True)
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": args.set,
        "hog": not args.no_hog,
        "arms": results,
    }
    if "two_trainers" in results:
        two = results["two_trainers"]
        out["rounds_ok"] = two["rounds_ok"]
        out["rounds_failed"] = two["rounds_failed"]
        out["peak_pss_mb"] = {n: mb for n, mb in two["peak_pss_mb"].items() if "trainer" in n}
    out["versions_per_min"] = {arm: r["versions_per_min"] for arm, r in results.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
