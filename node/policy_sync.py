"""One policy's versions on a rollout node: fetched from that policy's trainers, checked
chunk by chunk, loaded into the engine between batches.

    trainers of the policy ──PolicyQuery──▶ newer? (Lineage.supersedes) ──manifest + chunks──▶
    WeightAssembly (hash per chunk; from relays too; or the version's delta from the one
    fetched last, node/delta.py, applied to it) ──▶ `ready` ──load() between batches──▶
    engine: full weights (`load_state_dict`), or adapters merged into them (`AdapterMerger`),
            or, with [[policies]], the policy's adapters beside the others (`load_adapters`)

A node of a swarm with one policy holds one `PolicySync` named ""; with `[[policies]]`, one
per policy, each asking only the trainers whose records name its policy. Relays
(node/relay.py) pass on the versions of the one policy only: a relay holds one version.

A trainer whose fetch failed (no answer, a chunk that did not check) is not asked again
until the node hears from it: a record of it newer than the one it was listed with then, or
another endpoint. Its record outlives a dead trainer by record_ttl_s, and the node finds it
gone later still; asked at every poll meanwhile, it cost each one a whole
net.request_timeout_s. A fetch from a trainer the node finds gone ends then (`forget`), not
a timeout or two later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import time
from collections.abc import Callable, Mapping

import torch

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import ModelConfig, NetConfig
from agentjet.episode import Completion, SamplingParams
from agentjet.logs import RepeatedLog
from agentjet.metrics import MetricsWriter
from agentjet.roles import wait_for
from agentjet.transport import Client, PeerUnavailable
from node import delta as deltas
from node import memory
from node.delivery import TrainerPeer
from node.engine import Engine
from node.lora import AdapterMerger
from node.relay import FetchStats, RelayPeer, RelayServer, fetch_relayed
from node.trainer_link import Superseded
from node.weights import SpareBuffer, WeightAssembly

log = logging.getLogger(__name__)

# How often the node asks the policy's trainers for a newer version (acks also announce one).
POLICY_POLL_S = 1.0

# A fetched version waiting for the batch in progress to end: lineage, version, checksum,
# its tensors and the buffer they are views of (None: the trainer's memory, mapped).
ReadyWeights = tuple[protocol.Lineage, int, str, dict[str, torch.Tensor], mmap.mmap | None]


class PolicySync:
    """The versions of policy `name` ("" = the swarm's one policy) on this node's engine."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        lora: ModelConfig,
        net: NetConfig,
        metrics: Callable[[], MetricsWriter],
    ) -> None:
        self.name = name
        self.engine = engine
        self.lora = lora  # the policy's model config (its LoRA settings)
        self.net = net
        self.metrics = metrics  # (made after this part: the node's writer, when it writes)
        # The lineage of the policy's weights in the engine (protocol.Lineage; "" = base).
        self.lineage = protocol.Lineage()
        # A complete, verified version waiting to be loaded between batches.
        self.ready: ReadyWeights | None = None
        self.spare = SpareBuffer()  # the buffer of the version loaded last
        # The checksum and bytes of the version fetched last (None: mapped, or none yet):
        # what the next version's delta changes.
        self.base: tuple[str, mmap.mmap] | None = None
        self.deltas_refused = 0  # deltas that did not make their version (fetched whole)
        self.newer = asyncio.Event()  # a trainer of this policy reported a newer version
        # Trainers whose last fetch failed, each with the client it was asked on and its
        # heartbeat then (None: a trainer without records, of a config without --join).
        self.failed: dict[str, tuple[Client, float | None]] = {}
        self.fetching: tuple[str, asyncio.Task[bool]] | None = None  # from whom, the fetch
        # A trainer of a config without --join is asked at every poll, dead or not.
        self.interrupted_log = RepeatedLog(
            log,
            "policy fetch from {detail}; asked again once that trainer is heard from",
            "{count} more policy fetches interrupted in the last {seconds:.0f} s; the last "
            "from {detail}",
            level=logging.INFO,
        )
        self.merger: AdapterMerger | None = None
        if not name and lora.lora_rank and not engine.takes_adapters:
            self.merger = AdapterMerger(engine.state_dict(), lora)

    @property
    def version(self) -> int:
        """The version of this policy the engine samples with (0: the base weights)."""
        if not self.name:
            return self.engine.policy_version
        return self.engine.policy_versions.get(self.name, 0)

    def serves(self, trainer: TrainerPeer) -> bool:
        return trainer.policy == self.name

    def saw(self, version: int) -> None:
        """A trainer of this policy is at `version`: fetch it if it is newer."""
        if version > self.version:
            self.newer.set()

    async def run(
        self,
        trainers: Mapping[str, TrainerPeer],
        clients: Mapping[str, Client],
        relaying: Callable[[], tuple[RelayServer | None, list[RelayPeer]]],
        heartbeats: Mapping[str, float] | None = None,
    ) -> None:
        """Fetch each newer version: from the trainer of this policy with the newest version
        (the least loaded of those), or the next when it does not answer (its record can
        outlive it by record_ttl_s). `trainers`, `clients` and `heartbeats` (the time of
        each trainer's newest record) are the node's, kept current by it; `relaying` gives
        its relay server and the other nodes' relays."""
        while True:
            with contextlib.suppress(TimeoutError):
                await wait_for(self.newer.wait(), POLICY_POLL_S)
            self.newer.clear()
            await self.poll(trainers, clients, relaying, {} if heartbeats is None else heartbeats)

    async def poll(
        self,
        trainers: Mapping[str, TrainerPeer],
        clients: Mapping[str, Client],
        relaying: Callable[[], tuple[RelayServer | None, list[RelayPeer]]],
        heartbeats: Mapping[str, float],
    ) -> None:
        """Ask this policy's trainers, newest version first, until one answers; those that
        failed their last fetch only once heard from since (`_silent`)."""
        self.failed = {t: f for t, f in self.failed.items() if clients.get(t) is f[0]}
        mine = [t for t in trainers.values() if self.serves(t)]
        for source in sorted(mine, key=lambda t: (-t.policy_version, t.queue)):
            client = clients.get(source.node_id)
            if client is None:  # gone while an earlier source was asked
                continue
            if self._silent(source.node_id, client, heartbeats):
                continue
            heard = heartbeats.get(source.node_id)
            live = [t.lineage for t in trainers.values() if self.serves(t)]
            if await self._fetch_from_listed(source.node_id, client, live, *relaying()):
                self.failed.pop(source.node_id, None)
                break
            self.failed[source.node_id] = (client, heard)

    def _silent(self, trainer_id: str, client: Client, heartbeats: Mapping[str, float]) -> bool:
        """Whether `trainer_id` failed its last fetch and nothing since says it is back: the
        same endpoint (`client`), no newer record. (One without records is asked again.)"""
        failed = self.failed.get(trainer_id)
        if failed is None:
            return False
        failed_client, heard = failed
        if failed_client is not client or heard is None:
            return False
        return heartbeats.get(trainer_id, heard) <= heard

    def forget(self, trainer_id: str) -> None:
        """The node found trainer `trainer_id` gone: a fetch from it in flight ends now.
        (Left to itself it waited out net.request_timeout_s on the trainer's sealed
        endpoint, then again on its socket: a minute against a dead trainer.)"""
        if self.fetching is not None and self.fetching[0] == trainer_id:
            self.fetching[1].cancel()

    async def _fetch_from_listed(
        self,
        source: str,
        client: Client,
        live: list[protocol.Lineage],
        relay: RelayServer | None,
        relays: list[RelayPeer],
    ) -> bool:
        """`fetch`, given up (False) if the node finds `source` gone meanwhile (`forget`)."""
        task = asyncio.create_task(
            self.fetch(source, client, live, relay, relays), name=f"policy-fetch-{source}"
        )
        self.fetching = (source, task)
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise
        finally:
            self.fetching = None
        if task.cancelled():
            log.info("policy fetch from %s given up: the trainer is gone", source)
            return False
        return task.result()

    async def fetch(
        self,
        source: str,
        client: Client,
        live: list[protocol.Lineage],
        relay: RelayServer | None = None,
        relays: list[RelayPeer] | None = None,
    ) -> bool:
        """Fetch the version `client`'s trainer serves when it supersedes the newest this
        node has (`Lineage.supersedes`, against the `live` trainers' lineages) into `ready`;
        False when the trainer did not answer."""
        if self.name:
            relay, relays = None, []  # (a relay holds one policy's version)
        try:
            lineage, version = self.lineage, self.version
            if self.ready is not None:
                lineage, version = self.ready[0], self.ready[1]
            for manifest in (False, True):  # a poll; the manifest only of a newer version
                info = await client.request(protocol.PolicyQuery(manifest=manifest))
                if not isinstance(info, protocol.PolicyInfo):
                    return True
                if not info.lineage.supersedes(info.version, lineage, version, live):
                    return True
            started = time.perf_counter()
            if relay is not None:
                relay.drop()  # before its buffer is reused for this version
            # On the trainer's host its memory is mapped (checked as fetched chunks are).
            assembly = None
            if self.net.map_local:
                assembly = await blocking(WeightAssembly.mapped, info)
            fetched = FetchStats()
            if assembly is None:
                assembly = WeightAssembly.of(info, self.spare)
                fetched = await self._fetch_bytes(assembly, info, client, relay, relays or [])
            self.fetching = None  # every chunk is in: the trainer's death no longer matters
            state = await blocking(assembly.finish)
            if self.merger is not None:  # LoRA: adapters arrive, this engine takes weights
                state = await blocking(self.merger.merge, state, self.engine.state_dict())
        except Superseded:
            # Two steps overtook this fetch: fetch the newest at once.
            log.info("policy version %d superseded while fetched", info.version)
            self.newer.set()
            return True
        except (PeerUnavailable, ValueError) as e:
            self.interrupted_log.note(f"{source} interrupted ({e})")
            return False
        # (a mapping of the trainer's memory is no buffer for a later fetch to write into)
        buffer = None if assembly.local else assembly.blob
        self.base = None if buffer is None else (info.sha256, buffer)
        self.ready = (info.lineage, info.version, info.sha256, state, buffer)
        self.metrics().write(
            {
                "event": "weights_fetched",
                **({"policy": self.name} if self.name else {}),
                "policy_version": info.version,
                "lineage": info.lineage.id,
                "mapped": assembly.local,
                # from the manifest to the version checked (its merge with LoRA included)
                "perf/fetch_s": round(time.perf_counter() - started, 3),
                "chunks_from_trainer": fetched.from_trainer,
                "chunks_from_relays": fetched.from_relays,
                "relays_given_up": len(fetched.relay_failures),
                # bytes fetched (0: mapped): the version, or the `deltas` from `delta_from`
                "fetched_bytes": fetched.nbytes,
                "version_bytes": info.nbytes,
                **(
                    {"delta_from": fetched.delta_base, "deltas": fetched.deltas}
                    if fetched.delta_base >= 0
                    else {}
                ),
                "deltas_refused": self.deltas_refused,
                # what this node's relay did for the others, since it started
                **({"relay/served": relay.served, "relay/refused": relay.refused} if relay else {}),
            }
        )
        return True

    async def _fetch_bytes(
        self,
        assembly: WeightAssembly,
        info: protocol.PolicyInfo,
        client: Client,
        relay: RelayServer | None,
        relays: list[RelayPeer],
    ) -> FetchStats:
        """`fetch_into`, its refused deltas counted and said."""
        fetched, refused = await fetch_into(assembly, info, client, relay, relays, self.base)
        if refused:
            self.deltas_refused += 1
            log.warning(
                "policy version %d: its delta did not make it (%s); fetched it whole",
                info.version,
                refused,
            )
        return fetched

    async def load(self) -> None:
        """Load the version fetched, if there is one (between batches, never mid-episode)."""
        ready = self.ready
        if ready is None:
            return
        lineage, version, sha256, state, buffer = ready
        start = time.perf_counter()
        # Left in `ready` while it loads, so the fetch task, comparing against it, does not
        # fetch and load the same version again meanwhile.
        if self.name:
            await self.engine.load_adapters(self.name, state, self.lora, version)
        else:
            await self.engine.load_state_dict(state, version)
        if self.ready is ready:
            self.ready = None  # (one fetched meanwhile is newer: the next batch's)
        del state, ready
        if buffer is not None:
            self.spare.keep(buffer)  # for a next fetch, once no tensor of it lives
        del buffer  # (a name of it here would keep the next fetch from taking it)
        if lineage != self.lineage:
            log.info(
                "policy %slineage %s -> %s (version %d)",
                f"{self.name} " if self.name else "",
                self.lineage.id or "base",
                lineage.id,
                version,
            )
        self.lineage = lineage
        self.metrics().write(
            {
                "event": "weights_loaded",
                **({"policy": self.name} if self.name else {}),
                "policy_version": version,
                "lineage": lineage.id,
                "policy_sha256": sha256,
                "perf/load_s": time.perf_counter() - start,
            }
        )
        await blocking(memory.trim)  # what the batches freed


async def fetch_into(
    assembly: WeightAssembly,
    info: protocol.PolicyInfo,
    client: Client,
    relay: RelayServer | None,
    relays: list[RelayPeer],
    base: tuple[str, mmap.mmap] | None,
) -> tuple[FetchStats, str]:
    """The version `info` announces into `assembly`, from its trainer (`client`) and the
    `relays`, served meanwhile by this node's `relay`: as the deltas that make it from
    `base` (the checksum and bytes of the version this node fetched last) when the
    trainer serves them (`fetch_chain`); else whole. What deltas did not make right is
    fetched whole (the chunks they made right are kept): then also why, second ("": no
    delta refused). Raises what node/relay.py `fetch_relayed` raises."""
    refused = ""
    if info.deltas and base is not None:
        try:
            chain = deltas.chain_from(info, base[0])
            if chain:
                return await fetch_chain(assembly, info, chain, client, relay, relays, base), ""
        except ValueError as e:
            refused = f"its deltas: {e}"
    if relay is not None:
        relay.hold(assembly, info.ticket)
    return await fetch_relayed(assembly, info, client, client.hello.node_id, relays), refused


async def fetch_chain(
    assembly: WeightAssembly,
    info: protocol.PolicyInfo,
    chain: list[protocol.DeltaManifest],
    client: Client,
    relay: RelayServer | None,
    relays: list[RelayPeer],
    base: tuple[str, mmap.mmap],
) -> FetchStats:
    """`assembly`'s version made from `base` by the deltas of `chain` (node/delta.py
    `chain_from`), fetched one after the other (each held by this node's relay while it
    comes), the first written from `base`, the next ones over it in place, the last
    rebuilt while it arrives and checked against the version's manifest. ValueError when
    they do not make it."""
    total = FetchStats(delta_base=chain[0].base, deltas=len(chain))
    source: mmap.mmap = base[1]
    for delta in chain:
        changes = deltas.delta_assembly(delta)
        last = delta is chain[-1]
        rebuild = deltas.Rebuild(assembly, source, changes, delta.base_sha256, check=last)
        if relay is not None:
            relay.hold(changes, delta.ticket)
        fetching = fetch_relayed(
            changes, deltas.delta_info(info, delta), client, client.hello.node_id, relays
        )
        fetched = await deltas.rebuilt_while_fetched(rebuild, fetching)
        total.from_trainer += fetched.from_trainer
        total.from_relays += fetched.from_relays
        total.relay_failures |= fetched.relay_failures
        total.nbytes += fetched.nbytes
        source = assembly.blob
    return total


class PolicyView:
    """An engine as an environment of one policy sees it (agentjet/episode.py `Generator`):
    its prompts sampled with that policy's adapters (the base weights until its first
    version arrives), its samples tagged with that policy's version."""

    def __init__(self, engine: Engine, policy: str) -> None:
        self.engine = engine
        self.policy = policy
        self.tokenizer = engine.tokenizer

    @property
    def policy_version(self) -> int:
        return self.engine.policy_versions.get(self.policy, 0)

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        policies = adapters_for(self.engine, [self.policy] * len(prompts))
        return await self.engine.generate(prompts, n, params, policies=policies)


def adapters_for(engine: Engine, policies: list[str]) -> list[str | None]:
    """The adapters each policy samples with: its own once a version of it is loaded, else
    None (the base weights: its version 0, LoRA's B starting at zero)."""
    loaded = engine.policy_versions
    return [policy if policy in loaded else None for policy in policies]
