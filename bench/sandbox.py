"""Sandbox benchmark: what one tool call costs on each backend, and pool throughput.

    docker_warm: exec into a running container of a pool        (what episodes pay)
    docker_cold: `docker run --rm` of the same program per call   (no pool)
    docker_exec: `docker exec python3 -c` into the same running container (the path
                 before the runner, measured alongside)
    process:     ProcessSandbox exec (bubblewrap when installed)
    process_fresh_interpreter: the same sandbox running `python -c` as a shell program,
                 i.e. a fresh interpreter per call (the path before the runner)
    execs_per_s: episodes (lease, one exec, give back: reset and health check included)
                 per second from pools of 1, 2 and 4 containers, 8 threads asking at once
    process_execs_per_s: the same from pools of process sandboxes

Both backends run programs through a warm runner in each sandbox (sandboxes/runner.py).

Every call runs the same Python program (`print(1)`). Latencies are measured interleaved,
one call of each backend per round, so machine noise hits them alike. Writes
bench/results/sandbox.json. Needs a docker engine and the sandbox image
(`./just docker-up`). Run it on an otherwise idle machine.

    .venv/bin/python bench/sandbox.py [--rounds 200] [--cold-rounds 30] [--episodes 600]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandboxes.docker_sandbox import (  # noqa: E402
    WORK_DIR,
    DockerEngine,
    DockerSandbox,
    DockerSettings,
    container_options,
)
from sandboxes.pool import SandboxPool  # noqa: E402
from sandboxes.process import ProcessSandbox  # noqa: E402

PROGRAM = "print(1)"
TIMEOUT_S = 30.0
RESULTS = Path(__file__).parent / "results" / "sandbox.json"


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
        "n": len(ordered),
    }


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cold_run(engine: DockerEngine, settings: DockerSettings) -> None:
    """One `docker run --rm` of the program with the sandbox's limits."""
    output = engine.client.containers.run(
        settings.image,
        ["python3", "-c", PROGRAM],
        remove=True,
        working_dir=WORK_DIR,
        **container_options(settings, engine.labels),
    )
    assert output == b"1\n", output


def exec_run(box: DockerSandbox) -> None:
    """One `docker exec` of the program into the sandbox's running container."""
    result = box.container.exec_run(["python3", "-c", PROGRAM], workdir=WORK_DIR)
    assert result.output == b"1\n", result


def local_python() -> str:
    return sys.executable


def latencies(engine: DockerEngine, rounds: int, cold_rounds: int) -> dict[str, Any]:
    settings = DockerSettings()
    warm: list[float] = []
    cold: list[float] = []
    process: list[float] = []
    docker_exec: list[float] = []
    fresh: list[float] = []
    fresh_program = f"{local_python()} -c '{PROGRAM}'"
    with DockerSandbox(engine, settings) as box, ProcessSandbox() as local:
        for sandbox in (box, local):  # first calls warm the page cache
            assert sandbox.exec(PROGRAM, TIMEOUT_S).stdout == "1\n"
        for i in range(rounds):
            warm.append(timed(lambda: _check(box.exec(PROGRAM, TIMEOUT_S))))
            process.append(timed(lambda: _check(local.exec(PROGRAM, TIMEOUT_S))))
            docker_exec.append(timed(lambda: exec_run(box)))
            fresh.append(timed(lambda: _check(local.exec(fresh_program, TIMEOUT_S, language="sh"))))
            if i < cold_rounds:
                cold.append(timed(lambda: cold_run(engine, settings)))
    return {
        "docker_warm": percentiles(warm),
        "docker_cold": percentiles(cold),
        "docker_exec": percentiles(docker_exec),
        "process": percentiles(process) | {"bwrap": local.bwrap is not None},
        "process_fresh_interpreter": percentiles(fresh),
    }


def throughput(factory: Any, size: int, episodes: int, threads: int) -> float:
    """Episodes per second: lease a sandbox, run one program, give it back (reset)."""
    pool = SandboxPool(factory, size, acquire_timeout_s=600)
    pool.start()

    def episode(_: int) -> None:
        lease = pool.lease()
        lease.start()
        try:
            _check(lease.exec(PROGRAM, TIMEOUT_S))
        finally:
            lease.close()

    try:
        with ThreadPoolExecutor(threads) as workers:
            list(workers.map(episode, range(threads)))  # warm up
            start = time.perf_counter()
            list(workers.map(episode, range(episodes)))
            return episodes / (time.perf_counter() - start)
    finally:
        pool.close()


def _check(result: Any) -> None:
    assert result.ok and result.stdout == "1\n", result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--cold-rounds", type=int, default=30)
    parser.add_argument("--episodes", type=int, default=600)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    engine = DockerEngine("bench")
    try:
        result: dict[str, Any] = latencies(engine, args.rounds, args.cold_rounds)
        print(json.dumps(result, indent=1), flush=True)
        for key, factory in (
            ("execs_per_s", lambda: DockerSandbox(engine)),
            ("process_execs_per_s", ProcessSandbox),
        ):
            result[key] = {
                str(size): round(throughput(factory, size, args.episodes, args.threads), 2)
                for size in (1, 2, 4)
            }
    finally:
        engine.remove_ours()
    result["setup"] = {
        "program": PROGRAM,
        "threads": args.threads,
        "episodes": args.episodes,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "docker": engine.client.version().get("Version", "?"),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
