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

`--stranger` asks whether a stranger can get into a closed swarm's averaging. Each run is
then a pair: the two trainers as node/trainer.py makes them with the swarm's keys (their
DHTs admit only the root's certificates, their averagers answer only bound members), in
lock step (each computes the gradients of version v, from a generator seeded by its role
and v, only once both reached v, and steps once), first alone, then with a third process,
the stranger: its own hivemind peer, the trainers' addresses, peer ids and averager names
(all public), calling their state download, round join and all-reduce handlers until
they finish. Lock step makes the weights of every version a function of the seeds only,
so the pair's weights are compared across the two runs, version by version
(`with_stranger`: versions compared, identical, largest difference), next to what the
stranger got and what the trainers counted as refused.
"""

from __future__ import annotations

import argparse
import asyncio
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
    from node.dht import visible_maddrs

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
    if role == "b":
        wait_for_file(maddrs)
        config = msgspec.structs.replace(config, initial_peers=json.loads(maddrs.read_text()))
    swarm = optimizer(config, model, workdir, role, closed=args.stranger)
    if role == "a":
        maddrs.write_text(json.dumps(visible_maddrs(swarm.dht)))
    if args.with_stranger:
        wait_for_file(workdir / "stranger-ready")
    generator = torch.Generator().manual_seed(1 if role == "a" else 2)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    published = 0
    trace = (workdir / f"{role}-steps.jsonl").open("a", buffering=1)  # a line per step
    try:
        while swarm.epoch < epochs and time.monotonic() < deadline:
            if args.stranger:  # lock step: this version's gradients, once both are here
                version = swarm.epoch
                (workdir / f"{role}-at-{version}").touch()
                wait_for_file(workdir / f"{'b' if role == 'a' else 'a'}-at-{version}", deadline)
                generator = torch.Generator().manual_seed(LOCKSTEP_SEEDS[role] + version)
                # and once hivemind's tracker shows both at this version: else the step
                # finds the target batch not yet reached, keeps the gradients and returns,
                # and the next call adds a second draw to them
                tracker = swarm.optimizer.tracker
                while tracker.global_progress.epoch < version and time.monotonic() < deadline:
                    swarm.optimizer._refresh_progress(timeout=1.0)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator) * 0.01
            time.sleep(STEP_PAUSE_S)
            before = swarm.epoch
            # In lock step each trainer brings the whole target batch: its one step begins
            # the round (the two are matched there), and no step accumulates a second draw.
            outcome = swarm.step_outcome(batch_size=2 if args.stranger else 1)
            optimizer_ = swarm.optimizer
            if args.stranger and outcome.epoch == before and not outcome.discarded:
                # Kept for a later step (hivemind's tracker did not see the target batch
                # yet): start the version over, or the step that takes them would hold
                # two draws while the other trainer's holds one.
                optimizer_.grad_averager.reset_accumulated_grads_()
                optimizer_.tracker.report_local_progress(before, samples_accumulated=0)
            row = {
                "time": time.time(),
                "before": before,
                "after": outcome.epoch,
                "applied": outcome.applied,
                "discarded": outcome.discarded,
                "swarm_epoch": optimizer_.tracker.global_epoch,
                "swarm_peers": optimizer_.tracker.global_progress.num_peers,
                # the parameter rounds this step began, and how each ended
                "state_rounds": [repr(r) for r in optimizer_.state_averager.rounds],
                # where a divergence starts: in the weights, or in Adam's state first
                "params_sha": digest(model.parameters()),
                "adam_sha": adam_digest(optimizer_.state_averager.optimizer),
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
        if args.stranger:
            swarm.dht.shutdown()  # made here, given to the optimizer


# Lock step's gradient generators: trainer a's at version v is seeded a + v.
LOCKSTEP_SEEDS = {"a": 1_000_003, "b": 2_000_003}


def wait_for_file(path: Path, deadline: float | None = None) -> None:
    """Poll for a file another process of this run writes (bounded by RUN_TIMEOUT_S)."""
    deadline = deadline or time.monotonic() + RUN_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path.name} never came")
        time.sleep(0.01)


def optimizer(config: Any, model: Any, workdir: Path, role: str, closed: bool) -> Any:
    """A trainer's `SwarmOptimizer`; `closed`: a member's (`member_optimizer`), with the
    root the parent wrote to the workdir; it then writes where a stranger finds it (its
    addresses, peer id, averagers' names)."""
    from agentjet.identity import NodeKeys
    from agentjet.keys import read_keys
    from node.dht import visible_maddrs
    from node.swarm import SwarmOptimizer

    settings = dict(lr=1e-3, weight_decay=0.0, target_batch_size=2, other_trainers=lambda: 1)
    if not closed:
        return SwarmOptimizer(config, model.parameters(), **settings)
    keys = NodeKeys.from_root(read_keys(workdir / "root.keys"), f"trainer-{role}")
    swarm = member_optimizer(config, keys, model.parameters(), **settings)
    found = {
        "maddrs": visible_maddrs(swarm.dht),
        "peer_id": str(swarm.dht.peer_id),
        "namespaces": namespaces(swarm),
    }
    (workdir / f"{role}-found.json").write_text(json.dumps(found))
    return swarm


def member_optimizer(config: Any, keys: Any, params: Any, **settings: Any) -> Any:
    """A trainer's optimizer in a swarm with keys, as node/trainer.py makes it: its DHT
    admitting the root's certificates, its peer id bound to its certificate, its averagers
    behind the member gate. The DHT is the caller's to shut down after the optimizer."""
    from node.dht import start_dht
    from node.directory import Directory
    from node.members import MemberGate
    from node.swarm import SwarmOptimizer

    dht = start_dht(config, keys)
    Directory(dht, config).declare_member(keys.identity, str(dht.peer_id))
    gate = MemberGate(dht, config.run_id, keys.membership.root_public)
    return SwarmOptimizer(config, params, dht=dht, gate=gate, **settings)


def namespaces(swarm: Any) -> dict[str, str]:
    """The namespaces of a trainer's averagers (derived from the run id: public)."""
    return {
        "state": swarm.optimizer.state_averager.prefix,
        "grad": swarm.optimizer.grad_averager.prefix,
    }


def stranger(workdir: Path) -> None:
    """A stranger's own hivemind peer at the trainers' averaging handlers, over and over,
    until both trainers are done; writes what it tried and what it got."""
    from hivemind.p2p import P2P, PeerID

    found = {}
    for role in "ab":
        wait_for_file(workdir / f"{role}-found.json")
        found[role] = json.loads((workdir / f"{role}-found.json").read_text())
    got: dict[str, list[Any]] = {"download": [], "join": [], "aggregate": []}
    tries = 0  # each a state download, a round join and an all-reduce part, at once

    async def pester() -> None:
        nonlocal tries
        maddrs = [m for each in found.values() for m in each["maddrs"]]
        p2p = await P2P.create(initial_peers=maddrs)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                for role, each in found.items():
                    if (workdir / f"{role}.json").exists():
                        continue  # done: it shuts down
                    peer = PeerID.from_base58(each["peer_id"])
                    try:
                        calls = await stranger_calls(p2p, peer, each["namespaces"])
                    except Exception:
                        if (workdir / f"{role}.json").exists():
                            continue  # it finished during the calls
                        raise
                    tries += 1
                    for call, answers in calls.items():
                        got[call] += answers
                    (workdir / "stranger-ready").touch()  # trainers start after a first try
                if all((workdir / f"{r}.json").exists() for r in "ab"):
                    return
            raise SystemExit("the trainers never finished")
        finally:
            await p2p.shutdown()

    asyncio.run(pester())
    (workdir / "stranger.json").write_text(
        json.dumps(
            {
                "round_joins": 2 * tries,  # matchmaking and all-reduce
                "state_downloads": tries,
                "accepted": accepted(got),
                "state_bytes_received": sum(len(m) for m in got["download"]),
            }
        )
    )


async def stranger_calls(
    p2p: Any, peer: Any, namespaces: dict[str, str], attempts: int = 1
) -> dict[str, list[Any]]:
    """What a stranger's own libp2p peer `p2p` gets from `peer`'s averaging handlers (the
    namespaces of its state and gradient averagers, derived from the run id: public): a
    state download, a round join and an all-reduce part (at once), `attempts` times.
    "download" lists the serialized messages of state received, "join" and "aggregate"
    the codes answered ("reset": the stream cut before a reply)."""
    from hivemind.proto import averaging_pb2

    from node.averagers import ExactGradientAverager, WholeStateAverager

    got: dict[str, list[Any]] = {"download": [], "join": [], "aggregate": []}

    async def download() -> None:
        state = WholeStateAverager.get_stub(p2p, peer, namespace=namespaces["state"])
        stream = await state.rpc_download_state(averaging_pb2.DownloadRequest())
        got["download"] += [message.SerializeToString() async for message in stream]

    async def join() -> None:
        grads = ExactGradientAverager.get_stub(p2p, peer, namespace=namespaces["grad"])
        request = averaging_pb2.JoinRequest(schema_hash=b"", expiration=time.time() + 30)
        stream = await grads.rpc_join_group(request)
        got["join"] += [message.code async for message in stream]

    async def aggregate() -> None:
        grads = ExactGradientAverager.get_stub(p2p, peer, namespace=namespaces["grad"])

        async def parts() -> Any:
            yield averaging_pb2.AveragingData(group_id=b"stranger", weight=1.0)

        try:
            stream = await grads.rpc_aggregate_part(parts())
            got["aggregate"] += [message.code async for message in stream]
        except (ConnectionResetError, BrokenPipeError):  # refused before its part was read:
            got["aggregate"].append("reset")  # the stream is cut (reset, or closed first)

    for _ in range(attempts):
        await asyncio.gather(download(), join(), aggregate())
    return got


def accepted(got: dict[str, list[Any]]) -> int:
    """How many of a stranger's calls got anything but a refusal."""
    from hivemind.proto import averaging_pb2

    return (
        len(got["download"])
        + sum(code != averaging_pb2.NOT_LOOKING_FOR_GROUP for code in got["join"])
        + sum(code not in (averaging_pb2.PROTOCOL_VIOLATION, "reset") for code in got["aggregate"])
    )


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


def across(first: Path, second: Path) -> dict[str, object]:
    """Two runs' weights, version by version, for each trainer (lock step: the same)."""
    import torch

    compared, identical, largest = 0, 0, 0.0
    for path in sorted(first.glob("[ab]-*.pt")):
        other = second / path.name
        if not other.exists():
            continue
        a, b = torch.load(path), torch.load(other)
        diff = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
        compared += 1
        identical += diff == 0.0
        largest = max(largest, diff)
    return {"versions_compared": compared, "versions_identical": identical,
            "max_abs_difference": largest}  # fmt: skip


def run_once(workdir: Path, args: argparse.Namespace, roles: str) -> dict[str, object]:
    """One run of `roles` (trainers a and b, the stranger s) in `workdir`, compared."""
    flags = [
        "--epochs", str(args.epochs), "--grad-compression", args.grad_compression,
        "--average-state-every", str(args.average_state_every),
        *(["--stock"] if args.stock else []), *(["--stranger"] if args.stranger else []),
        *(["--with-stranger"] if "s" in roles else []),
    ]  # fmt: skip
    started = time.monotonic()
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--role", role, "--workdir", str(workdir), *flags],
            stdout=subprocess.DEVNULL,
            stderr=(workdir / f"{role}.log").open("wb"),
        )
        for role in roles
    ]
    try:
        codes = [c.wait(timeout=RUN_TIMEOUT_S + 60) for c in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    if any(codes):
        failed = roles[next(i for i, c in enumerate(codes) if c)]
        tail = (workdir / f"{failed}.log").read_text()[-2000:]
        raise SystemExit(f"{failed} failed (exit codes {codes}):\n{tail}")
    result = compare(workdir) | {"seconds": round(time.monotonic() - started, 1)}
    if "s" in roles:
        result["stranger"] = json.loads((workdir / "stranger.json").read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grad-compression", choices=["none", "fp16"], default="none")
    parser.add_argument("--average-state-every", type=int, default=1)
    parser.add_argument("--stock", action="store_true", help="hivemind's own all-reduce")
    parser.add_argument(
        "--stranger",
        action="store_true",
        help="closed swarm in lock step, each run a pair: without, then with a stranger",
    )
    parser.add_argument(
        "--keep-traces", type=Path, help="where to copy the step traces of a run that differed"
    )
    parser.add_argument("--role", choices=["a", "b", "s"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--with-stranger", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "s":
        stranger(args.workdir)
        return
    if args.role:
        trainer(args.role, args.workdir, args)
        return
    results = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="aj-identity-") as tmp:
            workdir = Path(tmp)
            if args.stranger:
                from agentjet.keys import write_keys

                alone, joined = workdir / "alone", workdir / "with-stranger"
                alone.mkdir()
                joined.mkdir()
                write_keys(alone / "root.keys")
                shutil.copy(alone / "root.keys", joined / "root.keys")
                results.append(run_once(alone, args, "ab"))
                results.append(run_once(joined, args, "abs"))
                results[-1]["with_stranger"] = across(alone, joined)
            else:
                results.append(run_once(workdir, args, "ab"))
            across_runs = results[-1].get("with_stranger", {})
            differed = results[-1]["differing_versions"] or across_runs.get(
                "versions_identical"
            ) != across_runs.get("versions_compared")
            if differed and args.keep_traces:
                kept = args.keep_traces / f"run{len(results)}"
                for trace in workdir.rglob("*-steps.jsonl"):
                    (kept / trace.parent.relative_to(workdir)).mkdir(parents=True, exist_ok=True)
                    shutil.copy(trace, kept / trace.relative_to(workdir))
    settings = {
        "epochs": args.epochs,
        "grad_compression": args.grad_compression,
        "average_state_every": args.average_state_every,
        "allreduce": "hivemind" if args.stock else "exact",
        "closed_lockstep": args.stranger,
    }
    print(json.dumps({**settings, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
