"""The dashboard in a real browser, against a real `agentjet local` run of the tiny model.

Chromium is Debian's (/usr/bin/chromium, `just browser`), driven by Playwright's Python
package; Playwright's own browser download is not used. The test reads what a user sees
(the page's DOM and its `window.agentjetState`) and checks it against the run's files.
Every process it starts (the launcher and what it spawns, a second dashboard, the
browser) is reaped by PID; every wait is bounded.

AGENTJET_SCREENSHOTS=DIR also saves each tab as DIR/dashboard-<tab>.png (1200x800); the
README's pictures are the same page, 1200x800, on a SmolLM2-135M `just bench-learn` run,
but for the scheduler's, which is this test's own run (the scheduler tab shows a live
coordinator, and the bench's has ended by the time its dir is served).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentjet.lifeline import descendants, running
from tests import procs
from tests.integration.test_local import local_argv

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
MAX_STEPS = 4
# The tiny run takes about a minute on a 2-core box; the bound leaves room for a slow one.
RUN_TIMEOUT_S = 420
# How long the dashboard's URL may take to appear, and the page to show a poll's data.
START_TIMEOUT_S = 120
PAGE_TIMEOUT_MS = 30_000
VIEWPORT = {"width": 1200, "height": 800}


def wait_until(what: str, condition: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)  # polling files and processes, not standing in for synchronisation
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def json_rows(path: Path) -> list[dict[str, Any]]:
    """The rows a reader gets: complete lines that are JSON objects."""
    data = path.read_bytes()
    rows = []
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "api/roles", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def reap(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until("killed processes to exit", lambda: not any(running(p) for p in pids), 30)


@contextlib.contextmanager
def started(argv: list[str], output: Path) -> Iterator[tuple[subprocess.Popen[bytes], set[int]]]:
    """A process in its own session with its output in a file; afterwards it and every
    process seen below it are gone (SIGINT, then SIGKILL by PID)."""
    with open(output, "ab") as out:
        proc = procs.popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    spawned: set[int] = set()
    try:
        yield proc, spawned
    finally:
        spawned |= descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
        if proc.poll() is None:
            spawned |= descendants(proc.pid)
            proc.kill()
        proc.wait()
        reap({pid for pid in spawned if running(pid)})


def url_in(output: Path) -> str | None:
    found = re.search(r"dashboard: (http://\S+)", output.read_text(errors="replace"))
    return found.group(1) if found else None


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists() or shutil.which("chromium") is None:
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: CI installs it with `./just browser`")
        pytest.skip(f"no {CHROMIUM}: `./just browser` (root) installs Debian's chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    before = descendants(os.getpid())
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, timeout=PAGE_TIMEOUT_MS
        )
        try:
            yield chromium
        finally:
            chromium.close()
    reap({pid for pid in descendants(os.getpid()) - before if running(pid)})


class Page:
    """A page with its console errors and uncaught exceptions collected."""

    def __init__(self, browser: Any, url: str) -> None:
        self.errors: list[str] = []
        self.page = browser.new_page(viewport=VIEWPORT)
        self.page.set_default_timeout(PAGE_TIMEOUT_MS)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def state(self) -> dict[str, Any]:
        return dict(self.page.evaluate("() => JSON.parse(JSON.stringify(window.agentjetState))"))

    def wait_for(self, expression: str, timeout_ms: float = PAGE_TIMEOUT_MS) -> None:
        """Until `expression` is true in the page. Polled with evaluate, which runs through
        the DevTools protocol: wait_for_function evals a string, which the page's
        Content-Security-Policy forbids (as it should)."""
        wait_until(expression, lambda: self.page.evaluate(expression), timeout_ms / 1000)

    def tab(self, name: str) -> None:
        self.page.click(f"nav button[data-tab={name}]")
        self.wait_for(f"document.getElementById('tab-{name}').classList.contains('active')")

    def screenshot(self, name: str, tmp_path: Path) -> None:
        self.page.screenshot(path=str(tmp_path / f"dashboard-{name}.png"))
        if out := os.environ.get("AGENTJET_SCREENSHOTS"):
            shutil.copy(tmp_path / f"dashboard-{name}.png", Path(out) / f"dashboard-{name}.png")


def test_the_dashboard_follows_a_local_run_live_and_shows_it_down_to_the_token(
    browser: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    output = tmp_path / "local.out"

    # ── live: the dashboard `agentjet local` starts, while the run trains ──────────────
    settings = ("rollout.trajectory_share=1.0", 'coordinator.scheduler="envsched"')
    # No step bound: the tiny run can finish in seconds, before the page has looked at the
    # live coordinator. It runs until the test has seen it live and it made MAX_STEPS steps,
    # then stops as on Ctrl-C.
    with started(local_argv(tiny_model_dir, run_dir, 0, settings), output) as (
        local,
        spawned,
    ):
        url = wait_until("the dashboard's URL", lambda: url_in(output), START_TIMEOUT_S)
        assert url.startswith("http://127.0.0.1:")
        wait_until("the dashboard to answer", lambda: answers(url), START_TIMEOUT_S)
        live = Page(browser, url)
        live.wait_for("window.agentjetState && window.agentjetState.polls >= 1")
        first = sum(live.state()["rows"].values())
        # new rows arrive without a reload
        total = "Object.values(window.agentjetState.rows).reduce((a, b) => a + b, 0)"
        live.wait_for(f"{total} > {first}")
        live.tab("nodes")
        # each role is listed once it wrote a row (a trainer takes a while to start)
        three = "document.querySelectorAll('#nodes tbody tr').length === 3"
        live.wait_for(three, START_TIMEOUT_S * 1000)
        roles = live.page.eval_on_selector_all(
            "#nodes tbody tr", "rows => rows.map(r => r.dataset.role)"
        )
        assert roles == ["coordinator", "trainer", "rollout"]
        # the scheduler tab: the coordinator's table, asked over its socket while it runs
        live.tab("scheduler")
        live.wait_for("document.querySelectorAll('#scheduler table[data-level=env] tr').length > 1")
        # read in one go: a poll may redraw the tables between two reads
        status, shown = live.page.evaluate(
            """() => [window.agentjetState.scheduler.status,
                      [...document.querySelectorAll('#scheduler table tbody tr td:first-child')]
                          .map(c => c.textContent)]"""
        )
        assert status["scheduler"] == "envsched" and status["grants_issued"] > 0
        assert shown == [row["name"] for row in status["table"]]
        assert "grants issued" in live.page.inner_text("#scheduler .facts")
        live.screenshot("scheduler", tmp_path)
        assert live.errors == []
        live.page.close()  # before the run ends: a poll of a stopped server is an error
        trainer_rows = run_dir / "metrics" / "trainer.jsonl"
        wait_until(
            f"{MAX_STEPS} steps",
            lambda: sum(r.get("event") == "step" for r in json_rows(trainer_rows)) >= MAX_STEPS,
            RUN_TIMEOUT_S,
        )
        local.send_signal(signal.SIGINT)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while local.poll() is None and time.monotonic() < deadline:
            spawned |= descendants(local.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                local.wait(timeout=0.5)
        logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
        assert local.returncode == 0, output.read_text() + logs
    # the dashboard stopped with the run, like every role
    assert not answers(url)
    assert [pid for pid in spawned if running(pid)] == []

    # ── afterwards: `agentjet dashboard` on the finished run dir ───────────────────────
    argv = [sys.executable, "-m", "agentjet_app.cli", "dashboard", "--run-dir", str(run_dir)]
    with started(argv, tmp_path / "dashboard.out"):
        url = wait_until("its URL", lambda: url_in(tmp_path / "dashboard.out"), START_TIMEOUT_S)
        page = Page(browser, url)
        metrics = {
            role: json_rows(run_dir / "metrics" / f"{role}.jsonl")
            for role in ("coordinator", "trainer", "rollout")
        }
        counts = {role: len(rows) for role, rows in metrics.items()}
        page.wait_for(  # every row of every file read, and no more
            f"(() => {{ const read = window.agentjetState.rows, want = {json.dumps(counts)};"
            " return Object.keys(want).every(role => read[role] === want[role]); })()"
        )
        state = page.state()
        series = state["series"]
        steps = [r for r in metrics["trainer"] if r.get("event") == "step"]
        batches = [r for r in metrics["rollout"] if r.get("event") == "batch"]
        assert len(steps) >= MAX_STEPS and batches
        # every step and batch row is a point of the curves that plot it
        for env in {r["env"] for r in batches}:
            assert len(series["reward"][env]) == sum(r["env"] == env for r in batches)
        assert len(series["samples"]["trainer"]) == len(steps)
        assert len(series["samples"]["rollout"]) == len(batches)
        assert len(series["staleness"]["mean"]) == len(steps)
        assert len(series["step_time"]["learner step"]) == len(steps)
        assert len(series["losses/policy"]["policy"]) == len(steps)
        drawn = page.page.evaluate(
            """() => { const c = document.querySelector('#chart-reward canvas');
                       const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                       let n = 0;
                       for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
                       return n; }"""
        )
        assert drawn > 500, "the reward chart is blank"
        page.screenshot("curves", tmp_path)

        page.tab("nodes")
        page.wait_for("document.querySelectorAll('#nodes tbody tr').length === 3")
        trainer_row = page.page.inner_text("#nodes tbody tr[data-role=trainer]")
        # the trainer's last version: its "stopped" row's, which is its last step's (a step
        # the stop lands in ends first and has its row: test_trainer_stop.py)
        [stopped] = [r for r in metrics["trainer"] if r.get("event") == "stopped"]
        assert stopped["policy_version"] == max(r["policy_version"] for r in steps)
        assert f"\ttrainer\t{stopped['policy_version']}\t" in trainer_row, trainer_row
        page.screenshot("nodes", tmp_path)

        # ── the trajectory viewer: a group's tokens, marked as its masks say ─────────────
        page.tab("trajectories")
        page.wait_for("document.querySelectorAll('#groups tbody tr').length > 0")
        written = {g["group_id"]: g for g in json_rows(run_dir / "trajectories.jsonl")}
        group_id = page.page.get_attribute("#groups tbody tr", "data-group")
        assert group_id in written
        page.page.click(f"#groups tbody tr[data-group='{group_id}']")
        samples = len(written[group_id]["samples"])
        page.wait_for(f"document.querySelectorAll('#group .sample').length === {samples}")
        shown = page.page.eval_on_selector_all(
            "#group .sample",
            """samples => samples.map(s => ({
                masks: [...s.querySelectorAll('.tok.completion')]
                    .map(t => Number(t.dataset.mask)),
                trained: s.querySelectorAll('.tok.trained').length,
                context: s.querySelectorAll('.tok.context').length,
                prompt: s.querySelectorAll('.tok.prompt').length,
                boundaries: s.querySelectorAll('.boundary').length,
                title: (s.querySelector('.tok.trained') || {}).title || '' }))""",
        )
        for sample, seen in zip(written[group_id]["samples"], shown, strict=True):
            masks = [1 if t[1] else 0 for t in sample["completion"]]
            assert seen["masks"] == masks
            assert seen["trained"] == sum(masks) and seen["context"] == len(masks) - sum(masks)
            assert seen["prompt"] == len(sample["prompt"])
            starts = sum(1 for a, b in zip([0, *masks], masks, strict=False) if (a, b) == (0, 1))
            assert seen["boundaries"] == starts
            if sum(masks):
                assert "logprob" in seen["title"] and "advantage" in seen["title"]
        page.screenshot("trajectories", tmp_path)

        # the scheduler of a finished run: said plainly, not an error
        page.tab("scheduler")
        page.wait_for("!!document.getElementById('scheduler-message')")
        message = page.page.inner_text("#scheduler-message")
        assert "the coordinator is not running (the run has ended)" in message
        assert page.errors == []
