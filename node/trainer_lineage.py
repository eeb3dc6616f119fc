"""Where a trainer starts from, and the name of the weights it makes: the swarm's state, a
checkpoint of its run dir, or the base weights, each in a policy lineage (protocol.Lineage).

    start ──peers listed?──▶ wait for a trainer that saved a newer checkpoint (rejoin_wait_s)
          ──behind them?───▶ download the swarm's state: the newest trainer's lineage
          ──else──────────▶ resume the newest checkpoint (or the base weights) in a lineage
                            of its own (`start_lineage`): one no earlier life of this run
                            dir published under (LINEAGES_LOG) nor a live trainer holds past it

Versions a trainer had published past its checkpoint are gone with its process: a new
lineage tells rollout nodes to drop the weights (and groups) of the old one. The trainer
role (node/trainer.py) calls these from its setup, its catch-up (node/trainer_catch_up.py)
when it takes the swarm's state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import torch

from agentjet import protocol
from agentjet.config import SwarmConfig
from agentjet.errors import ModelError
from node.directory import Directory
from node.swarm import SwarmOptimizer
from node.weights import trainable_params

log = logging.getLogger(__name__)

# Under the run dir: one line per policy lineage this trainer published under (its lives).
LINEAGES_LOG = "lineages.log"


def used_lineages(run_dir: Path) -> set[str]:
    """The lineages this trainer (any earlier life, same run dir) has published under."""
    path = run_dir / LINEAGES_LOG
    return set(path.read_text().split("\n")[:-1]) if path.exists() else set()


def record_lineage(run_dir: Path, lineage: protocol.Lineage) -> None:
    """Note `lineage` as used, before any version of it is published."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LINEAGES_LOG, "a") as f:
        f.write(lineage.id + "\n")


def swarm_lineage(
    others: Iterable[protocol.NodeRecord], current: protocol.Lineage
) -> protocol.Lineage:
    """The lineage of the swarm's weights just downloaded: the newest other trainer's
    (`current` when none is listed)."""
    records = list(others)
    if not records:
        return current
    return max(records, key=lambda r: r.policy_version).lineage


def start_lineage(
    resume: dict[str, Any] | None, records: list[protocol.NodeRecord], run_dir: Path
) -> tuple[protocol.Lineage, int]:
    """The lineage of a trainer that starts on its own weights, and the version it resumes
    (-1: none, the base weights): a fork of its checkpoint's lineage (the root for a run's
    first start) that no earlier life used and no listed trainer holds past that version."""
    parent, start, resumed = protocol.Lineage(), 0, -1
    if resume is not None:
        resumed = start = int(resume["policy_version"])
        parent = msgspec.convert(resume.get("lineage", {}), protocol.Lineage)
    used = used_lineages(run_dir)

    def taken(lineage_id: str) -> bool:
        return lineage_id in used or any(
            r.lineage.id == lineage_id and r.policy_version > start for r in records
        )

    return protocol.open_lineage(parent, start, taken), resumed


def join_or_resume(
    swarm: SwarmOptimizer,
    directory: Directory,
    config: SwarmConfig,
    resume: dict[str, Any] | None,
    run_dir: Path,
    others_in: Callable[[list[protocol.NodeRecord]], dict[str, protocol.NodeRecord]],
    others: dict[str, protocol.NodeRecord],
) -> tuple[protocol.Lineage, int]:
    """Where a trainer starts (see the module docstring): its lineage, and the checkpoint's
    version it resumed (-1: none). `resume`: the run dir's resume state (node/weights.py),
    its parameters already in the model. `others`: the trainer's view of the other
    trainers (`others_in` of the directory's records), filled here as the directory is
    read, before the swarm is asked whether this trainer has a peer (`swarm.peered` counts
    them)."""
    loaded = False
    records: list[protocol.NodeRecord] = []
    if config.initial_peers:
        mine = int(resume["policy_version"]) if resume is not None else 0
        own_peer = str(swarm.dht.peer_id)
        records = wait_for_newer_checkpoint(directory, own_peer, mine, config, others_in)
        others.update(others_in(records))
        # A peer at this checkpoint's very version counts too: resumed on its own, this
        # trainer would name the weights it then makes in lock step with that peer a
        # lineage of its own, and groups trained under either name would be sent again
        # when that name's trainer dies (the fault suite saw both).
        newest = max((r.policy_version for r in others.values()), default=-1)
        behind = resume is None or newest >= mine
        if behind and swarm.peered():  # (else alone: nobody to load from)
            log.info("joined the swarm; loading its state from peers")
            loaded = swarm.load_state_from_peers(
                wait_s=config.state_wait_s,  # while another trainer is listed:
                while_true=lambda: bool(others_in(directory.records())),
            )
    if loaded:
        return swarm_lineage(others.values(), protocol.Lineage()), -1
    lineage, resumed = start_lineage(resume, records, run_dir)
    if resume is not None:
        swarm.restore(resumed, resume["optimizer"])
        log.info("resumed from checkpoint: policy version %d, lineage %s", resumed, lineage.id)
    return lineage, resumed


def wait_for_newer_checkpoint(
    directory: Directory,
    own_peer: str,
    mine: int,
    config: SwarmConfig,
    others_in: Callable[[list[protocol.NodeRecord]], dict[str, protocol.NodeRecord]],
) -> list[protocol.NodeRecord]:
    """The directory's records, once a trainer that saved a checkpoint newer than version
    `mine` is live again (or after swarm.rejoin_wait_s): its steps were reported trained,
    and training on from older weights would lose them. `others_in(records)`: the other
    trainers of this trainer's policy among them."""
    newer = max(
        (m.version for peer, m in directory.checkpoints().items() if peer != own_peer),
        default=-1,
    )
    records = directory.records()
    if newer <= mine or not config.rejoin_wait_s:
        return records
    log.warning(
        "another trainer saved version %d, newer than this trainer's %d: waiting up to "
        "%.0f s for it to be live (swarm.rejoin_wait_s)",
        newer,
        mine,
        config.rejoin_wait_s,
    )
    deadline = time.monotonic() + config.rejoin_wait_s
    while time.monotonic() < deadline:
        if any(r.policy_version >= newer for r in others_in(records).values()):
            return records
        time.sleep(config.heartbeat_s)
        records = directory.records()
    log.warning("no trainer holding version %d came back; going on from %d", newer, mine)
    return records


def load_params(model: Any, params: dict[str, torch.Tensor], run_dir: Path) -> None:
    """A checkpoint's trainable parameters into `model` (before its optimizer exists)."""
    own = trainable_params(model)
    if own.keys() != params.keys() or any(own[n].shape != t.shape for n, t in params.items()):
        raise ModelError(
            f"the checkpoint in {run_dir / 'checkpoints'} was made with another model "
            "or LoRA config; use a new run dir, or the config it was made with"
        )
    with torch.no_grad():
        for name, tensor in params.items():
            own[name].copy_(tensor)
