"""What watching a run costs: seconds per policy version with the dashboard open, and not.

    for each arm, in the order closed, ARM, ARM, closed, ... (--pairs pairs, ABBA):
        agentjet local --config configs/local.toml   for --seconds, then Ctrl-C
          closed: dashboard.enabled = false
          open:   (--arm open) the dashboard `agentjet local` starts, with Debian's Chromium
                  (headless, driven by Playwright) holding its page open: the page polls
                  /api every 2.5 s, as a user's tab does; the viewer tab is opened once a
                  minute
          api:    (--arm api) the dashboard, polled every 2.5 s by this script with the
                  page's requests (roles, each role's new metrics rows, nodes, trajectories)
                  and nothing rendered: the server's cost alone, as when the browser runs
                  on another machine
        ──▶ the trainer's metrics: seconds per version from v1 to the last version
            (the first version's time includes start-up, the same in both arms)
        ──▶ CPU seconds of the dashboard server and of the browser (their processes' own
            and their children's user + system time), against the run's wall time
    ──▶ bench/results/dashboard_cost[_api].json: every run, the mean of each arm, and the
        mean paired difference (ARM - closed) of s/version with its standard error

The browser runs on the same 2-core box as the roles, so "open" charges the run with the
browser's own work too: the dearest case (a user's browser on another machine costs the
run only the server's share).

Run: `just bench-dashboard` (or `.venv/bin/python bench/dashboard_cost.py --pairs 2`),
machine otherwise idle; `./just browser` first if /usr/bin/chromium is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjet.metrics import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CHROMIUM = Path("/usr/bin/chromium")
# How long `agentjet local` may take to print its dashboard's URL.
URL_TIMEOUT_S = 120.0
# A stopping run gets this long before it is killed (its stop takes a few seconds).
STOP_TIMEOUT_S = 90.0
# The page's viewer tab is opened this often (it reads trajectories.jsonl when opened).
VIEWER_EVERY_S = 60.0
POLL_S = 1.0
# The page polls /api this often (agentjet_app/dashboard/static/app.js POLL_MS).
PAGE_POLL_S = 2.5


def s_per_version(trainer_rows: list[dict[str, Any]]) -> tuple[float | None, int]:
    """(seconds per version from v1 to the last, versions made) of a trainer's step rows."""
    first_at: dict[int, float] = {}
    for row in trainer_rows:
        version = row.get("policy_version")
        if row.get("event") == "step" and isinstance(version, int) and version >= 1:
            first_at.setdefault(version, float(row["time"]))
    if len(first_at) < 2:
        return None, len(first_at)
    low, high = min(first_at), max(first_at)
    return (first_at[high] - first_at[low]) / (high - low), high


def cpu_s(process: psutil.Process) -> float:
    """User + system CPU seconds of `process` and its live children so far."""
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def dashboard_process(local: psutil.Process) -> psutil.Process | None:
    """The `agentjet dashboard` child of this run's launcher."""
    for child in local.children():
        with contextlib.suppress(psutil.Error):
            if "dashboard" in child.cmdline():
                return child
    return None


def run_arm(arm: str, seconds: float, run_dir: Path) -> dict[str, Any]:
    argv = [str(REPO / ".venv" / "bin" / "agentjet"), "local", "--config", "configs/local.toml"]
    enabled = str(arm != "closed").lower()
    argv += ["--run-dir", str(run_dir), "--set", f"dashboard.enabled={enabled}"]
    out_path = run_dir.with_suffix(".out")
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    launcher = psutil.Process(proc.pid)
    started = time.monotonic()
    server_cpu = browser_cpu = 0.0
    try:
        if arm != "closed":
            deadline = started + URL_TIMEOUT_S
            url = None
            while url is None and time.monotonic() < deadline:
                found = re.search(r"dashboard: (http://\S+)", out_path.read_text(errors="replace"))
                url = found.group(1) if found else None
                time.sleep(POLL_S)
            if url is None:
                raise RuntimeError(f"no dashboard URL in {out_path}")
            if arm == "open":
                server_cpu, browser_cpu = watch_in_browser(url, launcher, started + seconds)
            else:
                server_cpu = watch_by_api(url, launcher, started + seconds)
        else:
            while time.monotonic() < started + seconds:
                time.sleep(POLL_S)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall_s = time.monotonic() - started
    per_version, versions = s_per_version(read_metrics(run_dir / "metrics" / "trainer.jsonl"))
    return {
        "arm": arm,
        "run_dir": str(run_dir),
        "wall_s": round(wall_s, 1),
        "versions": versions,
        "s_per_version": per_version,
        "dashboard_server_cpu_s": round(server_cpu, 2),
        "browser_cpu_s": round(browser_cpu, 2),
    }


def watch_in_browser(url: str, launcher: psutil.Process, until: float) -> tuple[float, float]:
    """Hold the dashboard open in Chromium until `until`; (server, browser) CPU seconds."""
    from playwright.sync_api import sync_playwright

    server = dashboard_process(launcher)
    server_start = cpu_s(server) if server else 0.0
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(url)
            next_viewer = time.monotonic() + VIEWER_EVERY_S
            while time.monotonic() < until:
                if time.monotonic() >= next_viewer:
                    # the viewer tab, then back to the curves
                    with contextlib.suppress(Exception):
                        page.click("button[data-tab=trajectories]", timeout=2000)
                        page.wait_for_timeout(3000)
                        page.click("button[data-tab=curves]", timeout=2000)
                    next_viewer += VIEWER_EVERY_S
                page.wait_for_timeout(int(POLL_S * 1000))
            # Chromium's processes and Playwright's driver: this script's new children
            started_here = [p for p in me.children() if p.pid not in before]
            browser_total = sum(cpu_s(p) for p in started_here)
        finally:
            browser.close()
    server_total = (cpu_s(server) - server_start) if server else 0.0
    return server_total, browser_total


def watch_by_api(url: str, launcher: psutil.Process, until: float) -> float:
    """Poll the dashboard as its page does until `until`; the server's CPU seconds."""
    server = dashboard_process(launcher)
    server_start = cpu_s(server) if server else 0.0
    base = url.split("?")[0].rstrip("/")
    offsets: dict[str, int] = {}

    def get(path: str) -> Any:
        with urllib.request.urlopen(base + path, timeout=10) as reply:
            return json.loads(reply.read())

    while time.monotonic() < until:
        with contextlib.suppress(OSError, ValueError):
            for role in [r["role"] for r in get("/api/roles")["roles"]]:
                while True:
                    body = get(f"/api/metrics?role={role}&offset={offsets.get(role, 0)}")
                    offsets[role] = body["next_offset"]
                    if not body["more"]:
                        break
            get("/api/nodes")
            get("/api/trajectories?limit=100")
        time.sleep(PAGE_POLL_S)
    return (cpu_s(server) - server_start) if server else 0.0


def paired(runs: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    """Mean per arm, and ARM - closed within each pair (ABBA: runs 2i and 2i+1)."""
    by_arm: dict[str, list[float]] = {"closed": [], arm: []}
    diffs = []
    for i in range(0, len(runs) - 1, 2):
        a, b = runs[i], runs[i + 1]
        if a["s_per_version"] is None or b["s_per_version"] is None:
            continue
        pair = {a["arm"]: a["s_per_version"], b["arm"]: b["s_per_version"]}
        diffs.append(pair[arm] - pair["closed"])
        for name, value in pair.items():
            by_arm[name].append(value)
    summary: dict[str, Any] = {
        f"{name}_s_per_version": statistics.mean(v) if v else None for name, v in by_arm.items()
    }
    if diffs:
        mean = statistics.mean(diffs)
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
        closed = summary["closed_s_per_version"]
        summary |= {
            "paired_differences_s": diffs,
            "mean_difference_s": mean,
            "difference_se_s": se,
            "difference_pct": 100 * mean / closed if closed else None,
            "difference_se_pct": 100 * se / closed if closed and se is not None else None,
        }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="closed/open pairs (ABBA order)")
    parser.add_argument("--seconds", type=float, default=240.0, help="length of each run")
    parser.add_argument(
        "--arm", choices=("open", "api"), default="open", help="what the dashboard arm runs"
    )
    parser.add_argument("--out", type=Path, help="default bench/results/dashboard_cost[_api].json")
    args = parser.parse_args()
    name = "dashboard_cost.json" if args.arm == "open" else "dashboard_cost_api.json"
    out = args.out or RESULTS / name
    if args.arm == "open" and not CHROMIUM.exists():
        print(f"{CHROMIUM} is missing: `./just browser` installs it", file=sys.stderr)
        return 2
    arms = [("closed", args.arm) if i % 2 == 0 else (args.arm, "closed") for i in range(args.pairs)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="aj-dashcost-") as tmp:
        for i, arm in enumerate(a for pair in arms for a in pair):
            result = run_arm(arm, args.seconds, Path(tmp) / f"run{i}-{arm}")
            print(json.dumps(result), flush=True)
            runs.append(result)
    report = {"arm": args.arm, "seconds_each": args.seconds, "runs": runs, **paired(runs, args.arm)}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
