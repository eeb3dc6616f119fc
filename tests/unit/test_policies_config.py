"""[[policies]] (issue 26): several LoRA policies over one base, checked in one line each;
the view of one policy its trainer runs with."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from agentjet.config import config_from_dict, load_config, policy_names, policy_view, to_toml
from agentjet.errors import ConfigError
from agentjet.protocol import NodeRecord
from agentjet_app.cli_status import format_swarm

pytestmark = pytest.mark.unit

TWO_ENVS = [{"name": "arithmetic"}, {"name": "python_code"}]


def two_policies(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "envs": [dict(e) for e in TWO_ENVS],
        "trainer": {"lr": 1e-5, "groups_per_step": 8},
        "policies": [
            {"name": "solver", "envs": ["arithmetic"], "lr": 3e-5, "lora_rank": 8},
            {"name": "coder", "envs": ["python_code"], "weight": 2.0},
        ],
    }
    data.update(changes)
    return data


def test_no_policies_section_is_the_one_policy_of_today() -> None:
    config = load_config()
    assert config.policies == [] and policy_names(config) == [""]
    assert policy_view(config, "") is config


def test_a_policy_view_is_the_config_its_trainer_runs_with(tmp_path: Path) -> None:
    config = config_from_dict(two_policies(run={"dir": str(tmp_path)}))
    assert policy_names(config) == ["solver", "coder"]
    solver = policy_view(config, "solver")
    assert (solver.model.lora_rank, solver.model.lora_alpha) == (8, 16)
    assert solver.trainer.lr == 3e-5 and solver.trainer.groups_per_step == 8
    assert [e.name for e in solver.envs] == ["arithmetic"]
    assert solver.run.dir == str(tmp_path / "policies" / "solver")
    coder = policy_view(config, "coder")
    assert coder.trainer.lr == 1e-5  # 0: the [trainer] value
    assert [e.name for e in coder.envs] == ["python_code"]
    assert [p.name for p in coder.policies] == ["coder"]
    with pytest.raises(ConfigError, match=r"no policy 'planner' in this config .*solver, coder"):
        policy_view(config, "planner")


def test_policies_survive_the_run_dirs_config_toml() -> None:
    config = config_from_dict(two_policies(net={"policy_endpoints": {"coder": "tcp://h:9"}}))
    again = config_from_dict(tomllib.loads(to_toml(config)))
    assert again == config
    assert policy_view(again, "coder").net.trainer_endpoint == "tcp://h:9"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"policies": [{"name": "a"}, {"name": "a"}]},
            r"^config error at policies\.1\.name: 'a' is listed twice$",
        ),
        (
            {"policies": [{"name": "no spaces"}]},
            r"^config error at policies\.0\.name: 'no spaces' is not a policy name",
        ),
        (
            {"policies": [{"name": "a", "base": "HuggingFaceTB/SmolLM2-360M"}]},
            r"^config error at policies\.0\.base: 'HuggingFaceTB/SmolLM2-360M' is not "
            r"model\.name \('embedded:smollm2-135m'\); a swarm's policies share one base",
        ),
        (
            {"policies": [{"name": "a", "envs": ["shell"]}]},
            r"^config error at policies\.0\.envs: 'shell' is no environment in envs "
            r"\(configured: arithmetic, python_code\)$",
        ),
        (
            {"policies": [{"name": "a", "envs": ["arithmetic"]}]},
            r"^config error at envs\.1: 'python_code' is trained by no policy",
        ),
        (
            {"model": {"lora_rank": 8}},
            r"^config error at model\.lora_rank: with \[\[policies\]\] each policy sets",
        ),
        (
            {"net": {"policy_endpoints": {"planner": "tcp://h:1"}}},
            r"^config error at net\.policy_endpoints\.planner: no such policy$",
        ),
        (
            {"net": {"policy_endpoints": {"coder": "h:1"}}},
            r"^config error at net\.policy_endpoints\.coder: 'h:1' is not a ZMQ endpoint",
        ),
        (
            {"swarm": {"run_id": "my.run"}},
            r"^config error at swarm\.run_id: 'my\.run' must be 1 to 128 letters",
        ),
    ],
)
def test_each_mistake_is_one_line_naming_its_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        config_from_dict(two_policies(**changes))
    assert "\n" not in str(caught.value)


def test_policy_endpoints_need_policies() -> None:
    with pytest.raises(ConfigError, match="there are no \\[\\[policies\\]\\] to serve"):
        config_from_dict({"net": {"policy_endpoints": {"a": "tcp://h:1"}}})


def test_status_shows_each_trainers_policy_and_each_policy_a_rollout_node_holds() -> None:
    records = [
        NodeRecord(node_id="t1", role="trainer", policy="planner", policy_version=7),
        NodeRecord(node_id="t0", role="trainer", policy_version=3),  # no [[policies]]
        NodeRecord(node_id="r1", role="rollout", policy_versions={"solver": 5, "planner": 6}),
    ]
    lines = {line.split()[1]: line for line in format_swarm(records, now=0.0).splitlines()[2:]}
    assert lines["t1"].split()[3] == "planner:7"
    assert lines["t0"].split()[3] == "3"
    assert "planner:6 solver:5" in lines["r1"]
