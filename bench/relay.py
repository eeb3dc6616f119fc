"""`just bench-relay`: how long until N rollout nodes all hold a new policy version, and
what the trainer sent for it, with relays (node/relay.py) and without ("star": each node
from the trainer), every link limited with tc.

    root         tests/netns.py Swarmnet: a trainer and N rollout nodes, each in its own
                 network namespace behind one veth limited to --rate-mbit each way (tc tbf)
    trainer      SmolLM2-135M's weights as a trainer makes a version (node/weights.py,
                 sealed: the swarm's keys) behind a node/publisher.py Publisher: PolicyQuery
                 and chunks over CURVE, sealed chunks on its sealed endpoint; a fresh
                 version per trial (--mbytes: random weights of that size instead)
    rollout      what node/rollout.py does with a version: PolicyQuery over CURVE, then
                 node/relay.py fetch_relayed into a WeightAssembly (the last one's buffer
                 reused), which its RelayServer serves to the others meanwhile
    trial        publish; tell N nodes to fetch at once (PolicyQuery, then the chunks);
                 all_have_s: until the last one holds every chunk, checked against the
                 manifest; then each node's sha256 of its bytes must be the trainer's;
                 trainer_bytes: what the trainer's link carried out meanwhile (its veth's
                 counter: payload and ZMQ/TCP framing)

N = 1, 2, 4, 8 (--nodes), relay and star, --repeats trials each (the median counts).
--faults: 4 nodes, relays on; one is SIGKILLed once it has passed a chunk on, one serves
every chunk with a bit flipped. The others must end with the trainer's bytes; exit 1 when
one does not. tests/integration/test_relay.py runs it small.
Needs root (namespaces, tc). Results: bench/results/relay.json (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import uvloop  # noqa: E402
from swarm import (  # noqa: E402
    STARTUP_TIMEOUT_S,
    BenchError,
    Children,
    Commands,
    answer_requests,
    emit,
    machine_notes,
    message_channel,
    prepare_model,
)

from agentjet import protocol  # noqa: E402
from agentjet.bridge import blocking  # noqa: E402
from agentjet.config import NetConfig  # noqa: E402
from agentjet.identity import read_node_keys  # noqa: E402
from agentjet.keys import write_keys  # noqa: E402
from agentjet.transport import Client, Server  # noqa: E402
from node.model import load_causal_lm  # noqa: E402
from node.publisher import Publisher  # noqa: E402
from node.relay import RelayPeer, RelayServer, fetch_relayed  # noqa: E402
from node.weights import (  # noqa: E402
    PolicySnapshot,
    SpareBuffer,
    WeightAssembly,
    chunked,
    to_safetensors,
)
from tests.hostile_relay import CorruptingRelay  # noqa: E402
from tests.netns import Swarmnet, netns_available  # noqa: E402

# A trial's nodes all hold the version within this, or the bench fails.
TRIAL_TIMEOUT_S = 900.0


# ── child side ───────────────────────────────────────────────────────────────────


async def lines(reader: Commands) -> asyncio.Queue[str]:
    """The parent's commands as they come; "stop" when its pipe closes."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def readable() -> None:
        for line in reader.read(0):
            queue.put_nowait(line)
        if reader.closed:
            loop.remove_reader(reader.fd)
            queue.put_nowait("stop")

    loop.add_reader(reader.fd, readable)
    return queue


def weights(settings: dict[str, Any]) -> dict[str, torch.Tensor]:
    if settings["mbytes"]:
        count = int(settings["mbytes"] * (1 << 20)) // 4
        return {"w": torch.randn(count, generator=torch.Generator().manual_seed(0))}
    model, _ = load_causal_lm(settings["model_dir"])
    return {name: p.detach() for name, p in model.named_parameters()}


def make_version(
    tensors: dict[str, torch.Tensor], version: int, chunk_bytes: int
) -> tuple[PolicySnapshot, str]:
    """A sealed version as trainers make them, and the sha256 of its plain bytes."""
    blob = to_safetensors(tensors, {"policy_version": str(version)})
    digest = hashlib.sha256(blob).hexdigest()
    return chunked(blob, version, chunk_bytes, seal=True), digest


@contextlib.asynccontextmanager
async def serving_versions(
    settings: dict[str, Any], first: PolicySnapshot, out: TextIO
) -> AsyncIterator[tuple[Publisher, asyncio.Queue[str]]]:
    """A trainer's sockets on settings["ip"] serving `first`, then what is published:
    PolicyQuery and chunks over CURVE (the swarm's keys), sealed chunks on its sealed
    endpoint. Says "ready" with its endpoint; gives its Publisher and the parent's
    commands; closes both sockets after."""
    keys = read_node_keys(settings["keys"], "bench-trainer")
    limit = settings["max_message_bytes"]
    server = Server(f"tcp://{settings['ip']}:*", protocol.trainer_request_decoder, limit, keys)
    sealed = Server(f"tcp://{settings['ip']}:*", protocol.trainer_request_decoder, limit)
    publisher = Publisher(first, "bench", sealed)
    publisher.announce(server.endpoint)
    serving = [
        asyncio.create_task(answer_requests(server, publisher)),
        asyncio.create_task(publisher.serve_sealed()),
    ]
    try:
        commands = await lines(Commands())
        emit(out, "ready", endpoint=server.endpoint)
        yield publisher, commands
    finally:
        for task in serving:
            task.cancel()
        server.close()
        sealed.close()


async def trainer_main(settings: dict[str, Any], out: TextIO) -> None:
    tensors = weights(settings)
    first, _ = make_version(tensors, 0, settings["chunk_bytes"])
    async with serving_versions(settings, first, out) as (publisher, commands):
        while (command := await commands.get()) != "stop":
            if command == "publish":
                version = publisher.published.version + 1
                snap, digest = await blocking(
                    make_version, tensors, version, settings["chunk_bytes"]
                )
                publisher.publish(snap)
                emit(
                    out,
                    "published",
                    version=version,
                    nbytes=snap.nbytes,
                    num_chunks=snap.num_chunks,
                    sha256=digest,
                )


async def rollout_main(settings: dict[str, Any], out: TextIO) -> None:
    name = settings["name"]
    keys = read_node_keys(settings["keys"], name)
    limit = settings["max_message_bytes"]
    kind = CorruptingRelay if settings["corrupt"] else RelayServer
    relay = kind(Server(f"tcp://{settings['ip']}:*", protocol.trainer_request_decoder, limit), "b")
    serving = asyncio.create_task(relay.serve())
    hello = protocol.Hello(node_id=name, role="rollout")
    client = Client(settings["trainer"], protocol.trainer_reply_decoder, hello, limit, 30.0, keys)
    spare = SpareBuffer()
    commands = await lines(Commands())
    emit(out, "ready", relay=relay.endpoint)
    watching = asyncio.create_task(say_when_passed_on(relay, out))
    try:
        while (command := await commands.get()) != "stop":
            if not command.startswith("fetch "):
                continue
            relays = [RelayPeer(*peer) for peer in json.loads(command[len("fetch ") :])]
            info = await client.request(protocol.PolicyQuery())
            assert isinstance(info, protocol.PolicyInfo), info
            relay.drop()  # before its buffer is reused
            assembly = WeightAssembly.of(info, spare)
            relay.hold(assembly, info.ticket)
            start = time.perf_counter()
            stats = await fetch_relayed(assembly, info, client, name, relays)
            elapsed, done_at = time.perf_counter() - start, time.time()
            await blocking(assembly.finish)  # every chunk here and checked, or ValueError
            digest = await blocking(lambda blob: hashlib.sha256(blob).hexdigest(), assembly.blob)
            emit(
                out,
                "fetched",
                version=info.version,
                s=round(elapsed, 3),
                done_at=done_at,
                sha256=digest,
                from_trainer=stats.from_trainer,
                from_relays=stats.from_relays,
                relay_failures=stats.relay_failures,
                passed_on=relay.served,
            )
            spare.keep(assembly.blob)
            del assembly
    finally:
        watching.cancel()
        serving.cancel()
        relay.close()
        client.close()


async def say_when_passed_on(relay: RelayServer, out: TextIO) -> None:
    """One "passed_on" message, when this relay has served its first chunk."""
    while relay.served == 0:
        await asyncio.sleep(0.01)
    emit(out, "passed_on", version=relay.version)


def run_child(role: str, settings: dict[str, Any]) -> int:
    out = message_channel()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main = trainer_main if role == "trainer" else rollout_main
    uvloop.run(main(settings, out))
    return 0


# ── parent side ──────────────────────────────────────────────────────────────────


class Bench:
    """A trainer and `nodes` rollout nodes in namespaces, each link limited."""

    def __init__(self, args: argparse.Namespace, nodes: int, work: Path, stack: ExitStack):
        self.args = args
        net = stack.enter_context(Swarmnet())
        self.children = Children(work, __file__)
        stack.callback(self.children.close)
        keys_path = work / "relay.keys"
        write_keys(keys_path)
        chunk_bytes = int(args.chunk_mb * (1 << 20))
        common = {
            "keys": str(keys_path),
            "max_message_bytes": max(NetConfig().max_message_bytes, 2 * chunk_bytes),
            "chunk_bytes": chunk_bytes,
            "mbytes": args.mbytes,
        }
        self.trainer_host = net.add_node("trainer")
        hosts = [net.add_node(f"r{i}") for i in range(1, nodes + 1)]
        for host in [self.trainer_host, *hosts]:
            host.limit(args.rate_mbit)
        model_dir = "" if args.mbytes else str(prepare_model("embedded", work)[1])
        self.trainer = self.children.start(
            "trainer",
            "trainer",
            common | {"ip": self.trainer_host.ip, "model_dir": model_dir},
            self.trainer_host.ns,
        )
        endpoint = self.children.expect(self.trainer, "ready", STARTUP_TIMEOUT_S)["endpoint"]
        faults = {2: "killed", 3: "corrupt"} if args.faults else {}
        self.roles = {f"r{i}": faults.get(i, "") for i in range(1, nodes + 1)}
        self.nodes = [
            self.children.start(
                host.name,
                "rollout",
                common
                | {
                    "ip": host.ip,
                    "name": host.name,
                    "trainer": endpoint,
                    "corrupt": self.roles[host.name] == "corrupt",
                },
                host.ns,
            )
            for host in hosts
        ]
        ready: dict[str, str] = {}
        for child, message in self.children.messages(STARTUP_TIMEOUT_S):
            if message["event"] == "ready":
                ready[child.name] = message["relay"]
            if len(ready) == len(self.nodes):
                break
        self.relays = [[child.name, ready[child.name]] for child in self.nodes]

    def trial(self, n: int, relay: bool, kill: str = "") -> dict[str, Any]:
        """Publish a version; the first `n` nodes fetch it; what it took. `kill`: SIGKILL
        that node once it has passed a chunk on (it is not waited for)."""
        self.trainer.send("publish")
        published = self.children.expect(self.trainer, "published", STARTUP_TIMEOUT_S)
        nodes = self.nodes[:n]
        relays = json.dumps(self.relays[:n] if relay else [])
        sent_before = self.trainer_host.tx_bytes()
        start = time.time()  # one clock for every namespace: the machine's
        for node in nodes:
            node.send(f"fetch {relays}")
        waiting = {node.name for node in nodes}
        fetched: dict[str, dict[str, Any]] = {}
        for child, message in self.children.messages(TRIAL_TIMEOUT_S):
            if message["event"] == "passed_on" and child.name == kill and kill in waiting:
                os.kill(child.pid, signal.SIGKILL)
                child.proc.wait()  # reaped by PID here
                child.eof = True  # not read again: its end is no failure of the bench
                waiting.discard(kill)
            elif message["event"] == "fetched" and message["version"] == published["version"]:
                fetched[child.name] = message
                waiting.discard(child.name)
            if not waiting:
                break
        # until the last node held every chunk, checked (not its sha256 of the whole, which
        # is this bench's own check, below)
        elapsed = max(m["done_at"] for m in fetched.values()) - start
        sent = self.trainer_host.tx_bytes() - sent_before
        return {
            "n": n,
            "arm": "relay" if relay else "star",
            "version": published["version"],
            "version_bytes": published["nbytes"],
            "num_chunks": published["num_chunks"],
            "all_have_s": round(elapsed, 3),
            "trainer_bytes": sent,
            "exact": {name: m["sha256"] == published["sha256"] for name, m in fetched.items()},
            "nodes": {
                name: {k: m[k] for k in ("s", "from_trainer", "from_relays", "relay_failures")}
                | {"passed_on": m["passed_on"]}
                for name, m in fetched.items()
            },
        }


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    counts = sorted(set(args.nodes))
    trials: list[dict[str, Any]] = []
    with ExitStack() as stack:
        bench = Bench(args, max(counts), work, stack)
        for n in counts:
            for relay in (True, False):
                for _ in range(args.repeats):
                    trial = bench.trial(n, relay)
                    if not all(trial["exact"].values()):
                        raise BenchError(f"a node's bytes are not the trainer's: {trial}")
                    print(
                        f"N={n} {trial['arm']:5}: all have it in {trial['all_have_s']:.2f} s; "
                        f"trainer sent {trial['trainer_bytes'] / 1e6:.0f} MB "
                        f"({trial['trainer_bytes'] / trial['version_bytes']:.2f} versions)",
                        flush=True,
                    )
                    trials.append(trial)
        bench.children.stop(30.0)

    def median(n: int, arm: str, key: str) -> float:
        return statistics.median(t[key] for t in trials if t["n"] == n and t["arm"] == arm)

    version_bytes = trials[0]["version_bytes"]
    result: dict[str, Any] = {
        "n": counts,
        "all_have_s": {arm: [median(n, arm, "all_have_s") for n in counts] for arm in ARMS},
        "trainer_bytes": {
            arm: [int(median(n, arm, "trainer_bytes")) for n in counts] for arm in ARMS
        },
        "version_bytes": version_bytes,
    }
    relay_s = result["all_have_s"]["relay"]
    result["targets"] = {
        "relay_n_max_over_n1": round(relay_s[-1] / relay_s[0], 2),  # target <= 1.5
        "trainer_bytes_n_max_in_versions": round(
            result["trainer_bytes"]["relay"][-1] / version_bytes, 2
        ),  # target <= 2
    }
    return result | {"settings": settings_of(args), "trials": trials}


ARMS = ("relay", "star")


def faults(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with ExitStack() as stack:
        bench = Bench(args, 4, work, stack)
        trial = bench.trial(4, relay=True, kill="r2")
        bench.children.stop(30.0)
    survivors = {name for name, role in bench.roles.items() if role != "killed"}
    ok = set(trial["exact"]) == survivors and all(trial["exact"].values())
    return {"ok": ok, "roles": bench.roles, "trial": trial, "settings": settings_of(args)}


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "rate_mbit": args.rate_mbit,
        "chunk_mb": args.chunk_mb,
        "model": f"random weights, {args.mbytes} MiB" if args.mbytes else "SmolLM2-135M",
        "repeats": args.repeats,
        "machine": machine_notes(),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--chunk-mb", type=float, default=2.0)  # bench/LOG.md 2026-12-03
    parser.add_argument("--mbytes", type=float, default=0.0, help="random weights (0: SmolLM2)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "relay.json")
    parser.add_argument("--child", default="")
    parser.add_argument("--settings", default="{}")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.child:
        return run_child(args.child, json.loads(args.settings))
    reason = netns_available()
    if reason is not None:
        print(f"bench-relay needs network namespaces: {reason}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    result = faults(args, work) if args.faults else measure(args, work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} (children's logs in {work})")
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
