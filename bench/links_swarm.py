"""A real swarm over rate-limited links for --minutes of training, and what it did.

    tests/netns.py Swarmnet: one network namespace per node, each behind one veth limited
    to --rate-mbit each way (tc tbf; without --rate-mbit: no limit)
        coord       agentjet coordinator --listen <ip>:7000        ──▶ prints the --join address
        trainer     agentjet node --role trainer --join ... --listen <ip>:7100
        rollout-a   agentjet node --role rollout --join ... --listen <ip>:7200
        rollout-b   the same, on a host of its own
    each with --config: configs/local.toml (the README's `./just local`: the embedded
    SmolLM2-135M) + net.map_local=false (hosts of their own: no shared memory) + --set ...

The window: from the trainer's first version (its step row), --minutes; then SIGINT to the
three nodes at once, to the coordinator once they are gone; each must exit 0 within
STOP_TIMEOUT_S. Then, from the run dirs' metrics:
    trainer         versions made, samples/s (the window's step rows' samples / the window)
    staleness       per trained group: the trainer's version when it trained the group (its
                    step row's predecessor) minus the version that sampled it (the step
                    row's trained_group_versions); median, p90, max
    rollouts        per node: versions fetched, fetches dropped half-way for a newer version
                    (counted in its log: no metrics row says so), versions loaded, chunks
                    from the trainer and from the other node's relay, and each version's
                    time from the trainer's step row (written as it publishes) to the node's
                    weights_fetched and weights_loaded rows (those rows carry no fetch
                    duration of their own)
    tx_bytes        per node (its veth's counter): the whole run and the window; the
                    trainer's in the window per version it made, and per version some
                    rollout node fetched whole
    groups          tests/integration/test_swarm.py check_every_group_accounted_for: every
                    group created is trained once, dropped as stale or still held, else the
                    run fails
    exit_codes      per node, with its seconds from SIGINT to exit
Every process runs in its node's namespace and is reaped by PID (Swarmnet). The run's
folder is removed when it succeeds and kept (its path printed) when it fails.

Run (root): `python bench/links_swarm.py --rate-mbit 100 --minutes 10 [--set KEY=VALUE ...]
[--out FILE]`; bench/links.py calls `run_swarm` once per link profile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learn import run_facts  # noqa: E402
from swarm import BenchError, machine_notes  # noqa: E402

from agentjet.config import Config, load_config, to_toml  # noqa: E402
from agentjet.lifeline import descendants  # noqa: E402
from tests.integration.test_swarm import (  # noqa: E402
    Swarm,
    check_every_group_accounted_for,
    leftovers,
)
from tests.netns import Node, Swarmnet, netns_available  # noqa: E402

# The README's `./just local` config: the embedded SmolLM2-135M, its batch and step sizes.
BASE_CONFIG = ROOT / "configs" / "local.toml"
# Hosts of their own: each rollout node fetches every version over its link.
SWARM_SETTINGS = ["net.map_local=false"]
TRAINER, ROLLOUTS, COORDINATOR = "trainer", ("rollout-a", "rollout-b"), "coordinator"
NODES = (TRAINER, *ROLLOUTS)
# Each process's namespace (a Swarmnet node name) and the port it listens on (ZMQ; the
# hivemind peer takes the next one).
HOSTS = {COORDINATOR: ("coord", 7000), TRAINER: ("trainer", 7100)} | {
    name: (name, 7200) for name in ROLLOUTS
}
# Until the trainer's first version: model loads, held-out evaluation at v0, a batch and a
# step took a couple of minutes on this 2-core box; three times that on a busy one.
FIRST_VERSION_TIMEOUT_S = 900.0
# A node given SIGINT saves what is durable and leaves (18 s measured, docs/swarm.md).
STOP_TIMEOUT_S = 90.0
# Polling metrics files and process states, as a user watching them would.
POLL_S = 1.0
# What a rollout node logs when newer versions overtake the one it fetches
# (node/policy_sync.py): the fetch is dropped and no metrics row says so.
SUPERSEDED = re.compile(r"policy version (\d+) superseded while fetched")


class LinkSwarm(Swarm):
    """tests/integration/test_swarm.py's Swarm (start, metrics, steps, stuck) over this
    bench's config: its constructor writes the tests' tiny-model config, replaced here."""

    def __init__(self, folder: Path, config: Config) -> None:
        super().__init__(folder, Path(config.model.name), ())
        self.config_path.write_text(to_toml(config))


def swarm_config(settings: list[str]) -> Config:
    """configs/local.toml with SWARM_SETTINGS and `settings`; its relative paths (the
    held-out task file) are the repository root's, where every node runs."""
    with contextlib.chdir(ROOT):
        return load_config(BASE_CONFIG, [*SWARM_SETTINGS, *settings])


def start(swarm: LinkSwarm, hosts: dict[str, Node]) -> None:
    """The coordinator, then the trainer and the rollout nodes joining it, as the README's
    commands start them on machines of their own."""
    ns, port = HOSTS[COORDINATOR]
    listen = f"{hosts[ns].ip}:{port}"
    swarm.start(COORDINATOR, "coordinator", "--listen", listen, host=hosts[ns])
    join = swarm.join_address()
    for name in NODES:
        ns, port = HOSTS[name]
        role = "trainer" if name == TRAINER else "rollout"
        listen = f"{hosts[ns].ip}:{port}"
        args = ("node", "--role", role, "--join", join, "--listen", listen)
        swarm.start(name, *args, host=hosts[ns])


def watch(swarm: Swarm, until: Callable[[], bool], limit_s: float, what: str) -> None:
    """Poll until `until()`; fail when a process exits meanwhile or `limit_s` passes. Notes
    every process's descendants (hivemind's daemons) for `leftovers`."""
    deadline = time.monotonic() + limit_s
    while not until():
        for name, proc in swarm.procs.items():
            swarm.spawned |= descendants(proc.pid)
            if proc.poll() is not None:
                log = swarm.dir / f"{name}.log"
                raise BenchError(f"{name} exited with {proc.returncode} {what} (its log: {log})")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {limit_s:.0f} s")
        time.sleep(POLL_S)


def first_version(swarm: LinkSwarm) -> dict[str, Any]:
    """The trainer's first step row that made a version (after the wait for it)."""
    made: list[dict[str, Any]] = []

    def found() -> bool:
        made[:] = [r for r in swarm.steps(TRAINER) if r["policy_version"] >= 1]
        return bool(made)

    watch(swarm, found, FIRST_VERSION_TIMEOUT_S, "waiting for the trainer's first version")
    return made[0]


def stop(
    swarm: Swarm, nodes: tuple[str, ...] = NODES
) -> tuple[dict[str, int | None], dict[str, float]]:
    """SIGINT to the `nodes` at once, then to the coordinator (the directory's bootstrap
    peer) once they are gone: each one's exit code (None: still running after
    STOP_TIMEOUT_S; its stacks are then in its log) and seconds from its SIGINT to its exit."""
    codes: dict[str, int | None] = {}
    stop_s: dict[str, float] = {}
    for names in (nodes, (COORDINATOR,)):
        began = time.monotonic()
        for name in names:
            swarm.spawned |= descendants(swarm.procs[name].pid)
            swarm.procs[name].send_signal(signal.SIGINT)
        waiting = set(names)
        while waiting and time.monotonic() - began < STOP_TIMEOUT_S:
            for name in sorted(waiting):
                if swarm.procs[name].poll() is not None:
                    codes[name] = swarm.procs[name].returncode
                    stop_s[name] = round(time.monotonic() - began, 1)
                    waiting.discard(name)
            time.sleep(POLL_S / 10)
        for name in waiting:
            swarm.stuck(name)  # its threads' stacks into its log; Swarmnet kills it
            codes[name] = None
    return codes, stop_s


def tx_bytes(hosts: dict[str, Node]) -> dict[str, int]:
    """What each process's host has sent on its link so far."""
    return {name: hosts[ns].tx_bytes() for name, (ns, _) in HOSTS.items()}


def spread(values: Iterable[float]) -> dict[str, float]:
    """Median, p90 (nearest rank) and max of `values`, and how many there are."""
    ordered = [float(v) for v in sorted(values)]
    if not ordered:
        return {"n": 0}
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return {
        "n": len(ordered),
        "median": round(statistics.median(ordered), 3),
        "p90": round(p90, 3),
        "max": round(ordered[-1], 3),
    }


def per(nbytes: int, count: int) -> int | None:
    """Bytes per one of `count` things (None for none)."""
    return round(nbytes / count) if count else None


def group_staleness(trainer_rows: list[dict[str, Any]]) -> list[int]:
    """Per trained group: the trainer's version when it trained it (the version of its
    started or previous step row) minus the oldest version that sampled the group."""
    lags: list[int] = []
    version = 0
    for row in trainer_rows:
        if row.get("event") == "step":
            lags += [version - sampled for sampled in row["trained_group_versions"]]
        if row.get("event") in ("started", "step"):
            version = row["policy_version"]
    return lags


def trainer_summary(
    steps: list[dict[str, Any]], first: dict[str, Any], ended: float
) -> dict[str, Any]:
    """Versions made, in all and in the window (from the `first` version's step row until
    `ended`); samples trained per second of the window."""
    inside = [r for r in steps if first["time"] < r["time"] <= ended]
    newest = max((r["policy_version"] for r in inside), default=first["policy_version"])
    samples = sum(r["charts/samples"] for r in inside)
    return {
        "versions": max(r["policy_version"] for r in steps),
        "versions_in_window": newest - first["policy_version"],
        "samples_in_window": samples,
        "samples_per_s": round(samples / (ended - first["time"]), 3),
    }


def rollout_summary(
    rows: list[dict[str, Any]], log: str, published_at: dict[int, float]
) -> dict[str, Any]:
    """A rollout node's versions (fetched, dropped half-fetched for a newer one, loaded),
    where their chunks came from, and how long after the trainer's step row each was
    fetched and loaded."""
    fetched = [r for r in rows if r.get("event") == "weights_fetched"]
    loaded = [r for r in rows if r.get("event") == "weights_loaded"]
    # rows of nodes that fetch deltas (node/delta.py) say how, and how many bytes
    sized = [r["fetched_bytes"] for r in fetched if "fetched_bytes" in r]

    def after_step(rows: list[dict[str, Any]]) -> dict[str, float]:
        return spread(
            r["time"] - published_at[r["policy_version"]]
            for r in rows
            if r["policy_version"] in published_at
        )

    return {
        "versions_fetched": len(fetched),
        "fetched_as_delta": sum("delta_from" in r for r in fetched),
        "fetched_bytes": sum(sized) if sized else None,
        "fetches_superseded": len(SUPERSEDED.findall(log)),
        "versions_loaded": [r["policy_version"] for r in loaded],
        "chunks_from_trainer": sum(r["chunks_from_trainer"] for r in fetched),
        "chunks_from_relays": sum(r["chunks_from_relays"] for r in fetched),
        "relays_given_up": sum(r["relays_given_up"] for r in fetched),
        "fetched_after_step_s": after_step(fetched),
        "loaded_after_step_s": after_step(loaded),
        "load_s": spread(r["perf/load_s"] for r in loaded),
    }


def summary(
    swarm: LinkSwarm, first: dict[str, Any], stopped: float, sent: dict[str, dict[str, int]]
) -> dict[str, Any]:
    """What the stopped swarm's metrics say about the window from the `first` version's
    step row to the SIGINT at `stopped`; `sent`: tx_bytes at "start", "first_version",
    "sigint" and "end"."""
    steps = swarm.steps(TRAINER)
    published_at: dict[int, float] = {}
    for row in steps:
        published_at.setdefault(row["policy_version"], row["time"])
    trainer = trainer_summary(steps, first, stopped)
    window_tx = {n: sent["sigint"][n] - sent["first_version"][n] for n in HOSTS}
    rollouts = {
        name: rollout_summary(
            swarm.metrics(name, "rollout"), (swarm.dir / f"{name}.log").read_text(), published_at
        )
        for name in ROLLOUTS
    }
    delivered = {
        r["policy_version"]
        for name in ROLLOUTS
        for r in swarm.metrics(name, "rollout")
        if r.get("event") == "weights_fetched" and r["time"] <= stopped
    }
    return {
        "trainer": trainer,
        "staleness": spread(group_staleness(swarm.metrics(TRAINER, "trainer")))
        | {"unit": "versions, per trained group"},
        "rollouts": rollouts,
        "tx_bytes": {n: sent["end"][n] - sent["start"][n] for n in HOSTS},
        "tx_bytes_window": window_tx,
        # the trainer's bytes in the window per version it made, and per version some
        # rollout node fetched whole (a fetch overtaken by a newer version is lost bytes)
        "trainer_bytes_per_version": per(window_tx[TRAINER], trainer["versions_in_window"]),
        "trainer_bytes_per_version_fetched": per(window_tx[TRAINER], len(delivered)),
        "groups": check_every_group_accounted_for(swarm, [TRAINER], rollouts=ROLLOUTS),
    }


def started_s(swarm: LinkSwarm, launched: float) -> dict[str, float]:
    """Seconds from the launch to each node's first metrics row (its role running)."""
    firsts = {
        name: swarm.metrics(name, "trainer" if name == TRAINER else "rollout") for name in NODES
    }
    return {name: round(rows[0]["time"] - launched, 1) for name, rows in firsts.items() if rows}


def run(folder: Path, config: Config, rate_mbit: float | None, minutes: float) -> dict[str, Any]:
    """The swarm in `folder`, for `minutes` of training; the result without its facts."""
    swarm = LinkSwarm(folder, config)
    sent: dict[str, dict[str, int]] = {}
    with Swarmnet() as net:
        hosts = {ns: net.add_node(ns) for ns, _ in HOSTS.values()}
        if rate_mbit is not None:
            for host in hosts.values():
                host.limit(rate_mbit)
        sent["start"] = tx_bytes(hosts)
        launched = time.time()
        start(swarm, hosts)
        first = first_version(swarm)
        sent["first_version"] = tx_bytes(hosts)
        print(f"links_swarm: first version after {first['time'] - launched:.0f} s", flush=True)
        ends = time.monotonic() + minutes * 60
        watch(swarm, lambda: time.monotonic() >= ends, math.inf, "while training")
        sent["sigint"] = tx_bytes(hosts)
        stopped = time.time()
        codes, stop_s = stop(swarm)
        sent["end"] = tx_bytes(hosts)
        left = leftovers(swarm)
    if any(code != 0 for code in codes.values()):
        raise BenchError(f"not every node exited cleanly: {codes} (logs in {folder})")
    return {
        "first_version_s": round(first["time"] - launched, 1),
        "started_s": started_s(swarm, launched),
        "window_s": round(stopped - first["time"], 1),
        **summary(swarm, first, stopped, sent),
        "exit_codes": codes,
        "stop_s": stop_s,
        "leftover_processes": left,
    }


def run_swarm(
    rate_mbit: float | None, minutes: float, work: Path, settings: list[str]
) -> dict[str, Any]:
    """A coordinator, a trainer and two rollout nodes, each on a host of its own behind a
    link of `rate_mbit` each way (None: no limit), trained for `minutes` from the first
    version; what they did. The run's folder is made in `work`, removed on success and kept
    on failure (BenchError, or AssertionError for a group lost)."""
    reason = netns_available()
    if reason is not None:
        raise BenchError(f"links_swarm needs network namespaces: {reason}")
    config = swarm_config(settings)
    work.mkdir(parents=True, exist_ok=True)
    profile = "unlimited" if rate_mbit is None else f"{rate_mbit:g}mbit"
    folder = Path(tempfile.mkdtemp(prefix=f"links-swarm-{profile}-", dir=work))
    began = time.monotonic()
    facts = {
        **run_facts(argparse.Namespace(config=BASE_CONFIG, set=[*SWARM_SETTINGS, *settings])),
        "model": config.model.name,
        "machine_notes": machine_notes(),
    }
    try:
        result = run(folder, config, rate_mbit, minutes)
    except BaseException:
        print(f"links_swarm: the run failed; its files are in {folder}", file=sys.stderr)
        raise
    shutil.rmtree(folder)
    return {
        "rate_mbit": rate_mbit,
        "minutes": minutes,
        **result,
        "wall_s": round(time.monotonic() - began, 1),
        "facts": facts,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=None, help="each way (none: no limit)")
    parser.add_argument("--minutes", type=float, default=10.0, help="of training, from v1")
    parser.add_argument("--set", action="append", default=[], help="config KEY=VALUE, each node")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="the run's folder is made here",
    )
    args = parser.parse_args()
    reason = netns_available()
    if reason is not None:
        print(f"links_swarm needs network namespaces: {reason}", file=sys.stderr)
        return 2
    result = run_swarm(args.rate_mbit, args.minutes, args.work, args.set)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
