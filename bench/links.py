"""`just bench-links`: policy versions over real links, and a swarm run on each.

    root       tests/netns.py Swarmnet: every node in its own network namespace behind one
               veth, limited each way to the profile's rate with tc tbf (none: "loopback",
               the veth as it is); bytes on the wire: each veth's tx counter
    trainer    SmolLM2-135M as the trainer holds it (float32), trained between versions
               by AdamW at the trainer's default lr on a language-model loss over random
               tokens (real steps: what changes between versions is what a step changes);
               each version as rollout nodes sample with it (--dtype, bfloat16 by default:
               model.dtype) made and sealed as node/trainer_versions.py makes it, with its
               delta from the version before (node/delta.py), behind a node/publisher.py
               Publisher. A second trainer holds LoRA adapters (rank 8) and serves those.
    rollout    what node/policy_sync.py does: PolicyQuery over CURVE, then its
               `fetch_into`: the delta when it holds the version it changes (else the
               version whole), from the trainer and the other nodes' relays, every chunk
               checked, a delta rebuilt as it arrives and checked against the version's
               manifest; its RelayServer serves what it fetches meanwhile
    trials     per profile, N = 1 and 4 nodes (--nodes): "full" (the version whole),
               "delta" (nodes holding the version before), "lora" (the adapters whole).
               all_have_s: from the command to fetch until the last node holds the version,
               checked; floor_s: what it fetched (version or delta bytes) / the link's rate,
               the least any node's link can take; then each node's sha256 of its bytes
               must be the trainer's.
    density    per version: the share of values that changed, in float32 and bfloat16, and
               the delta's size as a share of the version's, in both (--density-versions)
    swarm      per profile, bench/links_swarm.py: coordinator, trainer and 2 rollout nodes
               by the README's commands, --swarm-minutes of training (0: none)

Needs root (namespaces, tc). Results: bench/results/links.json (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import uvloop  # noqa: E402
from relay import lines, serving_versions  # noqa: E402
from swarm import (  # noqa: E402
    STARTUP_TIMEOUT_S,
    BenchError,
    Child,
    Children,
    Commands,
    emit,
    machine_notes,
    message_channel,
    prepare_model,
)

from agentjet import protocol  # noqa: E402
from agentjet.bridge import blocking  # noqa: E402
from agentjet.config import ModelConfig, NetConfig, TrainerConfig  # noqa: E402
from agentjet.errors import ProtocolError  # noqa: E402
from agentjet.identity import read_node_keys  # noqa: E402
from agentjet.keys import write_keys  # noqa: E402
from agentjet.transport import Client, PeerUnavailable, Server  # noqa: E402
from node import delta  # noqa: E402
from node.lora import add_adapters  # noqa: E402
from node.model import load_causal_lm  # noqa: E402
from node.policy_sync import fetch_into  # noqa: E402
from node.relay import RelayPeer, RelayServer  # noqa: E402
from node.trainer_link import Superseded  # noqa: E402
from node.weights import (  # noqa: E402
    PolicySnapshot,
    SpareBuffer,
    WeightAssembly,
    chunked,
    snapshot,
    to_safetensors,
)
from tests.hostile_relay import CorruptingRelay  # noqa: E402
from tests.netns import Swarmnet, netns_available  # noqa: E402

# --faults: r1's link is cut once the trainer sent this much of the delta, for
# CUT_TIMEOUTS times --timeout-s: its requests time out on both the sealed endpoint and the
# trainer's socket, and the fetch is done again.
CUT_AFTER_BYTES = 64 << 10
CUT_TIMEOUTS = 3
WATCH_S = 0.02
# A fetch interrupted (a cut link) is tried again this many times at most.
FETCH_ATTEMPTS = 10
# A trial's nodes all hold the version within this, or the bench fails.
TRIAL_TIMEOUT_S = 1200.0
# A training step and a version made (SmolLM2-135M, 2 cores) take well under this.
PUBLISH_TIMEOUT_S = 600.0
PROFILES = {"loopback": None, "1gbit": 1000.0, "100mbit": 100.0, "20mbit": 20.0}
BATCH, TOKENS = 4, 64  # the training step's random tokens
LORA = ModelConfig(lora_rank=8)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ── child side ───────────────────────────────────────────────────────────────────


class Synthetic(torch.nn.Module):
    """Random weights of `mbytes` (float32), for the fault runs: no model to load."""

    def __init__(self, mbytes: float) -> None:
        super().__init__()
        count = int(mbytes * (1 << 20)) // 4
        self.w = torch.nn.Parameter(torch.randn(count, generator=torch.Generator().manual_seed(0)))


class Training:
    """The model as a trainer holds it, stepped between versions (random weights: each
    step adds noise that changes about half of them in bfloat16)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        torch.manual_seed(0)
        self.optimizer: torch.optim.Optimizer | None = None
        self.before: dict[str, torch.Tensor] | None = None  # the trainable values, float32
        if settings.get("mbytes"):
            self.model: Any = Synthetic(settings["mbytes"])
            return
        self.model, _ = load_causal_lm(settings["model_dir"])
        if settings["lora"]:
            self.model = add_adapters(self.model, LORA)
        params = [p for p in self.model.parameters() if p.requires_grad]
        trainer = TrainerConfig()
        self.optimizer = torch.optim.AdamW(params, lr=trainer.lr, weight_decay=trainer.weight_decay)
        self.vocab = int(self.model.config.vocab_size)

    def step(self) -> None:
        if self.optimizer is None:
            with torch.no_grad():
                self.model.w.add_(torch.randn_like(self.model.w), alpha=0.004)
            return
        ids = torch.randint(self.vocab, (BATCH, TOKENS))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def density(self) -> dict[str, float]:
        """The share of trainable values the last step changed, as float32 and bfloat16
        (nothing before the first step), and the delta's share of a version in each."""
        now = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        before, self.before = self.before, now
        if before is None:
            return {}
        total = sum(t.numel() for t in now.values())
        out: dict[str, float] = {}
        for name, dtype in DTYPES.items():
            changed = sum(int((now[n].to(dtype) != before[n].to(dtype)).sum()) for n in now)
            old = to_safetensors(before, {}, dtype)
            new = to_safetensors(now, {}, dtype)
            made = delta.make_delta(_plain(old, 0), _plain(new, 1))
            assert made is not None
            out[f"changed_{name}"] = changed / total
            out[f"delta_share_{name}"] = len(made) / len(new)
        return out


def _plain(blob: Any, version: int) -> PolicySnapshot:
    return chunked(blob, version, NetConfig().weight_chunk_bytes, seal=False)


async def trainer_main(settings: dict[str, Any], out: TextIO) -> None:
    training = Training(settings)
    dtype = DTYPES[settings["dtype"]]
    chunk_bytes = settings["chunk_bytes"]
    first = snapshot(training.model, 0, chunk_bytes, dtype, True)
    if settings["density"]:
        training.density()
    async with serving_versions(settings, first, out) as (publisher, commands):
        while (command := await commands.get()) != "stop":
            if command != "publish":
                continue
            await blocking(training.step)
            number = publisher.published.version + 1
            publisher.retire()
            made = await blocking(snapshot, training.model, number, chunk_bytes, dtype, True)
            start = time.perf_counter()
            changes = await blocking(delta.delta_snapshot, publisher.published, made)
            delta_s = time.perf_counter() - start
            publisher.publish(made, changes)
            density = await blocking(training.density) if settings["density"] else {}
            emit(
                out,
                "published",
                version=number,
                nbytes=made.nbytes,
                delta_nbytes=changes.nbytes if changes is not None else None,
                delta_make_s=round(delta_s, 3),
                sha256=hashlib.sha256(made.stored).hexdigest(),
                **density,
            )


class Holder:
    """A rollout node's copy of one trainer's versions: the last one's checksum and bytes."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.base: tuple[str, Any] | None = None
        self.spare = SpareBuffer()


async def rollout_main(settings: dict[str, Any], out: TextIO) -> None:
    name = settings["name"]
    keys = read_node_keys(settings["keys"], name)
    limit = settings["max_message_bytes"]
    kind = CorruptingRelay if settings.get("corrupt") else RelayServer
    relay = kind(Server(f"tcp://{settings['ip']}:*", protocol.trainer_request_decoder, limit), "b")
    serving = asyncio.create_task(relay.serve())
    hello = protocol.Hello(node_id=name, role="rollout")
    holders = {
        endpoint: Holder(
            Client(
                endpoint, protocol.trainer_reply_decoder, hello, limit, settings["timeout_s"], keys
            )
        )
        for endpoint in settings["trainers"]
    }
    commands = await lines(Commands())
    emit(out, "ready", relay=relay.endpoint)
    try:
        while (command := await commands.get()) != "stop":
            if command.startswith("fetch "):
                order = json.loads(command[len("fetch ") :])
                relays = [RelayPeer(*peer) for peer in order["relays"]]
                holder = holders[order["trainer"]]
                # again after each interruption (a cut link: no answer within the client's
                # timeout), as node/policy_sync.py fetches again at its next poll
                for _ in range(FETCH_ATTEMPTS):
                    try:
                        await fetch(holder, relay, name, relays, order["whole"], out)
                        break
                    except (PeerUnavailable, ProtocolError, Superseded) as e:
                        emit(out, "interrupted", why=str(e)[:200])
                else:
                    raise BenchError(f"{name}: no fetch in {FETCH_ATTEMPTS} attempts")
    finally:
        serving.cancel()
        relay.close()
        for holder in holders.values():
            holder.client.close()


async def fetch(
    holder: Holder,
    relay: RelayServer,
    name: str,
    relays: list[RelayPeer],
    whole: bool,
    out: TextIO,
) -> None:
    """The trainer's newest version, as node/policy_sync.py fetches it (`whole`: not as a
    delta even when it could)."""
    info = await holder.client.request(protocol.PolicyQuery())
    assert isinstance(info, protocol.PolicyInfo), info
    relay.drop()
    start = time.perf_counter()
    target = WeightAssembly.of(info, holder.spare)
    stats, refused = await fetch_into(
        target, info, holder.client, relay, relays, None if whole else holder.base
    )
    if refused:
        raise BenchError(f"{name}: version {info.version}'s delta refused: {refused}")
    await blocking(target.finish)  # every chunk here and checked, or ValueError
    elapsed, done_at = time.perf_counter() - start, time.time()
    digest = await blocking(lambda blob: hashlib.sha256(blob).hexdigest(), target.blob)
    if holder.base is not None:
        holder.spare.keep(holder.base[1])
    holder.base = (info.sha256, target.blob)
    emit(
        out,
        "fetched",
        version=info.version,
        s=round(elapsed, 3),
        done_at=done_at,
        sha256=digest,
        delta=stats.delta_base >= 0,
        deltas=stats.deltas,
        fetched_bytes=stats.nbytes,
        from_trainer=stats.from_trainer,
        from_relays=stats.from_relays,
        relay_failures=stats.relay_failures,
    )


def run_child(role: str, settings: dict[str, Any]) -> int:
    out = message_channel()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    uvloop.run((trainer_main if role == "trainer" else rollout_main)(settings, out))
    return 0


# ── parent side ──────────────────────────────────────────────────────────────────


class Links:
    """Trainers (the whole model: "trainer"; its LoRA adapters: "lora") and max(--nodes)
    rollout nodes in namespaces, every link at `rate_mbit` (None: unlimited); the nodes
    named in `corrupt` serve every chunk with a bit flipped."""

    def __init__(
        self,
        args: argparse.Namespace,
        rate_mbit: float | None,
        work: Path,
        stack: ExitStack,
        trainers: tuple[str, ...] = ("trainer", "lora"),
        corrupt: tuple[str, ...] = (),
    ) -> None:
        self.rate_mbit = rate_mbit
        net = stack.enter_context(Swarmnet())
        self.children = Children(work, __file__)
        stack.callback(self.children.close)
        keys_path = work / "links.keys"
        write_keys(keys_path)
        model_dir = "" if args.mbytes else str(prepare_model("embedded", work)[1])
        common = {
            "keys": str(keys_path),
            "max_message_bytes": NetConfig().max_message_bytes,
            "chunk_bytes": int(args.chunk_kb * 1024),
            "timeout_s": args.timeout_s,
        }
        self.hosts = {name: net.add_node(name) for name in trainers}
        self.hosts |= {f"r{i}": net.add_node(f"r{i}") for i in range(1, max(args.nodes) + 1)}
        if rate_mbit is not None:
            for host in self.hosts.values():
                host.limit(rate_mbit)
        self.trainers = {}
        for name in trainers:
            settings = common | {
                "ip": self.hosts[name].ip,
                "model_dir": model_dir,
                "mbytes": args.mbytes,
                "lora": name == "lora",
                "dtype": args.dtype,
                "density": name == "trainer" and args.density,
            }
            self.trainers[name] = self.children.start(
                name, "trainer", settings, self.hosts[name].ns
            )
        self.endpoints = self.ready(list(self.trainers.values()), "endpoint")
        self.nodes = []
        for name, host in self.hosts.items():
            if name.startswith("r"):
                settings = common | {
                    "ip": host.ip,
                    "name": name,
                    "trainers": list(self.endpoints.values()),
                    "corrupt": name in corrupt,
                }
                self.nodes.append(self.children.start(name, "rollout", settings, host.ns))
        ready = self.ready(self.nodes, "relay")
        self.relays = [[child.name, ready[child.name]] for child in self.nodes]

    def ready(self, children: list[Child], key: str) -> dict[str, str]:
        """Each of `children`'s `key` in its "ready" message, by name, once all spoke."""
        ready: dict[str, str] = {}
        for child, message in self.children.messages(STARTUP_TIMEOUT_S):
            if message["event"] == "ready" and child in children:
                ready[child.name] = message[key]
            if len(ready) == len(children):
                return ready
        raise AssertionError("unreachable")

    def publish(self, trainer: str) -> dict[str, Any]:
        self.trainers[trainer].send("publish")
        return self.children.expect(self.trainers[trainer], "published", PUBLISH_TIMEOUT_S)

    def _watch(self, trainer: str, during: Callable[[int], bool] | None) -> None:
        host = self.hosts[trainer]
        before = host.tx_bytes()
        deadline = time.monotonic() + TRIAL_TIMEOUT_S
        while during is not None and time.monotonic() < deadline:
            if during(host.tx_bytes() - before):
                return
            time.sleep(WATCH_S)

    def wire_bytes(self) -> dict[str, int]:
        return {name: host.tx_bytes() for name, host in self.hosts.items()}

    def trial(
        self,
        trainer: str,
        n: int,
        published: dict[str, Any],
        form: str,
        relays: bool = True,
        whole: bool | None = None,
        during: Callable[[int], bool] | None = None,
    ) -> dict[str, Any]:
        """The first `n` nodes fetch `trainer`'s newest version (`published`) as `form`
        ("full", "delta"; the bench fails if it came otherwise); what it took. `whole`:
        tell them to fetch it whole (None: unless `form` is "delta"). `during`: called
        with the bytes the trainer sent since the start, on a thread, until it says True."""
        nodes = self.nodes[:n]
        order = json.dumps(
            {
                "trainer": self.endpoints[trainer],
                "relays": self.relays[:n] if relays else [],
                "whole": form != "delta" if whole is None else whole,
            }
        )
        before = self.wire_bytes()
        watching = threading.Thread(target=self._watch, args=(trainer, during), daemon=True)
        start = time.time()  # one clock for every namespace: the machine's
        for node in nodes:
            node.send(f"fetch {order}")
        if during is not None:
            watching.start()
        fetched: dict[str, dict[str, Any]] = {}
        interrupted: dict[str, list[str]] = {}
        for child, message in self.children.messages(TRIAL_TIMEOUT_S):
            if message["event"] == "interrupted":
                interrupted.setdefault(child.name, []).append(message["why"])
            if message["event"] == "fetched" and message["version"] == published["version"]:
                fetched[child.name] = message
            if len(fetched) == n:
                break
        if during is not None:
            watching.join()
        elapsed = max(m["done_at"] for m in fetched.values()) - start
        sent = {name: b - before[name] for name, b in self.wire_bytes().items()}
        payload = max(m["fetched_bytes"] for m in fetched.values())
        kinds = {m["delta"] for m in fetched.values()}
        if kinds != {form == "delta"}:
            raise BenchError(f"asked for {form}, fetched {fetched}")
        floor = payload * 8 / (self.rate_mbit * 1e6) if self.rate_mbit else None
        return {
            "weights": "lora" if trainer == "lora" else "model",
            "form": form,
            "n": n,
            "version": published["version"],
            "version_bytes": published["nbytes"],
            "fetched_bytes": payload,
            "all_have_s": round(elapsed, 3),
            "floor_s": round(floor, 3) if floor else None,
            "over_floor": round(elapsed / floor, 2) if floor else None,
            "trainer_wire_bytes": sent[trainer],
            "wire_bytes": sum(sent.values()),
            "exact": all(m["sha256"] == published["sha256"] for m in fetched.values()),
            "interrupted": interrupted,
            "nodes": {
                name: {k: m[k] for k in ("s", "from_trainer", "from_relays", "relay_failures")}
                for name, m in fetched.items()
            },
        }


def delivery(args: argparse.Namespace, profile: str, work: Path) -> dict[str, Any]:
    """The trials of one link profile: whole, delta and LoRA versions to 1 and N nodes."""
    rate = PROFILES[profile]
    trials: list[dict[str, Any]] = []
    densities: list[dict[str, Any]] = []
    counts = sorted(set(args.nodes))
    with ExitStack() as stack:
        links = Links(args, rate, work, stack)

        def run(trainer: str, n: int, form: str) -> None:
            published = links.publish(trainer)
            if trainer == "trainer":
                densities.append(published)
            trial = links.trial(trainer, n, published, form)
            if not trial["exact"]:
                raise BenchError(f"a node's bytes are not the trainer's: {trial}")
            trials.append(trial)
            floor = f" (floor {trial['floor_s']:.2f} s, {trial['over_floor']}x)" if rate else ""
            print(
                f"{profile} {trainer:7} {form:5} N={n}: all have it in "
                f"{trial['all_have_s']:.2f} s{floor}; "
                f"{trial['fetched_bytes'] / 1e6:.1f} MB each, "
                f"{trial['wire_bytes'] / 1e6:.1f} MB on the wire",
                flush=True,
            )

        # whole to every node; then deltas (every node holds the version before); then to
        # one node, as a delta and whole (the others skip those versions)
        for trainer in ("trainer", "lora"):
            run(trainer, max(counts), "full")
            run(trainer, max(counts), "delta")
            run(trainer, min(counts), "delta")
            run(trainer, min(counts), "full")
        for _ in range(args.density_versions):
            densities.append(links.publish("trainer"))
        links.children.stop(30.0)
    return {
        "rate_mbit": rate,
        "trials": trials,
        "density": [
            {k: d[k] for k in d if k.startswith(("changed_", "delta_share_", "version"))}
            | {"delta_share_served": (d["delta_nbytes"] or 0) / d["nbytes"]}
            for d in densities
        ],
        "delta_make_s": [d["delta_make_s"] for d in densities],
    }


def faults(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """FAULTS: on links of --rate-mbit, nodes r1 and r2 (r2's relay corrupts what it
    serves): both fetch v1 whole; both fetch v2 as a delta through each other's relay (r1
    refuses every chunk r2 serves, and takes it from the trainer); r1 fetches v3's delta
    while its link is cut (CUT_TIMEOUTS: its requests time out, the fetch is done again); r1
    misses ten versions behind a cut link, then fetches the newest (whole: it holds no
    base for its delta), then the next (a delta again). Every fetch must end with the
    trainer's bytes (the bench fails otherwise)."""
    out: dict[str, Any] = {"settings": vars(args) | {"out": str(args.out)}}
    with ExitStack() as stack:
        links = Links(args, args.rate_mbit, work, stack, trainers=("trainer",), corrupt=("r2",))
        r1 = links.hosts["r1"]
        out["both_whole"] = links.trial("trainer", 2, links.publish("trainer"), "full")
        out["delta_past_a_corrupt_relay"] = links.trial(
            "trainer", 2, links.publish("trainer"), "delta"
        )
        published = links.publish("trainer")

        def cut_once_under_way(sent: int) -> bool:
            if sent < CUT_AFTER_BYTES:
                return False
            r1.link_down()
            time.sleep(CUT_TIMEOUTS * args.timeout_s)  # (the cut: what follows it is measured)
            r1.link_up()
            return True

        out["delta_across_a_cut"] = links.trial(
            "trainer", 1, published, "delta", relays=False, during=cut_once_under_way
        )
        r1.link_down()
        for _ in range(10):
            published = links.publish("trainer")
        r1.link_up()
        out["after_missing_ten"] = links.trial("trainer", 1, published, "full", whole=False)
        out["then_a_delta"] = links.trial("trainer", 1, links.publish("trainer"), "delta")
        links.children.stop(30.0)
    return out


def summary(profiles: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The numbers the issue's targets name, per profile."""
    out: dict[str, Any] = {}
    for name, result in profiles.items():
        trials = result["delivery"]["trials"]
        model = [t for t in trials if t["weights"] == "model"]
        by = {(t["form"], t["n"]): t for t in model}
        full = next(t for t in model if t["form"] == "full")
        out[name] = (
            {f"{form}_n{n}_s": t["all_have_s"] for (form, n), t in sorted(by.items())}
            | {f"{form}_n{n}_over_floor": t["over_floor"] for (form, n), t in sorted(by.items())}
            | {
                "delta_share_of_version": round(
                    max(t["fetched_bytes"] for t in model if t["form"] == "delta")
                    / full["version_bytes"],
                    4,
                )
            }
        )
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--density", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--density-versions", type=int, default=4)
    parser.add_argument("--swarm-minutes", type=float, default=10.0)
    parser.add_argument("--faults", action="store_true", help="the fault runs (FAULTS)")
    parser.add_argument("--rate-mbit", type=float, default=8.0, help="--faults' links")
    parser.add_argument("--mbytes", type=float, default=0.0, help="random weights (0: SmolLM2)")
    parser.add_argument("--chunk-kb", type=float, default=NetConfig().weight_chunk_bytes / 1024)
    parser.add_argument("--timeout-s", type=float, default=NetConfig().request_timeout_s)
    parser.add_argument("--set", action="append", default=[], help="swarm config KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "links.json")
    parser.add_argument("--child", default="")
    parser.add_argument("--settings", default="{}")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.child:
        return run_child(args.child, json.loads(args.settings))
    reason = netns_available()
    if reason is not None:
        print(f"bench-links needs network namespaces: {reason}", file=sys.stderr)
        return 2
    if args.faults:
        work = Path(tempfile.mkdtemp(prefix="bench-links-faults-"))
        result = faults(args, work)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        shutil.rmtree(work, ignore_errors=True)
        return 0
    started = time.time()
    profiles: dict[str, dict[str, Any]] = {}
    for profile in args.profiles:
        work = Path(tempfile.mkdtemp(prefix=f"bench-links-{profile}-"))
        profiles[profile] = {"delivery": delivery(args, profile, work)}
        if args.swarm_minutes > 0:
            from links_swarm import run_swarm

            rate = PROFILES[profile]
            profiles[profile]["swarm"] = run_swarm(rate, args.swarm_minutes, work, args.set)
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "summary": summary(profiles),
        "profiles": profiles,
        "settings": {
            "dtype": args.dtype,
            "nodes": args.nodes,
            "chunk_bytes": NetConfig().weight_chunk_bytes,
            "swarm_minutes": args.swarm_minutes,
            "swarm_settings": args.set,
            "machine": machine_notes(),
            "wall_s": round(time.time() - started),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
