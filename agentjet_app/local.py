"""`agentjet local`: coordinator, trainer and rollout node as processes on one box.

    launcher (holds <run dir>/local.lock: agentjet/rundir.py)
        ──spawn (own session each)──▶ coordinator, trainer, rollout  (logs/<role>.log; each
        │                            holds <run dir>/<role>.lock, as any node does)
        ├── and, unless dashboard.enabled = false: agentjet dashboard on the run dir
        │   (logs/dashboard.log; prints its URL; a dashboard that fails stops no training)
        │
        └── every PROGRESS_POLL_S: tail metrics/<role>.jsonl ──▶ one progress line per version
            (and one per held-out evaluation: rollout.eval_every)
            stop on Ctrl-C / SIGTERM, at --max-steps (the trainer exits), or when a role dies:
            SIGTERM each role's process group, wait, SIGKILL what is left, reap by PID.

Imports no torch: the launcher stays light and the roles load what they need.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from agentjet.config import Config, dashboard_address, load_config, to_toml
from agentjet.errors import ConfigError
from agentjet.keys import DEFAULT_KEYS_FILE, write_keys
from agentjet.lifeline import descendants, process_table
from agentjet.ports import free_port
from agentjet.rundir import hold_run_dir
from agentjet_app.dashboard import dashboard_url

ROLES = ("coordinator", "trainer", "rollout")
# How often the launcher reads metrics and checks on its children.
PROGRESS_POLL_S = 1.0
# How long a role gets to shut down cleanly (checkpoint, hivemind goodbye) before SIGKILL.
STOP_GRACE_S = 60.0
# How long a SIGKILLed daemon may take to disappear from the process table.
DAEMON_EXIT_S = 10.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The child that finds the GPUs imports torch (a few seconds on a small box).
PLACE_TIMEOUT_S = 120.0


@dataclass
class Child:
    role: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Progress:
    """Turns metric rows into the lines a user watches."""

    out: TextIO
    # The policies' names ([[policies]]); [""]: the one policy of a config without them.
    policies: list[str] = field(default_factory=lambda: [""])
    offsets: dict[Path, int] = field(default_factory=dict)  # bytes already shown, per file
    last_version: int = 0
    started: float = field(default_factory=time.monotonic)

    def files(self, run_dir: Path) -> list[tuple[Path, str]]:
        """The metrics files shown, each with its policy ("" for the rollout node's)."""
        found = [(run_dir / "metrics" / "rollout.jsonl", "")]
        for policy in self.policies:
            trainer_dir = run_dir / "policies" / policy if policy else run_dir
            found.append((trainer_dir / "metrics" / "trainer.jsonl", policy))
        return found

    def skip_existing(self, run_dir: Path) -> None:
        """Show nothing of what an earlier run on this run dir wrote (a continued run)."""
        for path, _ in self.files(run_dir):
            if path.exists():
                data = path.read_bytes()
                self.offsets[path] = data.rfind(b"\n") + 1  # a cut run may end mid-row

    def poll(self, run_dir: Path) -> None:
        """Show the rows appended since the last poll (whole lines only; files only grow)."""
        for path, policy in self.files(run_dir):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a row a power cut left half-written, then appended to
                if isinstance(row, dict):
                    self._show(row, policy or str(row.get("policy", "")))

    def _show(self, row: dict[str, Any], policy: str = "") -> None:
        elapsed = time.monotonic() - self.started
        name = f"{policy} " if policy else ""  # "policy planner v3"
        if row.get("event") == "step":
            self.last_version = max(self.last_version, int(row["policy_version"]))
            zero_variance = row["charts/zero_variance_groups"] + row.get("groups_left_out", 0)
            print(
                f"[{elapsed:6.0f}s] policy {name}v{row['policy_version']:<4d}"
                f" reward {row['charts/reward_mean']:.3f}"
                f"  samples/s {row['perf/samples_per_s']:.2f}"
                f"  staleness {row['charts/staleness_mean']:.2f}"
                # trained with the step, or left out by dynamic sampling while it filled
                f"  zero-var groups {zero_variance}"
                f"  trained tokens {row['charts/trained_tokens']}"
                f"  step {row['perf/step_s']:.1f}s",
                file=self.out,
                flush=True,
            )
        elif row.get("event") == "batch" and self.last_version == 0:
            # Until the first version exists, show that rollouts are being generated.
            print(
                f"[{elapsed:6.0f}s] rollout: {len(row['group_ids'])} groups sampled at"
                f" policy {name}v{row['policy_version']}, reward {row['charts/reward_mean']:.3f},"
                f" {row['perf/gen_tokens_per_s']:.0f} tokens/s",
                file=self.out,
                flush=True,
            )
        elif row.get("event") == "weights_loaded":
            print(
                f"[{elapsed:6.0f}s] rollout node switched to policy {name}v{row['policy_version']}",
                file=self.out,
                flush=True,
            )
        elif row.get("event") == "eval":
            for line in held_out_lines(row, name):
                print(f"[{elapsed:6.0f}s] {line}", file=self.out, flush=True)
        elif row.get("event") == "quarantined":
            # Else the lines stop and nothing says why: the only rollout node's groups are
            # refused (seen: short answers, honest samples over trainer.max_logprob_gap).
            print(
                f"[{elapsed:6.0f}s] WARNING: the {name}trainer quarantined {row['node_id']}"
                f" ({row['reason']}): {row.get('message', 'its groups are refused')}"
                " (docs/training.md, Verified trajectories)",
                file=self.out,
                flush=True,
            )
        elif row.get("event") in ("quarantine_reminder", "quarantine_lifted"):
            loud = "WARNING: " if row["event"] == "quarantine_reminder" else ""
            print(
                f"[{elapsed:6.0f}s] {loud}{name}trainer: {row['message']}",
                file=self.out,
                flush=True,
            )


def held_out_lines(row: dict[str, Any], name: str = "") -> list[str]:
    """One line per environment of an "eval" row (node/held_out.py): "held-out arithmetic
    31.5% at v20 (54 tasks)"; `name` is the policy's, followed by a space, or ""."""
    lines = []
    for key, accuracy in row.items():
        parts = key.split("/")  # eval/<env>/accuracy
        if len(parts) == 3 and parts[0] == "eval" and parts[2] == "accuracy":
            env = parts[1]
            tasks = row.get(f"eval/{env}/tasks")
            count = f" ({tasks} tasks)" if tasks is not None else ""
            lines.append(f"held-out {env} {accuracy:.1%} at {name}v{row['policy_version']}{count}")
    return lines


def place_roles(config: Config) -> Config:
    """The config with the rollout node's and the trainer's devices and GPU memory shares
    set for this machine (agentjet/devices.py `place_local`), asked of a child process."""
    import msgspec

    argv = [sys.executable, "-m", "agentjet.devices", config.rollout.device, config.trainer.device]
    argv += [str(config.rollout.gpu_memory_share), str(config.trainer.gpu_memory_share)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=PLACE_TIMEOUT_S)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        raise ConfigError(lines[-1])
    placed = json.loads(done.stdout)
    return msgspec.structs.replace(
        config,
        rollout=msgspec.structs.replace(
            config.rollout,
            device=placed["rollout_device"],
            gpu_memory_share=placed["rollout_share"],
        ),
        trainer=msgspec.structs.replace(
            config.trainer,
            device=placed["trainer_device"],
            gpu_memory_share=placed["trainer_share"],
        ),
    )


def describe_placement(config: Config) -> str:
    """One line: where each computing role runs."""

    def where(device: str, share: float) -> str:
        return f"{device} ({share:.0%} of its memory)" if device.startswith("cuda") else device

    rollout = where(config.rollout.device, config.rollout.gpu_memory_share)
    trainer = where(config.trainer.device, config.trainer.gpu_memory_share)
    return f"devices: rollout node {rollout}, trainer {trainer}"


def prepare_run(config: Config, run_dir: Path) -> Path:
    """Resolve endpoints to free loopback ports and write the config all roles will read.

    Without net.keys (and not net.insecure) the roles use a keypair made in the run dir.
    """
    import msgspec

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    keys = config.net.keys
    if not keys and not config.net.insecure:
        keys = str(run_dir / DEFAULT_KEYS_FILE)
        if not Path(keys).exists():  # a run dir used again keeps its keys
            write_keys(keys)
    resolved = msgspec.structs.replace(
        place_roles(config),
        run=msgspec.structs.replace(config.run, dir=str(run_dir)),
        coordinator=msgspec.structs.replace(
            config.coordinator, endpoint=f"tcp://127.0.0.1:{free_port()}", publish=False
        ),
        net=msgspec.structs.replace(
            config.net,
            trainer_endpoint=f"tcp://127.0.0.1:{free_port()}",
            # each policy's trainer on its own port
            policy_endpoints={p.name: f"tcp://127.0.0.1:{free_port()}" for p in config.policies},
            keys=keys,
        ),
        swarm=msgspec.structs.replace(config.swarm, run_id=f"{config.swarm.run_id}-{os.getpid()}"),
    )
    path = run_dir / "config.toml"
    path.write_text(to_toml(resolved))
    return path


def _die_with_launcher() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, even by SIGKILL."""
    start_pid = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != start_pid:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def spawn(role: str, config_path: Path, run_dir: Path) -> Child:
    """Start a role (its log: logs/ROLE.log)."""
    argv = [sys.executable, "-m", "agentjet_app.cli"]
    argv += ["coordinator"] if role == "coordinator" else ["node", "--role", role]
    argv += ["--config", str(config_path)]
    return _start(role, argv, run_dir)


def spawn_dashboard(config: Config, run_dir: Path) -> tuple[Child, str]:
    """`agentjet dashboard` on the run dir at dashboard.listen (port 0: a free one), and
    its URL. It reads its token from the run dir's config.toml, not from its argv (which
    every user of the machine can read)."""
    where = "config error at dashboard.listen"
    host, port = dashboard_address(config.dashboard.listen, config.dashboard.token, where)
    port = port or free_port(host)
    argv = [sys.executable, "-m", "agentjet_app.cli", "dashboard", "--run-dir", str(run_dir)]
    argv += ["--listen", f"{host}:{port}"]
    return _start("dashboard", argv, run_dir), dashboard_url(host, port, config.dashboard.token)


def _start(name: str, argv: list[str], run_dir: Path) -> Child:
    log_path = run_dir / "logs" / f"{name}.log"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: we can stop it and its daemons
            preexec_fn=_die_with_launcher if sys.platform == "linux" else None,
        )
    return Child(name, process, log_path)


def stop_children(children: list[Child], seen: set[int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every role, then SIGKILL its process group and daemons after the grace period.

    Daemons a role started (hivemind's DHT process, p2pd) share its process group; `seen`
    holds every PID ever observed below the launcher, so daemons that left the group or
    outlived their role are still found — by PID, never by name.
    """
    daemons = seen | {pid for child in children for pid in descendants(child.process.pid)}
    for child in children:
        # The role itself, not its group: it shuts its hivemind processes down in order. A
        # SIGTERM to them too would leave an optimizer step waiting on dead averagers.
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            print(f"{child.role} did not stop in {grace_s:.0f} s; killing it", file=sys.stderr)
    for child in children:
        _signal_group(child.process.pid, signal.SIGKILL)
        child.process.wait()
    for pid in daemons:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(daemons, {c.process.pid for c in children}, DAEMON_EXIT_S)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_gone(pids: set[int], pgids: set[int], timeout_s: float) -> None:
    """Signals are delivered asynchronously: wait until the killed processes really exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        table = process_table()
        if not any(
            info.state != "Z" and (pid in pids or info.pgid in pgids) for pid, info in table.items()
        ):
            return
        time.sleep(0.05)


def run_local(config: Config, run_dir: Path, out: TextIO = sys.stdout) -> int:
    # Before config.toml is written: a second `agentjet local` on a live run's dir would
    # rewrite the config its roles and dashboard read. Each role holds its own lock too.
    with hold_run_dir(run_dir, "local"):
        return _run_local(config, run_dir, out)


def _run_local(config: Config, run_dir: Path, out: TextIO) -> int:
    config_path = prepare_run(config, run_dir)
    saved = "policies/NAME/ (each policy's checkpoints)" if config.policies else "checkpoints/"
    print(f"run dir: {run_dir}  (config.toml, metrics/, logs/, {saved})", file=out)
    print(describe_placement(load_config(config_path)), file=out)
    children: list[Child] = []
    dashboard: Child | None = None  # watched apart: its end stops no training
    seen: set[int] = set()  # every PID observed below the launcher
    stopping = False

    def request_stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    policies = [p.name for p in config.policies]
    trained = policies or [""]  # "": the one policy of a config without [[policies]]
    progress = Progress(out, trained)
    progress.skip_existing(run_dir)
    code = 0
    try:
        for role in ROLES:  # the trainer trains every policy (node/trainer_host.py)
            children.append(spawn(role, config_path, run_dir))
        trainer = f"trainer (policies {', '.join(policies)})" if policies else "trainer"
        print(
            f"started coordinator, {trainer} and rollout node; the first policy version "
            "appears after the first batch is generated and trained (Ctrl-C stops)",
            file=out,
            flush=True,
        )
        if config.dashboard.enabled:
            dashboard, url = spawn_dashboard(config, run_dir)
            print(f"dashboard: {url}", file=out, flush=True)
        while not stopping:
            time.sleep(PROGRESS_POLL_S)
            seen |= descendants(os.getpid())
            progress.poll(run_dir)
            if dashboard is not None and dashboard.process.poll() is not None:
                print(
                    f"dashboard exited with code {dashboard.process.returncode} (training goes "
                    f"on); last log lines:\n{dashboard.tail()}",
                    file=sys.stderr,
                )
                dashboard = None
            finished = [c for c in children if c.process.poll() is not None]
            if not finished:
                continue
            failed = [
                c
                for c in finished
                if c.role != "trainer" or c.process.returncode != 0 or not config.run.max_steps
            ]
            if not failed:  # the trainer ends once every policy is at --max-steps
                print(f"reached --max-steps {config.run.max_steps}", file=out)
            else:
                for c in failed:
                    print(
                        f"{c.role} exited with code {c.process.returncode}; last log lines:\n"
                        f"{c.tail()}",
                        file=sys.stderr,
                    )
                code = 1
            break
    finally:
        print("stopping all roles ...", file=out, flush=True)
        stop_children(children + ([dashboard] if dashboard is not None else []), seen)
        progress.poll(run_dir)
    for policy in trained:
        checkpoints = (run_dir / "policies" / policy if policy else run_dir) / "checkpoints"
        latest = checkpoints / "latest"
        if latest.exists():
            checkpoint = checkpoints / latest.read_text().strip()
            print(f"latest checkpoint{f' of {policy}' if policy else ''}: {checkpoint}", file=out)
    return code
