"""A trainer process serving several policies (node/trainer_host.py): one copy of the base
weights under every policy's adapters, each policy's training its own, each policy's
trainer its own node in the directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agentjet import protocol
from agentjet.config import config_from_dict, policy_view
from agentjet.errors import ConfigError
from node.trainer import fewest_trainers
from node.trainer_host import TrainerHost, served_view

pytestmark = pytest.mark.unit


def two_policies(**changes: Any) -> dict[str, Any]:
    return {
        "envs": [{"name": "arithmetic"}, {"name": "python_code"}],
        "policies": [
            {"name": "solver", "envs": ["arithmetic"], "lora_rank": 4},
            {"name": "coder", "envs": ["python_code"], "lora_rank": 8},
        ],
        **changes,
    }


def host_of(model_dir: Path, run_dir: Path, policies: list[str]) -> TrainerHost:
    config = config_from_dict(
        two_policies(model={"name": str(model_dir)}, run={"dir": str(run_dir)})
    )
    host = TrainerHost(config, policies)
    host.load_base()
    return host


def storage(model: Any) -> dict[int, int]:
    return {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 2, 3, 4, 5]])).logits


def test_policies_share_the_base_weights_and_train_their_own_adapters(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    host = host_of(tiny_model_dir, tmp_path, ["solver", "coder"])
    base_logits = logits(host.base)
    solver = host.model_for(policy_view(host.config, "solver").model)
    coder = host.model_for(policy_view(host.config, "coder").model)

    frozen = {n: p for n, p in solver.named_parameters() if not p.requires_grad}
    coder_frozen = {n: p for n, p in coder.named_parameters() if not p.requires_grad}
    assert frozen.keys() == coder_frozen.keys() and frozen
    assert all(frozen[n].data_ptr() == coder_frozen[n].data_ptr() for n in frozen)
    base = storage(host.base)
    assert {p.data_ptr() for p in frozen.values()} <= base.keys()
    adapters = {n: p for n, p in solver.named_parameters() if p.requires_grad}
    coder_adapters = {n: p for n, p in coder.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in [*adapters, *coder_adapters])
    assert not {p.data_ptr() for p in adapters.values()} & {
        p.data_ptr() for p in coder_adapters.values()
    }
    # Both policies' models hold one base and two sets of adapters, not two bases.
    held = storage(solver) | storage(coder)
    adapter_bytes = sum(
        p.numel() * p.element_size() for p in [*adapters.values(), *coder_adapters.values()]
    )
    assert sum(held.values()) == sum(base.values()) + adapter_bytes

    # A step on the solver's adapters changes the solver alone; the coder (B = 0 at the
    # start) still computes the base model's function.
    optimizer = torch.optim.SGD(list(adapters.values()), lr=0.5)
    for _ in range(2):  # (B starts at 0: the first step moves B, the second A as well)
        optimizer.zero_grad()
        solver(torch.tensor([[1, 2, 3, 4, 5]])).logits.square().mean().backward()
        optimizer.step()
    assert not torch.allclose(logits(solver), base_logits)
    assert torch.equal(logits(coder), base_logits)
    assert torch.equal(logits(host.base), base_logits)
    assert all(p.grad is None for p in coder.parameters())


def test_a_policys_adapters_start_alike_whatever_process_hosts_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    both = host_of(tiny_model_dir, tmp_path, ["coder", "solver"])
    alone = host_of(tiny_model_dir, tmp_path, ["solver"])
    both.model_for(policy_view(both.config, "coder").model)
    shared = both.model_for(policy_view(both.config, "solver").model)
    own = alone.model_for(policy_view(alone.config, "solver").model)
    started = {n: p for n, p in own.named_parameters() if p.requires_grad}
    assert all(torch.equal(p, started[n]) for n, p in shared.named_parameters() if p.requires_grad)


def test_each_policys_trainer_is_a_node_of_its_own_when_a_process_serves_several(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    both = host_of(tiny_model_dir, tmp_path, ["solver", "coder"])
    assert both.node_id("coder") == f"{both.name}/coder"
    alone = host_of(tiny_model_dir, tmp_path, ["solver"])
    assert alone.node_id("solver") == alone.name


def test_a_joining_trainer_takes_the_policies_with_the_fewest_trainers() -> None:
    def trainer(policy: str) -> protocol.NodeRecord:
        return protocol.NodeRecord(node_id=f"t-{policy}", role="trainer", policy=policy, time=0)

    records = [trainer("a"), trainer("a"), trainer("b"), trainer("c"), trainer("c")]
    records.append(protocol.NodeRecord(node_id="r", role="rollout", policy="b", time=0))
    assert fewest_trainers(["a", "b", "c", "d"], records) == ["d"]
    assert fewest_trainers(["a", "b", "c", "d"], records, 2) == ["d", "b"]
    assert fewest_trainers(["a", "b", "c"], records, 2) == ["b", "a"]  # ties: in order


def test_each_policy_a_process_serves_binds_an_endpoint_of_its_own() -> None:
    config = config_from_dict(two_policies(net={"trainer_endpoint": "tcp://10.0.0.5:7000"}))
    first, other = served_view(config, "coder", first=True), served_view(config, "solver", False)
    assert first.net.trainer_endpoint == "tcp://10.0.0.5:7000"
    assert other.net.trainer_endpoint == "tcp://10.0.0.5:0"  # any free port, announced as bound
    assert other.run.dir.endswith("policies/solver") and other.model.lora_rank == 4
    named = config_from_dict(
        two_policies(
            net={"sealed_port": 7100, "policy_endpoints": {"solver": "tcp://10.0.0.5:7010"}},
            swarm={"announce_endpoint": "tcp://example.org:7000"},
        )
    )
    solver = served_view(named, "solver", first=False)
    assert solver.net.trainer_endpoint == solver.swarm.announce_endpoint == "tcp://10.0.0.5:7010"
    assert solver.net.sealed_port == 0  # the first policy's is 7100
    assert served_view(named, "coder", first=True).swarm.announce_endpoint.endswith(":7000")
    behind_nat = config_from_dict(two_policies(swarm={"announce_endpoint": "tcp://h:7000"}))
    with pytest.raises(ConfigError, match=r"net.policy_endpoints.solver: a trainer serving"):
        served_view(behind_nat, "solver", first=False)
