"""The config's cross-field rules: what types and ranges alone cannot state (a replay lag
within the policy lag, environments named once, endpoints and devices well formed, ...).

    Config (types and ranges checked by msgspec) ──▶ check_config ──▶ ConfigError or None

agentjet/config.py runs `check_config` on every config it loads; each rule's error is one
line naming the key, like msgspec's. The address checks (`is_endpoint`, `dashboard_address`,
...) serve flags too: the CLI checks its own with them.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from agentjet.config_schema import (
    DEVICE_PATTERN,
    ENV_NAMES,
    Config,
    EnvConfig,
    EnvSchedConfig,
    TrainerConfig,
)
from agentjet.errors import ConfigError
from agentjet.reasoning_gym_tasks import GymTasks, system_prompt


def check_config(config: Config) -> None:
    """Cross-field rules that types alone cannot state, in the order of the config's
    sections; the first one broken is raised."""
    _check_lr_schedule(config.trainer)
    _check_replay(config.trainer)
    _check_envs(config.envs)
    _check_envsched(config.coordinator.envsched, {env.name for env in config.envs})
    _check_policies(config)
    _check_addresses(config)
    _check_devices(config)
    _check_exposure(config)


def _check_lr_schedule(trainer: TrainerConfig) -> None:
    if trainer.lr_end and not trainer.lr_decay_versions:
        raise ConfigError(
            f"config error at trainer.lr_end: {trainer.lr_end} is reached at version "
            "trainer.lr_decay_versions, which is 0 (no schedule): set both, or neither"
        )


def _check_replay(trainer: TrainerConfig) -> None:
    replaying = trainer.replay.share > 0 or trainer.replay.extra > 0
    if replaying and trainer.replay.max_lag > trainer.max_policy_lag:
        raise ConfigError(
            f"config error at trainer.replay.max_lag: {trainer.replay.max_lag} is more than "
            f"trainer.max_policy_lag ({trainer.max_policy_lag}); a replayed group is a "
            "lagged sample, held to the same bound"
        )


def _check_envs(envs: list[EnvConfig]) -> None:
    if not envs:
        raise ConfigError("config error at envs: at least one environment is required")
    names = [env.name for env in envs]
    for i, env in enumerate(envs):
        if env.name in names[:i]:
            raise ConfigError(
                f"config error at envs.{i}.name: {env.name!r} is listed twice "
                "(one entry per environment; put its tasks in one task file)"
            )
        _check_env(env, i)


def _check_env(env: EnvConfig, i: int) -> None:
    """One [[envs]] entry, the i-th: its name, tasks, functions, teacher and files."""
    if env.name not in ENV_NAMES:
        raise ConfigError(
            f"config error at envs.{i}.name: unknown environment {env.name!r} "
            f"(allowed: {', '.join(ENV_NAMES)})"
        )
    if env.name == "verifiers":
        from agentjet.verifiers_envs import check_env  # imports the user's package

        check_env(env, i)
    elif env.verifiers_env:
        raise ConfigError(
            f'config error at envs.{i}.verifiers_env: only "verifiers" environments take one'
        )
    if not env.task_file and (not env.difficulties or not env.ops):
        raise ConfigError(
            f"config error at envs.{i}: difficulties and ops must be non-empty "
            "when no task_file is given"
        )
    if env.name == "agent" and not env.agent and not env.external:
        raise ConfigError(
            f"config error at envs.{i}.agent: the agent environment needs "
            'agent = "module:function" or external = true'
        )
    _check_env_class(env, i)
    specs = [("agent", env.agent), ("judge", env.judge), ("reward", env.reward)]
    specs += [(f"rewards.{j}.function", t.function) for j, t in enumerate(env.rewards)]
    for key, spec in specs:
        if spec and not re.fullmatch(r"[\w.]+:\w+", spec):
            raise ConfigError(f"config error at envs.{i}.{key}: {spec!r} is not module:function")
    _check_rewards(env, i)
    _check_openenv(env, i)
    _check_reasoning_gym(env, i)
    if not_a_model_folder(env.teacher):
        raise ConfigError(
            f"config error at envs.{i}.teacher: {env.teacher} is not a model folder "
            "(no config.json)"
        )
    for key in ("task_file", "eval_file"):
        path = getattr(env, key)
        if path and not Path(path).expanduser().exists():
            raise ConfigError(f"config error at envs.{i}.{key}: {path} not found")


def _check_env_class(env: EnvConfig, i: int) -> None:
    """An "env_class" entry names its class and task file; the others name no class."""
    where = f"config error at envs.{i}"
    if env.name != "env_class":
        for key in ("environment", "sandbox"):
            if getattr(env, key):
                raise ConfigError(f'{where}.{key}: only "env_class" environments take {key}')
        return
    if not re.fullmatch(r"[\w.]+:\w+", env.environment):
        raise ConfigError(
            f'{where}.environment: the env_class environment needs environment = "module:Class"'
            + (f", got {env.environment!r}" if env.environment else "")
        )
    if not env.task_file:
        raise ConfigError(
            f"{where}.task_file: an env_class environment plays the rows of your task file "
            "(each row goes to reset(**row))"
        )
    if env.external:
        raise ConfigError(f"{where}.external: an env_class environment plays in the node")


def _check_openenv(env: EnvConfig, i: int) -> None:
    """An "openenv" entry names one server, by URL or app; no other entry names one."""
    where = f"config error at envs.{i}"
    specs = {k: getattr(env, k) for k in ("openenv_app", "openenv_action", "openenv_observation")}
    if env.name != "openenv":
        named = [k for k in ("openenv_url", *specs) if getattr(env, k)]
        if named:
            raise ConfigError(f'{where}.{named[0]}: only "openenv" environments take it')
        return
    if bool(env.openenv_url) == bool(env.openenv_app):
        raise ConfigError(
            f'{where}: an "openenv" environment needs openenv_url = "http://HOST:PORT" '
            '(a running server) or openenv_app = "module:app" (agentjet starts it), one of them'
        )
    if env.openenv_url and not re.fullmatch(r"(https?|wss?)://[^/\s]+/?", env.openenv_url):
        raise ConfigError(f"{where}.openenv_url: {env.openenv_url!r} is not http://HOST:PORT")
    for key, spec in specs.items():
        if spec and not re.fullmatch(r"[\w.]+:\w+", spec):
            raise ConfigError(f"{where}.{key}: {spec!r} is not module:name")
    if env.agent or env.judge or env.external:
        raise ConfigError(
            f'{where}: an "openenv" environment plays the server\'s episodes itself; '
            "agent, judge and external are not for it"
        )


def _check_rewards(env: EnvConfig, i: int) -> None:
    where = f"config error at envs.{i}"
    if env.partial_credit and env.name != "arithmetic":
        raise ConfigError(f'{where}.partial_credit: only "arithmetic" environments take it')
    if env.name == "env_class":  # optional there: the class's get_reward may score alone
        if env.reward and env.rewards:
            raise ConfigError(f"{where}.reward: give reward or [[envs.rewards]], not both")
        _check_term_names(env, where)
        return
    if env.name != "prompt":
        if env.reward or env.rewards:
            raise ConfigError(
                f'{where}.reward: only "prompt" and "env_class" environments take a reward'
            )
        return
    if not env.task_file:
        raise ConfigError(f'{where}.task_file: a "prompt" environment trains on your task file')
    if bool(env.reward) == bool(env.rewards):
        raise ConfigError(
            f'{where}.reward: a "prompt" environment needs reward = "module:function" '
            "or [[envs.rewards]] terms (one of the two)"
        )
    _check_term_names(env, where)


def _check_term_names(env: EnvConfig, where: str) -> None:
    names = [t.name for t in env.rewards]
    if len(set(names)) != len(names) or any(not re.fullmatch(r"\w+", n) for n in names):
        raise ConfigError(f"{where}.rewards: term names must be distinct words, got {names}")


def _check_reasoning_gym(env: EnvConfig, i: int) -> None:
    """A "reasoning_gym" entry's datasets exist and take their configs (the package is
    imported and each dataset made here, once per process: before any model loads)."""
    where = f"config error at envs.{i}"
    if env.name != "reasoning_gym":
        if env.tasks:
            raise ConfigError(f'{where}.tasks: only "reasoning_gym" environments take tasks')
        return
    if env.task_file:
        raise ConfigError(
            f"{where}.task_file: a 'reasoning_gym' environment makes its rows from tasks "
            "(an eval_file of reasoning-gym rows is read for held-out evaluation)"
        )
    GymTasks.from_config(env, where)
    system_prompt(env.rg_system_prompt, where)


def _check_envsched(params: EnvSchedConfig, env_names: set[str]) -> None:
    where = "config error at coordinator.envsched"
    for key, names in (("max_open", params.max_open), ("ratio_weights", params.ratio_weights)):
        for name in names:
            if name not in env_names:
                raise ConfigError(
                    f"{where}.{key}.{name}: no such environment in envs "
                    f"(configured: {', '.join(sorted(env_names))})"
                )
    steps = params.ratio_at_grants
    if any(a >= b for a, b in zip(steps, steps[1:], strict=False)):
        raise ConfigError(f"{where}.ratio_at_grants: must be strictly increasing, got {steps}")
    for name, weights in params.ratio_weights.items():
        if len(weights) != len(steps):
            raise ConfigError(
                f"{where}.ratio_weights.{name}: {len(weights)} weights for "
                f"{len(steps)} steps in ratio_at_grants (one per step)"
            )
    for i, at in enumerate(steps):
        if env_names <= set(params.ratio_weights) and not any(
            w[i] > 0 for w in params.ratio_weights.values()
        ):
            raise ConfigError(
                f"{where}.ratio_weights: every environment has weight 0 from grant {at} on"
            )


def _check_policies(config: Config) -> None:
    where = "config error at policies"
    env_names = [env.name for env in config.envs]
    names = [p.name for p in config.policies]
    trained: set[str] = set()
    for i, policy in enumerate(config.policies):
        if not re.fullmatch(r"[A-Za-z0-9][\w-]{0,63}", policy.name):
            raise ConfigError(
                f"{where}.{i}.name: {policy.name!r} is not a policy name (1 to 64 letters, "
                "digits, _ or -, starting with a letter or digit)"
            )
        if policy.name in names[:i]:
            raise ConfigError(f"{where}.{i}.name: {policy.name!r} is listed twice")
        if policy.base and policy.base != config.model.name:
            raise ConfigError(
                f"{where}.{i}.base: {policy.base!r} is not model.name ({config.model.name!r}); "
                "a swarm's policies share one base model (rollout nodes hold one copy of it)"
            )
        for name in policy.envs:
            if name not in env_names:
                raise ConfigError(
                    f"{where}.{i}.envs: {name!r} is no environment in envs "
                    f"(configured: {', '.join(env_names)})"
                )
        trained |= set(policy.envs or env_names)
    if not config.policies:
        if config.net.policy_endpoints:
            raise ConfigError(
                "config error at net.policy_endpoints: there are no [[policies]] to serve"
            )
        return
    if config.model.lora_rank:
        raise ConfigError(
            "config error at model.lora_rank: with [[policies]] each policy sets its own "
            "lora_rank; leave model.lora_rank at 0"
        )
    for i, env in enumerate(config.envs):
        if env.name not in trained:
            raise ConfigError(
                f"config error at envs.{i}: {env.name!r} is trained by no policy (add it "
                "to a policy's envs, or remove it)"
            )
    for name, endpoint in config.net.policy_endpoints.items():
        if name not in names:
            raise ConfigError(f"config error at net.policy_endpoints.{name}: no such policy")
        if not is_endpoint(endpoint):
            raise ConfigError(
                f"config error at net.policy_endpoints.{name}: {endpoint!r} is not a ZMQ "
                "endpoint (expected tcp://HOST:PORT or ipc://PATH)"
            )


def _check_addresses(config: Config) -> None:
    """The names the swarm's keys and sockets are made of, and what a message carries."""
    if not re.fullmatch(r"[\w-]{1,128}", config.swarm.run_id):
        raise ConfigError(
            f"config error at swarm.run_id: {config.swarm.run_id!r} must be 1 to 128 letters, "
            "digits, _ or - (hivemind's keys are made of it)"
        )
    listen = config.rollout.agent_listen
    if not re.fullmatch(r"[^:\s]+:\d{1,5}", listen):
        raise ConfigError(f"config error at rollout.agent_listen: {listen!r} is not HOST:PORT")
    for key, endpoint in (
        ("coordinator.endpoint", config.coordinator.endpoint),
        ("net.trainer_endpoint", config.net.trainer_endpoint),
    ):
        if not is_endpoint(endpoint):
            raise ConfigError(
                f"config error at {key}: {endpoint!r} is not a ZMQ endpoint "
                "(expected tcp://HOST:PORT or ipc://PATH)"
            )
    if config.net.weight_chunk_bytes + 4096 > config.net.max_message_bytes:
        raise ConfigError(
            "config error at net.weight_chunk_bytes: must be smaller than net.max_message_bytes"
        )


def _check_devices(config: Config) -> None:
    devices = {"rollout.device": config.rollout.device, "trainer.device": config.trainer.device}
    for key, device in devices.items():
        if not re.fullmatch(DEVICE_PATTERN, device):
            raise ConfigError(
                f"config error at {key}: {device!r} is not a device "
                "(allowed: auto, cpu, cuda, cuda:N)"
            )


def _check_exposure(config: Config) -> None:
    """What is open to whom: plaintext beside keys, a dashboard off loopback."""
    if config.net.keys and config.net.insecure:
        raise ConfigError(
            "config error at net.insecure: net.keys is set too; use the keys or run insecure"
        )
    dashboard_address(
        config.dashboard.listen, config.dashboard.token, "config error at dashboard.listen"
    )


def is_endpoint(text: str) -> bool:
    """A ZMQ endpoint this project connects to: tcp://HOST:PORT or ipc://PATH."""
    return re.fullmatch(r"(tcp://[^:/\s]+:\d{1,5}|ipc://\S+)", text) is not None


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address) is this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def dashboard_address(listen: str, token: str, where: str) -> tuple[str, int]:
    """The dashboard's (host, port) from `listen`; off loopback only with a token.
    `where` starts the error's one line (the key or flag that said it)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{where}: {listen!r} is not HOST:PORT")
    if not token and not is_loopback(host):
        raise ConfigError(
            f"{where}: {host} is not a loopback address and the dashboard "
            "shows the run's prompts and completions to whoever reaches it: give a token "
            "(--token or dashboard.token), or listen on 127.0.0.1"
        )
    return host.strip("[]"), int(port)


def not_a_model_folder(name: str) -> bool:
    """A model name written as a path (/, ., ~) that is no model folder here (a folder with
    config.json: a model or a checkpoint)."""
    return (
        name.startswith(("/", ".", "~")) and not (Path(name).expanduser() / "config.json").is_file()
    )
