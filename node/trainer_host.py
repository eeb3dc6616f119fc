"""A trainer process: one `Trainer` (node/trainer.py) per policy it serves, sharing what
the policies share.

    agentjet node --role trainer [--policy NAME ...]
      TrainerHost: node keys (membership renewed, revocations taken in, once per
                   heartbeat), one DHT, the GPU monitor, the base weights loaded once
        ├─ Trainer(planner): its LoRA adapters over the shared base weights, its optimizer,
        │    its hivemind run (RUN_ID_policy_planner), its endpoint, its run dir
        │    (RUN_DIR/policies/planner), its directory record NODE/planner
        └─ Trainer(solver):  the same, for solver

Without [[policies]] a process serves the one policy, as one node named NODE. With several
policies, each trainer is a node of its own in the swarm's directory, named NODE/POLICY
(signed by NODE's keys; agentjet/identity.py): rollout nodes send a policy's groups to its
trainers and read its durability against them alone, whatever process hosts them.

The base weights are frozen under LoRA, so every policy's model holds the same tensors
(`model_for`): a second policy costs its adapters and optimizer state, not a second copy of
the model. Each trainer's loops run on the one event loop; their steps cross the bridge as
separate blocking calls over separate modules. The process stops when every trainer has
reached run.max_steps, on SIGTERM, or when one trainer fails (the others are stopped too).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import socket
import uuid
from contextlib import ExitStack
from typing import Any, cast

import msgspec
import torch

from agentjet.bridge import blocking
from agentjet.config import Config, ModelConfig, policy_view
from agentjet.devices import resolve_device, resolve_dtype, sampling_dtype
from agentjet.errors import ConfigError
from agentjet.identity import node_keys
from agentjet.roles import log_context, print_join_command, run_role
from node.dht import start_dht, visible_maddrs
from node.directory import Directory
from node.gpu_monitor import GpuMonitor
from node.lora import add_adapters
from node.model import DTYPES, load_causal_lm, resolve_model
from node.trainer import Trainer

log = logging.getLogger(__name__)


class TrainerHost:
    """The trainer role: the trainers of the policies this process serves."""

    def __init__(self, config: Config, policies: list[str]) -> None:
        """`policies`: the [[policies]] names to train ([""]: a config without them)."""
        self.config = config
        self.trainers = [
            Trainer(served_view(config, policy, first=i == 0), policy)
            for i, policy in enumerate(policies)
        ]
        self.name = f"trainer-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

    def node_id(self, policy: str) -> str:
        """The directory name of `policy`'s trainer: the node's, or NODE/POLICY when this
        node serves several policies ("/" is in no node name: identity.NAME_PATTERN)."""
        return self.name if len(self.trainers) == 1 else f"{self.name}/{policy}"

    def setup(self, cleanup: ExitStack) -> None:
        cfg = self.config
        self.keys = node_keys(cfg.net, self.name)
        if self.keys is not None:  # a node's own key file names it
            self.name = self.keys.name
        torch.set_num_threads(cfg.trainer.torch_threads)
        self.load_base()
        self.dht = start_dht(cfg.swarm, self.keys)
        cleanup.callback(self.dht.shutdown)
        self.maddrs = visible_maddrs(self.dht)
        self.directory = Directory(self.dht, cfg.swarm, self.keys)  # (its members, revocations)
        self.peer_id = self.dht.peer_id.to_base58()
        if self.keys is not None:
            # Only members average with a trainer or download its state: this node is one
            # before any policy's optimizer starts (which may download state from peers).
            self.directory.declare_member(self.keys.identity, self.peer_id)
        self.gpu = GpuMonitor.for_devices([self.device])  # NVML; reports nothing on CPUs
        cleanup.callback(self.gpu.close)
        for trainer in self.trainers:
            token = log_context.set(trainer.policy)
            try:
                trainer.setup(cleanup, self)
            finally:
                log_context.reset(token)
        if len(self.trainers) > 1:
            log.info(
                "serving %d policies: %s",
                len(self.trainers),
                ", ".join(f"{t.policy} at {t.endpoint}" for t in self.trainers),
            )
        if not cfg.swarm.initial_peers:
            print_join_command(self.maddrs, cfg.net.keys)

    def load_base(self) -> None:
        """The base model, on the trainer's device, and its tokenizer."""
        cfg = self.config
        self.device = resolve_device(cfg.trainer.device, "trainer.device")
        self.compute_dtype = DTYPES[resolve_dtype(cfg.model.dtype, self.device)]
        # what policy versions travel in: the rollout engines' dtype (rollout.dtype)
        sampler = sampling_dtype(cfg.model.dtype, cfg.rollout.dtype)
        self.version_dtype = DTYPES[resolve_dtype(sampler, self.device)]
        path = resolve_model(cfg.model.name, cfg.model.cache_dir)
        # float32 weights and optimizer state on any device; compute in compute_dtype.
        model, self.tokenizer = load_causal_lm(path, "float32")
        # On the device before any policy's model is made of it: moving a model there later
        # would give it tensors of its own.
        self.base: Any = cast(Any, model).to(self.device)

    def model_for(self, config: ModelConfig) -> Any:
        """The model a policy trains: the base itself for the one policy of a process; for
        each of several, LoRA adapters over the base's own (frozen) parameter tensors."""
        torch.manual_seed(self.config.run.seed)  # a policy's adapters start alike anywhere
        if len(self.trainers) == 1:
            return add_adapters(self.base, config) if config.lora_rank else self.base
        if not config.lora_rank:  # (config validation: [[policies]] are LoRA)
            raise ValueError("a trainer serving several policies trains LoRA adapters only")
        shared = {id(t): t for t in [*self.base.parameters(), *self.base.buffers()]}
        return add_adapters(copy.deepcopy(self.base, memo=shared), config)

    async def run(self, stop: asyncio.Event) -> None:
        """Run every trainer until each has ended (run.max_steps) or `stop` is set; one that
        fails stops the others, and its error ends the process."""
        stops = [asyncio.Event() for _ in self.trainers]

        async def relay_stop() -> None:
            await stop.wait()
            for own in stops:
                own.set()

        async def one(trainer: Trainer, own: asyncio.Event) -> None:
            log_context.set(trainer.policy)
            try:
                await trainer.run(own)
            except BaseException:
                for other in stops:
                    other.set()
                raise

        def stop_all(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                for own in stops:
                    own.set()

        relay = asyncio.create_task(relay_stop(), name="trainer-stop")
        membership = asyncio.create_task(self._membership(), name="trainer-membership")
        membership.add_done_callback(stop_all)
        try:
            results = await asyncio.gather(
                *(one(t, own) for t, own in zip(self.trainers, stops, strict=True)),
                return_exceptions=True,
            )
        finally:
            relay.cancel()
            membership.cancel()
        if membership.done() and not membership.cancelled():
            results.append(membership.exception())
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _membership(self) -> None:
        """The node's part of a closed swarm, once per heartbeat for all its policies (one
        identity, one DHT peer): take in revocations (revoked nodes are refused from their
        next request) and renew this node's binding as a member."""
        if self.keys is None:
            return
        while True:
            await blocking(self.directory.sync_revocations, self.keys.membership)
            await blocking(self.directory.declare_member, self.keys.identity, self.peer_id)
            await asyncio.sleep(self.config.swarm.heartbeat_s)


def served_view(config: Config, policy: str, first: bool) -> Config:
    """`policy`'s view of the config (config.policy_view) as this process serves it: the
    first policy it serves binds and announces net.trainer_endpoint (or the policy's
    net.policy_endpoints entry); each other policy binds its entry, or else any free port
    on that host, with its own sealed port, and announces its entry."""
    view = policy_view(config, policy)
    if first:
        return view
    named = config.net.policy_endpoints.get(policy, "")
    if config.swarm.announce_endpoint and not named:
        raise ConfigError(
            f"config error at net.policy_endpoints.{policy}: a trainer serving several "
            "policies announces only its first at swarm.announce_endpoint; name the "
            "endpoint the others are reached at in net.policy_endpoints"
        )
    bound = config.net.trainer_endpoint
    free = f"{bound}.{policy}" if bound.startswith("ipc://") else f"{bound.rpartition(':')[0]}:0"
    return msgspec.structs.replace(
        view,
        net=msgspec.structs.replace(view.net, trainer_endpoint=named or free, sealed_port=0),
        swarm=msgspec.structs.replace(view.swarm, announce_endpoint=named),
    )


def main(config: Config, policies: list[str]) -> int:
    return run_role(TrainerHost(config, policies), "trainer")
