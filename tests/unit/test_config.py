"""Config loading: defaults, overrides, and one clear line per mistake."""

import json
import tomllib
from pathlib import Path

import pytest

from agentjet.config import Config, config_from_dict, load_config, to_toml
from agentjet.errors import AgentjetError, ConfigError

pytestmark = pytest.mark.unit


def test_defaults_and_shipped_config_are_valid():
    assert load_config().trainer.lr == 1e-5
    shipped = load_config("configs/local.toml")
    assert shipped.rollout.group_size == 8
    assert [e.name for e in shipped.envs] == ["arithmetic"]
    two = load_config("configs/two_policies.toml")
    assert [(p.name, p.envs, p.lr) for p in two.policies] == [
        ("arithmetic", ["arithmetic"], 1e-3),
        ("code", ["python_code"], 1e-3),
    ]


def test_the_shipped_held_out_set_is_what_its_documented_command_makes(tmp_path: Path):
    """configs/local.toml's eval_file: remade byte for byte by the command in its comment,
    every difficulty and op the config trains on, apart from bench/learn.py's seed."""
    from agentjet_app.cli import main
    from bench.learn import HELDOUT_SEED

    text = Path("configs/local.toml").read_text()
    [command] = [
        line.split("#", 1)[1].split() for line in text.splitlines() if "agentjet tasks" in line
    ]
    assert command[:2] == ["agentjet", "tasks"]
    assert command[command.index("--seed") + 1] != str(HELDOUT_SEED)
    args = command[1:]
    args[args.index("--out") + 1] = str(tmp_path / "made.jsonl")
    assert main(args) == 0
    shipped = load_config("configs/local.toml")
    [env] = shipped.envs
    assert shipped.rollout.eval_every > 0
    assert Path(env.eval_file).read_bytes() == (tmp_path / "made.jsonl").read_bytes()
    rows = [json.loads(line) for line in Path(env.eval_file).read_text().splitlines()]
    cells = {(r["difficulty"], r["op"]) for r in rows}
    assert cells == {(d, op) for d in env.difficulties for op in env.ops}


def test_overrides_parse_toml_values_and_bare_strings():
    config = load_config(
        None,
        [
            "trainer.lr=2e-5",
            "envs.0.difficulties=[1, 2]",
            "model.name=HuggingFaceTB/SmolLM2-135M",
            "envs.1.name=python_tool",
        ],
    )
    assert config.trainer.lr == 2e-5
    assert config.envs[0].difficulties == [1, 2]
    assert config.model.name == "HuggingFaceTB/SmolLM2-135M"
    assert [e.name for e in config.envs] == ["arithmetic", "python_tool"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"trainer": {"lrr": 1}}, "config error at trainer.lrr: unknown key (allowed here: lr,"),
        ({"bogus": 1}, "config error at bogus: unknown key (allowed here: model, rollout,"),
        ({"rollout": {"group_size": 1}}, "config error at rollout.group_size: expected `int` >= 2"),
        ({"trainer": {"lr": "fast"}}, "config error at trainer.lr: expected `float`, got `str`"),
        ({"envs": [{"name": "chess"}]}, "config error at envs.0.name: unknown environment 'chess'"),
        ({"envs": [{"difficulties": [4]}]}, "config error at envs.0.difficulties.0: expected"),
        ({"envs": []}, "config error at envs: at least one environment"),
        ({"coordinator": {"endpoint": "localhost"}}, "config error at coordinator.endpoint:"),
        ({"rollout": {"sampling": {"top_p": 1.5}}}, "config error at rollout.sampling.top_p:"),
        (
            {"sandbox": {"backend": "vm"}},
            "config error at sandbox.backend: invalid enum value 'vm' (allowed: process, docker)",
        ),
        ({"sandbox": {"pids": 2}}, "config error at sandbox.pids: expected `int` >= 8"),
        (
            {"envs": [{"teacher": "/nowhere/teacher"}]},
            "config error at envs.0.teacher: /nowhere/teacher is not a model folder",
        ),
        ({"envs": [{"teacher_coef": 0}]}, "config error at envs.0.teacher_coef: expected"),
        (
            {"sandbox": {"pool": 2}},
            "config error at sandbox.pool: unknown key (allowed here: backend",
        ),
        (
            {"trainer": {"lr_end": 1e-6}},
            "config error at trainer.lr_end: 1e-06 is reached at version trainer.lr_decay_versions",
        ),
    ],
)
def test_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_resolved_config_round_trips_through_toml():
    config = load_config(None, ["trainer.lr=3e-5", "envs.1.name=python_tool"])
    again = config_from_dict(tomllib.loads(to_toml(config)))
    assert again == config
    assert again != Config()


def test_every_environment_and_sandbox_backend_is_accepted():
    config = load_config(
        None,
        [
            "envs.0.name=shell",
            "envs.1.name=python_code",
            "envs.2.name=python_tool",
            "sandbox.backend=docker",
            "sandbox.pool_size=4",
        ],
    )
    assert [e.name for e in config.envs] == ["shell", "python_code", "python_tool"]
    assert (config.sandbox.backend, config.sandbox.pool_size) == ("docker", 4)


def test_the_default_image_is_the_one_build_image_makes():
    from agentjet.config import SandboxConfig
    from sandboxes.docker_sandbox import DEFAULT_IMAGE

    assert SandboxConfig().image == DEFAULT_IMAGE


def test_swarm_flags_become_config_overrides() -> None:
    from agentjet_app.cli import build_parser
    from agentjet_app.cli_run import resolve_config

    args = build_parser().parse_args(
        ["node", "--role", "trainer", "--join", "/ip4/10.0.0.1/tcp/7001/p2p/Qm1",
         "--listen", "0.0.0.0:7000", "--announce", "10.0.0.2:7000", "--identity", "/k/id"]
    )  # fmt: skip
    config = resolve_config(args)
    assert config.swarm.initial_peers == ["/ip4/10.0.0.1/tcp/7001/p2p/Qm1"]
    assert config.net.trainer_endpoint == "tcp://0.0.0.0:7000"
    assert config.swarm.host_maddrs == ["/ip4/0.0.0.0/tcp/7001"]
    assert config.swarm.announce_maddrs == ["/ip4/10.0.0.2/tcp/7001"]
    assert config.swarm.announce_endpoint == "tcp://10.0.0.2:7000"
    assert config.swarm.identity_path == "/k/id"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "0.0.0.0:7000"], "give --announce"),
        (["--listen", "nohost"], "expected HOST:PORT"),
        (["--listen", "h:99999"], "expected HOST:PORT"),
    ],
)
def test_bad_swarm_flags_are_one_clear_error(argv: list[str], message: str) -> None:
    from agentjet_app.cli import build_parser
    from agentjet_app.cli_run import resolve_config

    args = build_parser().parse_args(["coordinator", *argv])
    with pytest.raises(AgentjetError, match=message):
        resolve_config(args)


@pytest.mark.parametrize("source", [None, "configs/local.toml"])
def test_nothing_listens_beyond_loopback_unless_configured(source: str | None):
    config = load_config(source)
    zmq_hosts = [
        endpoint.removeprefix("tcp://").rpartition(":")[0]
        for endpoint in (config.coordinator.endpoint, config.net.trainer_endpoint)
    ]
    hivemind_hosts = [maddr.split("/")[2] for maddr in config.swarm.host_maddrs]
    http_host = config.rollout.agent_listen.rpartition(":")[0]
    assert hivemind_hosts and all(m.startswith("/ip4/") for m in config.swarm.host_maddrs)
    assert {*zmq_hosts, *hivemind_hosts, http_host} == {"127.0.0.1"}


def test_a_full_disk_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    from agentjet_app.cli import main

    assert main(["tasks", "--count", "3", "--out", "/dev/full"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("agentjet: error: the disk is full") and "Traceback" not in error
    assert "trainer.keep_checkpoints" in error


def test_every_config_name_is_imported_from_agentjet_config() -> None:
    """The keys are declared in config_schema.py and the rules in config_checks.py, but the
    rest of the project imports all of them from agentjet.config."""
    import agentjet.config as config
    import agentjet.config_checks as checks
    import agentjet.config_schema as schema

    declared = {
        name
        for module in (schema, checks)
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (name.isupper() or getattr(value, "__module__", None) == module.__name__)
    }
    assert declared >= {"Config", "EnvConfig", "ENV_NAMES", "check_config", "is_endpoint"}
    assert sorted(declared - set(config.__all__)) == []
    assert all(hasattr(config, name) for name in config.__all__)
