"""node/policy_sync.py: each policy's versions reach the rollout node's engine from that
policy's trainers only, and environments sample each policy with its own adapters. Real
ZeroMQ sockets on loopback, the trainers' Publisher, the torch engine on the tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentjet.config import LogConfig, ModelConfig, NetConfig
from agentjet.episode import SamplingParams
from agentjet.metrics import MetricsWriter, read_metrics
from node.delivery import TrainerPeer
from node.lora import random_adapters
from node.policy_sync import PolicySync, PolicyView
from node.torch_engine import TorchEngine
from tests.version_server import VersionServer

pytestmark = pytest.mark.unit

CHUNK_BYTES = 1 << 16
MAX_MESSAGE_BYTES = 1 << 22
LORAS = {
    "planner": ModelConfig(lora_rank=4, lora_targets=["q_proj", "v_proj"]),
    "solver": ModelConfig(lora_rank=8),
}
GREEDY = SamplingParams(max_new_tokens=6, greedy=True)


def test_each_policy_loads_its_own_trainers_versions_beside_the_others(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    asyncio.run(scenario(tiny_model_dir, tmp_path))
    rows = read_metrics(tmp_path / "metrics" / "rollout.jsonl")
    loaded = {(r["policy"], r["policy_version"]) for r in rows if r["event"] == "weights_loaded"}
    assert loaded == {("planner", 3), ("solver", 5)}


async def scenario(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = TorchEngine(tiny_model_dir, dtype="float32", seed=0, device="cpu")
    adapters = {
        name: random_adapters(engine.model, lora, seed=i, b_scale=0.5)
        for i, (name, lora) in enumerate(LORAS.items())
    }
    trainers = {"t-planner": VersionServer(adapters["planner"], 3, CHUNK_BYTES, MAX_MESSAGE_BYTES)}
    trainers["t-solver"] = VersionServer(adapters["solver"], 5, CHUNK_BYTES, MAX_MESSAGE_BYTES)
    peers = {
        "t-planner": TrainerPeer("t-planner", "", policy="planner", policy_version=3),
        "t-solver": TrainerPeer("t-solver", "", policy="solver", policy_version=5),
    }
    clients = {name: trainer.client("rollout-test") for name, trainer in trainers.items()}
    metrics = MetricsWriter(tmp_path, "rollout", LogConfig())
    net = NetConfig(map_local=False)
    syncs = {
        name: PolicySync(name, engine, lora, net, lambda: metrics) for name, lora in LORAS.items()
    }
    running = [
        asyncio.create_task(sync.run(peers, clients, lambda: (None, []))) for sync in syncs.values()
    ]
    try:
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        base = await engine.generate(prompts, 1, GREEDY)
        for sync, version in zip(syncs.values(), (3, 5), strict=True):
            assert sync.version == 0
            sync.saw(version)
            async with asyncio.timeout(30):
                while sync.ready is None:  # the fetch task's result (its own socket round trips)
                    await asyncio.sleep(0.01)
            await sync.load()
        assert engine.policy_versions == {"planner": 3, "solver": 5}
        assert [s.version for s in syncs.values()] == [3, 5]
        # Each sync asked its own policy's trainer only.
        assert trainers["t-planner"].queries >= 2 and trainers["t-solver"].queries >= 2
        counted = {name: t.queries for name, t in trainers.items()}
        syncs["planner"].newer.set()
        async with asyncio.timeout(30):
            while trainers["t-planner"].queries == counted["t-planner"]:
                await asyncio.sleep(0.01)
        assert trainers["t-solver"].queries - counted["t-solver"] <= 1  # its own 1 s poll only

        # An environment's view samples with the policy's adapters and tags its version.
        planner = PolicyView(engine, "planner")
        assert planner.policy_version == 3 and planner.tokenizer is engine.tokenizer
        mixed = await engine.generate(prompts, 1, GREEDY, policies=["planner", "planner"])
        viewed = await planner.generate(prompts, 1, GREEDY)
        assert [c[0].token_ids for c in viewed] == [c[0].token_ids for c in mixed]
        assert [c[0].token_ids for c in viewed] != [c[0].token_ids for c in base]
        # A policy with no version yet samples with the base weights.
        fresh = PolicyView(engine, "critic")
        assert fresh.policy_version == 0
        assert [c[0].token_ids for c in await fresh.generate(prompts, 1, GREEDY)] == [
            c[0].token_ids for c in base
        ]
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for client in clients.values():
            client.close()
        for trainer in trainers.values():
            await trainer.close()
        metrics.close()
