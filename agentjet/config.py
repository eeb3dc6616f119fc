"""The one typed config tree, loaded once by the CLI and handed to each role in slices.

    TOML file ──▶ dict ──▶ --set overrides ──▶ msgspec.convert(Config) ──▶ checks ──▶ Config

Unknown keys, wrong types and out-of-range values are errors that name the key and say
what is allowed (`ConfigError`, one line). Every field documents itself where declared, in
agentjet/config_schema.py; the rules that span keys are in agentjet/config_checks.py. This
module loads, renders and slices the tree (one policy's view of it); the rest of the
project imports every name of the three from here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from agentjet.config_checks import (
    check_config,
    dashboard_address,
    is_endpoint,
    is_loopback,
    not_a_model_folder,
)
from agentjet.config_schema import (
    AGENT_ENVS,
    DEVICE_PATTERN,
    EMBEDDED_MODEL,
    ENV_NAMES,
    SANDBOXED_ENVS,
    Config,
    CoordinatorConfig,
    DashboardConfig,
    EnvConfig,
    EnvSchedConfig,
    LogConfig,
    ModelConfig,
    NetConfig,
    NonNegFloat,
    NonNegInt,
    PolicyConfig,
    PositiveFloat,
    PositiveInt,
    Probability,
    ReasoningGymTask,
    ReplayConfig,
    RewardTerm,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    SandboxConfig,
    SwarmConfig,
    TrainerConfig,
)
from agentjet.errors import ConfigError

# The names the rest of the project imports from here, whichever module declares them.
__all__ = [
    "AGENT_ENVS",
    "apply_overrides",
    "check_config",
    "Config",
    "config_from_dict",
    "CoordinatorConfig",
    "dashboard_address",
    "DashboardConfig",
    "DEVICE_PATTERN",
    "EMBEDDED_MODEL",
    "ENV_NAMES",
    "EnvConfig",
    "EnvSchedConfig",
    "is_endpoint",
    "is_loopback",
    "load_config",
    "LogConfig",
    "ModelConfig",
    "NetConfig",
    "NonNegFloat",
    "NonNegInt",
    "not_a_model_folder",
    "policy_config",
    "policy_names",
    "policy_view",
    "PolicyConfig",
    "PositiveFloat",
    "PositiveInt",
    "Probability",
    "read_config_file",
    "ReplayConfig",
    "ReasoningGymTask",
    "RewardTerm",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "SandboxConfig",
    "SANDBOXED_ENVS",
    "SwarmConfig",
    "to_toml",
    "TrainerConfig",
]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read TOML (or start from defaults), apply `key.path=value` overrides, validate."""
    data = read_config_file(path)
    apply_overrides(data, overrides or [])
    return config_from_dict(data)


def read_config_file(path: str | Path | None) -> dict[str, Any]:
    """A TOML config file as a dict, not yet validated ({} for None: the defaults)."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """`key.path=value` overrides (--set) applied to a config dict, in order."""
    for item in overrides:
        _apply_override(data, item)


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(str(e))) from None
    check_config(config)
    return config


def to_toml(config: Config) -> str:
    """Render the resolved config as TOML (written into every run dir)."""
    return _dump_toml(msgspec.to_builtins(config))


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. trainer.lr=2e-5")
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt_is_index = parts[i + 1].isdigit()
        node = _child(node, part, key, [] if nxt_is_index else {})
    last = parts[-1]
    value = _parse_value(raw.strip())
    if isinstance(node, list):
        idx = _index(node, last, key)
        node[idx] = value
    else:
        node[last] = value


def _child(node: Any, part: str, key: str, empty: Any) -> Any:
    if isinstance(node, list):
        idx = _index(node, part, key)
        return node[idx]
    if not isinstance(node, dict):
        raise ConfigError(f"--set {key}: {part!r} is not a table")
    if part == "envs" and part not in node:
        node[part] = [msgspec.to_builtins(EnvConfig())]
    return node.setdefault(part, empty)


def _index(node: list[Any], part: str, key: str) -> int:
    if not part.isdigit():
        raise ConfigError(f"--set {key}: {part!r} must be a list index")
    idx = int(part)
    if idx == len(node):
        node.append({})
    if idx > len(node):
        raise ConfigError(f"--set {key}: index {idx} is past the end of the list")
    return idx


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # bare words are strings: --set model.name=HuggingFaceTB/SmolLM2-135M


def _explain(message: str) -> str:
    """Turn msgspec's message into 'config error at a.b: what is wrong (what is allowed)'."""
    m = re.match(r"(.*?)(?: - at `\$(.*)`)?$", message)
    assert m is not None
    what, where = m.group(1), (m.group(2) or "")
    path = where.lstrip(".").replace("[", ".").replace("]", "")
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    if unknown:
        field = unknown.group(1)
        allowed = ", ".join(_fields_at(path))
        full = f"{path}.{field}" if path else field
        return f"config error at {full}: unknown key (allowed here: {allowed})"
    explained = f"config error at {path or '<top>'}: {what[0].lower()}{what[1:]}"
    if what.startswith("Invalid enum value"):
        choices = getattr(_type_at(path), "__args__", None) or ()
        explained += f" (allowed: {', '.join(map(str, choices))})"
    return explained


def _type_at(path: str) -> Any:
    """The declared type of the config key at `path` (list items for an index)."""
    cls: Any = Config
    for part in filter(None, path.split(".")):
        if getattr(cls, "__origin__", None) is list:
            cls = cls.__args__[0]
        if part.isdigit():
            continue
        cls = {f.name: f.type for f in msgspec.structs.fields(cls)}[part]
    return cls


def _fields_at(path: str) -> list[str]:
    cls = _type_at(path)
    if getattr(cls, "__origin__", None) is list:
        cls = cls.__args__[0]
    return [f.name for f in msgspec.structs.fields(cls)]


def policy_names(config: Config) -> list[str]:
    """The policies a swarm trains: the [[policies]] names, or [""] (the one policy of a
    config without them)."""
    return [p.name for p in config.policies] or [""]


def policy_view(config: Config, name: str) -> Config:
    """The config as one policy's trainer sees it: [model] with the policy's LoRA, [trainer]
    with its settings, only its environments, its trainer endpoint (without --join), and
    its own run dir (<run dir>/policies/NAME: checkpoints, lineages, metrics). "" (a config
    without [[policies]]): the config itself."""
    if name == "" and not config.policies:
        return config
    policy = policy_config(config, name)
    trainer = config.trainer
    envs = [env for env in config.envs if not policy.envs or env.name in policy.envs]
    return msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(
            config.model,
            lora_rank=policy.lora_rank,
            lora_alpha=policy.lora_alpha,
            lora_targets=list(policy.lora_targets),
        ),
        trainer=msgspec.structs.replace(
            trainer,
            lr=policy.lr or trainer.lr,
            weight_decay=policy.weight_decay or trainer.weight_decay,
            groups_per_step=policy.groups_per_step or trainer.groups_per_step,
        ),
        envs=envs,
        policies=[policy],
        net=msgspec.structs.replace(
            config.net,
            trainer_endpoint=config.net.policy_endpoints.get(name, config.net.trainer_endpoint),
        ),
        run=msgspec.structs.replace(config.run, dir=str(Path(config.run.dir) / "policies" / name)),
    )


def policy_config(config: Config, name: str) -> PolicyConfig:
    """The [[policies]] entry `name`; ConfigError naming the configured ones otherwise."""
    for policy in config.policies:
        if policy.name == name:
            return policy
    configured = ", ".join(p.name for p in config.policies) or "none"
    raise ConfigError(f"no policy {name!r} in this config ([[policies]]: {configured})")


def _dump_toml(data: dict[str, Any]) -> str:
    lines: list[str] = []
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict | list) or _flat(v)}
    for k, v in scalars.items():
        lines.append(f"{k} = {_toml_value(v)}")
    for k, v in data.items():
        if k in scalars:
            continue
        if isinstance(v, dict):
            _dump_table(lines, k, v)
        else:  # list of tables
            for item in v:
                lines.append(f"\n[[{k}]]")
                _dump_body(lines, k, item)
    return "\n".join(lines).lstrip() + "\n"


def _flat(v: Any) -> bool:
    return isinstance(v, list) and all(not isinstance(x, dict) for x in v)


def _dump_table(lines: list[str], name: str, table: dict[str, Any]) -> None:
    lines.append(f"\n[{name}]")
    _dump_body(lines, name, table)


def _dump_body(lines: list[str], name: str, table: dict[str, Any]) -> None:
    nested = {}
    for k, v in table.items():
        if isinstance(v, dict):
            nested[k] = v
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in nested.items():
        _dump_table(lines, f"{name}.{k}", v)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table (a list of tables inside [[envs]])
        items = (f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot render {type(v).__name__} as TOML")
