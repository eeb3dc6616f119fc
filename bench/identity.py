"""Do two trainers hold the same bits at every policy version?

Two processes, each a `SwarmOptimizer` (hivemind, loopback) over the same small model
with different random gradients, step together for `--epochs` global steps (target
batch = one sample from each). Each saves its parameters at every version it reaches;
the parent compares them version by version.

    .venv/bin/python bench/identity.py [--epochs 40] [--runs 3] [--grad-compression fp16]
        [--average-state-every N] [--stock] [--keep-traces DIR]

Prints one JSON object: per run, versions compared, versions bit-identical, the largest
difference seen, the versions that differed, the versions at which the two held the same
Adam state, and each trainer's counters (failed rounds, incomplete rounds, state
downloads, repairs); each trainer also logs every step (`--keep-traces` keeps the logs of
a run that differed).

`--average-state-every 1000` leaves the gradient rounds alone to keep the trainers in
step (no parameter averaging to hide their disagreements); `--stock` runs hivemind's own
all-reduce instead of node/allreduce.py's exact one, for comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP_PAUSE_S = 0.05  # stands in for a forward/backward pass
RUN_TIMEOUT_S = 240.0


def trainer(role: str, workdir: Path, args: argparse.Namespace) -> None:
    import msgspec
    import torch

    from agentjet.config import SwarmConfig
    from node.allreduce import ExactAverager
    from node.swarm import SwarmOptimizer, visible_maddrs

    if args.stock:  # back to hivemind's DecentralizedAverager._run_allreduce_inplace_
        del ExactAverager._run_allreduce_inplace_
    epochs = args.epochs
    config = SwarmConfig(
        run_id=f"identity-{workdir.name}",
        averaging_timeout_s=10.0,
        grad_compression=args.grad_compression,
        average_state_every=args.average_state_every,
    )
    torch.manual_seed(0)  # same initial weights in both processes
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 128))
    maddrs = workdir / "maddrs.json"
    if role == "a":
        swarm = SwarmOptimizer(
            config, model.parameters(), lr=1e-3, weight_decay=0.0, target_batch_size=2,
            other_trainers=lambda: 1,
        )  # fmt: skip
        maddrs.write_text(json.dumps(visible_maddrs(swarm.dht)))
    else:
        while not maddrs.exists():
            time.sleep(0.1)
        joined = msgspec.structs.replace(config, initial_peers=json.loads(maddrs.read_text()))
        swarm = SwarmOptimizer(
            joined, model.parameters(), lr=1e-3, weight_decay=0.0, target_batch_size=2,
            other_trainers=lambda: 1,
        )  # fmt: skip
    generator = torch.Generator().manual_seed(1 if role == "a" else 2)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    published = 0
    trace = (workdir / f"{role}-steps.jsonl").open("a", buffering=1)  # a line per step
    try:
        while swarm.epoch < epochs and time.monotonic() < deadline:
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator) * 0.01
            time.sleep(STEP_PAUSE_S)
            before = swarm.epoch
            outcome = swarm.step_outcome(batch_size=1)
            optimizer = swarm.optimizer
            row = {
                "time": time.time(),
                "before": before,
                "after": outcome.epoch,
                "applied": outcome.applied,
                "discarded": outcome.discarded,
                "swarm_epoch": optimizer.tracker.global_epoch,
                "swarm_peers": optimizer.tracker.global_progress.num_peers,
                # the parameter rounds this step began, and how each ended
                "state_rounds": [repr(r) for r in optimizer.state_averager.rounds],
                # where a divergence starts: in the weights, or in Adam's state first
                "params_sha": digest(model.parameters()),
                "adam_sha": adam_digest(optimizer.state_averager.optimizer),
                **swarm.counts(),
            }
            trace.write(json.dumps(row) + "\n")
            if outcome.epoch != published:  # a new version, as a trainer would publish it
                published = outcome.epoch
                torch.save(
                    [p.detach().clone() for p in model.parameters()],
                    workdir / f"{role}-{outcome.epoch}.pt",
                )
        (workdir / f"{role}.json").write_text(json.dumps(swarm.counts()))
    finally:
        trace.close()
        swarm.shutdown()


def digest(tensors: Any) -> str:
    """A short hash of tensors' bits, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def adam_digest(optimizer: Any) -> str:
    """A short hash of an optimizer's state tensors, in parameter order and by name (a
    state loaded from a peer is a dict built in another order)."""
    import torch

    return digest(
        t
        for group in optimizer.param_groups
        for p in group["params"]
        for _, t in sorted(optimizer.state.get(p, {}).items())
        if isinstance(t, torch.Tensor)
    )


def compare(workdir: Path) -> dict[str, object]:
    import torch

    versions = sorted(
        {int(p.stem.split("-")[1]) for p in workdir.glob("a-*.pt")}
        & {int(p.stem.split("-")[1]) for p in workdir.glob("b-*.pt")}
    )
    identical, largest, differing = 0, 0.0, []
    for version in versions:
        a = torch.load(workdir / f"a-{version}.pt")
        b = torch.load(workdir / f"b-{version}.pt")
        diff = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
        identical += diff == 0.0
        largest = max(largest, diff)
        if diff:
            differing.append(version)
    # Adam's state at each version, as each trainer last held it there (its trace)
    adam = [
        {
            row["after"]: row["adam_sha"]
            for row in map(json.loads, (workdir / f"{r}-steps.jsonl").read_text().splitlines())
        }
        for r in "ab"
    ]
    adam_versions = sorted(set(adam[0]) & set(adam[1]) & set(versions))
    return {
        "versions_compared": len(versions),
        "versions_identical": identical,
        "max_abs_difference": largest,
        "differing_versions": differing,
        "adam_versions_compared": len(adam_versions),
        "adam_versions_identical": sum(adam[0][v] == adam[1][v] for v in adam_versions),
        **{f"trainer_{r}": json.loads((workdir / f"{r}.json").read_text()) for r in "ab"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grad-compression", choices=["none", "fp16"], default="none")
    parser.add_argument("--average-state-every", type=int, default=1)
    parser.add_argument("--stock", action="store_true", help="hivemind's own all-reduce")
    parser.add_argument(
        "--keep-traces", type=Path, help="where to copy the step traces of a run that differed"
    )
    parser.add_argument("--role", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        trainer(args.role, args.workdir, args)
        return
    results = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="aj-identity-") as tmp:
            workdir = Path(tmp)
            children = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--role",
                        role,
                        "--workdir",
                        str(workdir),
                        "--epochs",
                        str(args.epochs),
                        "--grad-compression",
                        args.grad_compression,
                        "--average-state-every",
                        str(args.average_state_every),
                        *(["--stock"] if args.stock else []),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=(workdir / f"{role}.log").open("wb"),
                )  # fmt: skip
                for role in "ab"
            ]
            try:
                codes = [c.wait(timeout=RUN_TIMEOUT_S + 60) for c in children]
            finally:
                for child in children:
                    if child.poll() is None:
                        child.kill()
                        child.wait()
            if codes != [0, 0]:
                tail = (workdir / "b.log").read_text()[-2000:]
                raise SystemExit(f"a trainer failed (exit codes {codes}):\n{tail}")
            results.append(compare(workdir))
            if results[-1]["differing_versions"] and args.keep_traces:
                kept = args.keep_traces / f"run{len(results)}"
                kept.mkdir(parents=True, exist_ok=True)
                for trace in workdir.glob("*-steps.jsonl"):
                    shutil.copy(trace, kept / trace.name)
    settings = {
        "epochs": args.epochs,
        "grad_compression": args.grad_compression,
        "average_state_every": args.average_state_every,
        "allreduce": "hivemind" if args.stock else "exact",
    }
    print(json.dumps({**settings, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
