"""A trainer's versions leaving it: served to rollout nodes as chunks (a snapshot of the
weights, sealed with the swarm's keys), and saved as checkpoints that make their steps'
groups durable.

    step ──▶ Versions.publish: snapshot (rollout.dtype, sealed), and its delta from the
         version before when nodes fetch over a network (node/delta.py) ──▶ Publisher
         (node/publisher.py)
         ──every trainer.checkpoint_every versions──▶ Versions.checkpoint: HF folder +
           resume state (trainable parameters, AdamW's moments, lineage) ──▶ groups durable,
           the checkpoint's version recorded in the DHT (node/directory.py)
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from agentjet.bridge import blocking
from agentjet.config import Config
from node import memory
from node.delta import delta_due, delta_snapshot
from node.directory import Directory, Mark
from node.groups import GroupBook
from node.lora import merged_weights
from node.publisher import Publisher
from node.swarm import SwarmOptimizer
from node.trainer_intake import Head
from node.weights import (
    RESUME_STATE,
    PolicySnapshot,
    prune_checkpoints,
    save_checkpoint,
    snapshot,
    trainable_params,
)

log = logging.getLogger(__name__)


@dataclass
class Versions:
    """Snapshots, publishing and checkpoints of a trainer's current version (`head`)."""

    config: Config
    run_dir: Path
    head: Head
    model: Any
    tokenizer: Any
    version_dtype: torch.dtype  # the rollout engines' (rollout.dtype)
    swarm: SwarmOptimizer
    book: GroupBook
    directory: Directory
    peer_id: str  # this trainer's DHT peer, which a checkpoint's record names
    publisher: Publisher | None = None  # made from the first snapshot (`open_publisher`)

    def open_publisher(self, sealed: Any) -> Publisher:
        """The publisher of this trainer's versions, serving the current one; `sealed`: the
        server of sealed chunks (node/publisher.py), or None without keys."""
        self.publisher = Publisher(
            self.snapshot(sealed is not None), self.config.swarm.run_id, sealed
        )
        return self.publisher

    def snapshot(self, seal: bool) -> PolicySnapshot:
        """The current version as rollout nodes load it: in their engines' dtype
        (rollout.dtype), sealed with the swarm's keys, made after a step (which handed back
        the memory it freed, else it and the new version would peak together) or a state
        download; what making it freed is handed back after."""
        chunk_bytes = self.config.net.weight_chunk_bytes
        made = snapshot(self.model, self.head.version, chunk_bytes, self.version_dtype, seal)
        memory.trim()
        return made

    async def publish(self) -> None:
        """Serve the current weights as the current version (and its delta from the one
        served so far, when one is due: node/delta.py `delta_due`)."""
        publisher = self.publisher
        assert publisher is not None
        publisher.retire()  # (its memory is free for the next version)
        made = await blocking(self.snapshot, publisher.sealed is not None)
        delta = None
        if delta_due(self.config.net, made.version, publisher.fetched_over_wire):
            delta = await blocking(delta_snapshot, publisher.published, made)
        publisher.publish(made, delta)

    def checkpoint(self) -> None:
        """Save the policy (an HF folder) and what resuming needs, then mark its steps'
        groups durable. Runs between steps (a worker thread, or shutdown)."""
        version, lineage = self.head.version, self.head.lineage
        root = self.run_dir / "checkpoints"
        directory = root / f"v{version:06d}"
        lora = self.config.model.lora_rank > 0
        save_checkpoint(
            self.model.get_base_model() if lora else self.model,
            self.tokenizer,
            directory,
            version,
            {"model": self.config.model.name, "time": time.time(), "lineage": lineage.id},
            state_dict=merged_weights(self.model, self.config.model) if lora else None,
            resume_state={
                # A full fine-tune's trainable parameters are the safetensors just written:
                # saved once, the final checkpoint of a Ctrl-C takes ~4 s less (issue 47).
                **({"params": trainable_params(self.model)} if lora else {}),
                "optimizer": self.swarm.optimizer_state(),
                "lineage": msgspec.to_builtins(lineage),
            },
        )
        latest = root / "latest.tmp"  # a crash leaves the old name or the new one
        latest.write_text(directory.name + "\n")
        os.replace(latest, root / "latest")
        for older in root.glob(f"v*/{RESUME_STATE}"):
            if older.parent != directory:
                older.unlink()
        prune_checkpoints(root, self.config.trainer.keep_checkpoints)
        self.book.checkpointed(version)
        self.directory.record_checkpoint(self.peer_id, Mark(lineage.id, version))
        log.info("checkpoint %s", directory)
