"""The commands that run on a config: `agentjet local`, `node`, `coordinator` and `eval`.

    --config FILE ─▶ --set KEY=VALUE ─▶ the flags (--join, --listen, --keys, --run-dir, ...)
        ─▶ load_config ─▶ --dry-run: config.toml written, exit
                        ─▶ else: the run dir held, the role run in this process

Heavy imports (torch, hivemind) happen here only after the config is valid.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from agentjet.config import (
    Config,
    EnvConfig,
    apply_overrides,
    config_from_dict,
    load_config,
    not_a_model_folder,
    read_config_file,
    to_toml,
)
from agentjet.errors import AgentjetError, ConfigError
from agentjet.identity import node_keys
from agentjet.rundir import default_run_dir, hold_run_dir, node_name


def _host_port(flag: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65534:
        raise AgentjetError(f"{flag} {value!r}: expected HOST:PORT, e.g. 10.0.0.5:7000")
    return host, int(port)


def swarm_overrides(args: argparse.Namespace) -> list[str]:
    """--join/--listen/--announce/--identity as config overrides (they win over the file)."""
    out: list[str] = []
    if args.join:
        out.append(f"swarm.initial_peers={json.dumps(args.join)}")
    if args.identity:
        out.append(f"swarm.identity_path={json.dumps(str(args.identity))}")
    service = {
        "coordinator": "coordinator.endpoint",
        "trainer": "net.trainer_endpoint",
        "teacher": "net.teacher_endpoint",
    }.get("coordinator" if args.command == "coordinator" else args.role)
    if args.listen:
        host, port = _host_port("--listen", args.listen)
        peer_port = port + 1 if port else 0
        out.append(f'swarm.host_maddrs=["/ip4/{host}/tcp/{peer_port}"]')
        if service:
            out.append(f'{service}="tcp://{host}:{port}"')
        elif port:
            out.append(f'rollout.agent_listen="{host}:{port}"')
        if host == "0.0.0.0" and not args.announce:
            raise AgentjetError(
                "--listen 0.0.0.0 binds every interface; give --announce HOST:PORT, the "
                "address other machines reach this node at"
            )
    if args.announce:
        host, port = _host_port("--announce", args.announce)
        if not port and args.listen:
            port = _host_port("--listen", args.listen)[1]
        if not port:
            raise AgentjetError("--announce needs a port (or --listen with one)")
        out.append(f'swarm.announce_maddrs=["/ip4/{host}/tcp/{port + 1}"]')
        if service:
            out.append(f'swarm.announce_endpoint="tcp://{host}:{port}"')
    return out


def resolve_config(args: argparse.Namespace, default_run_dir: str | None = None) -> Config:
    overrides = list(args.set)
    if getattr(args, "max_steps", None) is not None:
        if args.max_steps < 0:
            raise AgentjetError(f"--max-steps must be >= 0, got {args.max_steps}")
        overrides.append(f"run.max_steps={args.max_steps}")
    if getattr(args, "join", None) is not None and args.command in ("node", "coordinator"):
        overrides += swarm_overrides(args)
    if getattr(args, "keys", None) is not None:
        overrides.append(f"net.keys={json.dumps(str(args.keys))}")
    run_dir = args.run_dir or default_run_dir
    if run_dir is not None:
        overrides.append(f"run.dir={json.dumps(str(run_dir))}")
    return load_config(args.config, overrides)


def _dry_run(config: Config) -> int:
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(config))
    print(f"config is valid; resolved config written to {run_dir / 'config.toml'}")
    return 0


def run_configured(args: argparse.Namespace) -> int:
    """`local`, `node`, `coordinator` and `eval`: the config resolved from its file, --set
    and the flags; with --dry-run written and left; else the command run in this process."""
    if args.command == "local":
        default_dir = None
        if args.run_dir is None and not any(s.startswith("run.dir=") for s in args.set):
            default_dir = f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        config = resolve_config(args, default_dir)
        _check_teacher_placement(config, "agentjet local")
        if args.dry_run:
            return _dry_run(config)
        from agentjet_app.local import run_local

        return run_local(config, Path(config.run.dir))
    if args.command == "eval":
        return run_eval(args)
    config = resolve_config(args)
    role = args.role if args.command == "node" else args.command
    own_dir = default_run_dir(role, config) if args.command in ("node", "coordinator") else None
    if own_dir is not None and args.run_dir is None:
        # Not set anywhere: a run dir of this node's own, the same at every restart (a
        # trainer resumes from its newest checkpoint there, a rollout node from its spool).
        config = resolve_config(args, own_dir)
        print(f"run dir: {config.run.dir} (--run-dir to choose another)", flush=True)
    if args.command == "node":
        if args.teacher and args.role != "teacher":
            raise AgentjetError("--teacher is for --role teacher")
        if (args.policy or args.policy_count != 1) and args.role != "trainer":
            raise AgentjetError("--policy and --policy-count are for --role trainer")
        if args.role == "rollout":
            _check_teacher_placement(config, "a rollout node without --join")
        if args.role == "teacher":
            args.teacher = served_teachers(args.teacher, config)
    if args.dry_run:
        return _dry_run(config)
    if args.command in ("node", "coordinator"):
        if not config.net.insecure:
            node_keys(config.net, args.command)  # fail in one line now, not after torch loads
        with hold_run_dir(Path(config.run.dir), role, node_name(config)):
            return _run_node(args, config)
    raise AssertionError(args.command)


def run_eval(args: argparse.Namespace) -> int:
    """`agentjet eval`: every flag and the config checked (a missing reward included), then
    the model loaded and the tasks scored; the summary as JSON on stdout."""
    if args.samples < 0 or args.batch_size < 1:
        raise AgentjetError("--samples must be >= 0 and --batch-size >= 1")
    if args.show < 0:
        raise AgentjetError(f"--show must be >= 0, got {args.show}")
    if (args.checkpoint is None) == (args.policy is None):
        raise AgentjetError("give --checkpoint DIR (or base), or --policy NAME (one of the two)")
    config, env_name, tasks = eval_config(args)
    if args.dry_run:
        return _dry_run(config)
    checkpoint = _eval_checkpoint(args.checkpoint, args.policy, Path(config.run.dir))
    from node.evaluate import evaluate_checkpoint

    summary = evaluate_checkpoint(
        config, checkpoint, tasks, env_name, args.batch_size, args.samples, args.show
    )
    print(json.dumps(summary, indent=2))
    return 0


# Environments whose entries hold held-out tasks of their own (generated rows, a packaged
# eval set): `agentjet eval` needs no --tasks for them, and gives them no task_file.
HELD_OUT_WITHOUT_FILE = ("reasoning_gym", "verifiers")


def eval_config(args: argparse.Namespace) -> tuple[Config, str, Path | None]:
    """`agentjet eval`'s config, the environment that scores and the task file.

    --env names an [[envs]] entry; a config without one of that name gets one, so that on
    the defaults `--env prompt --set envs.0.reward=mod:fn` is the whole prompt environment.
    Without --env: the config's one environment (a run dir's config.toml: the run's, with
    its reward and columns). The entry's task_file is the --tasks file (eval reads no
    other, and a prompt environment must name one); without --tasks, its eval_file, else
    None: the entry's generated or packaged held-out tasks (reasoning_gym, verifiers).
    """
    data = read_config_file(args.config)
    envs = data.setdefault("envs", [])
    if not isinstance(envs, list):
        raise ConfigError("config error at envs: expected a list of [[envs]] tables")
    if args.env is not None and not any(_entry_name(e) == args.env for e in envs):
        envs.append({"name": args.env})
    elif not envs:
        envs.append({"name": EnvConfig().name})
    overrides = list(args.set)
    if args.run_dir is not None:
        overrides.append(f"run.dir={json.dumps(str(args.run_dir))}")
    apply_overrides(data, overrides)
    names = [_entry_name(e) for e in data["envs"]]
    env_name = args.env
    if env_name is None:
        if len(names) != 1:
            raise AgentjetError(
                f"the config has {len(names)} environments ({', '.join(names)}): "
                "name the one to evaluate with --env"
            )
        env_name = names[0]
    i = names.index(env_name)
    entry = data["envs"][i]
    tasks = args.tasks
    if tasks is None and entry.get("eval_file"):
        tasks = Path(entry["eval_file"])
    if tasks is None:
        if env_name not in HELD_OUT_WITHOUT_FILE:
            raise AgentjetError(
                f"give --tasks FILE: envs.{i} ({env_name}) has no eval_file to evaluate on"
            )
        return config_from_dict(data), env_name, None
    if not tasks.expanduser().exists():
        raise AgentjetError(f"--tasks {tasks}: not found")
    if env_name not in HELD_OUT_WITHOUT_FILE:  # these make their own tasks, and take no file
        entry["task_file"] = str(tasks)
    return config_from_dict(data), env_name, tasks


def _entry_name(entry: object) -> str:
    """An [[envs]] table's name as the config will read it (the default when unnamed)."""
    name = entry.get("name") if isinstance(entry, dict) else None
    return name if isinstance(name, str) else EnvConfig().name


def _run_node(args: argparse.Namespace, config: Config) -> int:
    """Run the coordinator or a node's role in this process (torch loads here, if at all)."""
    if args.command == "coordinator":
        from coordinator.service import main as coordinator_main

        return coordinator_main(config)
    if args.role == "trainer":
        policies = _trainer_policies(args.policy, args.policy_count, config)
        from node.trainer_host import main as trainer_main

        return trainer_main(config, policies)
    if args.role == "teacher":
        from node.teacher_node import main as teacher_main

        return teacher_main(config, args.teacher)
    from node.rollout import main as rollout_main

    return rollout_main(config)


def _trainer_policies(asked: list[str], count: int, config: Config) -> list[str]:
    """The policies a trainer trains: --policy (repeated or NAME,NAME); without it every
    policy, or with --join the `count` of [[policies]] with the fewest trainers in the
    swarm's directory. [""] without [[policies]]."""
    names = [p.name for p in config.policies]
    named = list(dict.fromkeys(n.strip() for text in asked for n in text.split(",")))
    configured = ", ".join(names) or "none"
    for name in named:
        if name not in names:
            raise AgentjetError(f"--policy {name}: no such [[policies]] entry ({configured})")
    if not 1 <= count <= max(len(names), 1):
        raise AgentjetError(
            f"--policy-count {count}: between 1 and the number of policies ({configured})"
        )
    if named:
        return named
    if not names:
        return [""]
    if not config.swarm.initial_peers:
        print(f"training every policy: {configured}", flush=True)
        return names
    from node.directory import read_directory
    from node.trainer import fewest_trainers

    records = read_directory(config.swarm, node_keys(config.net, "trainer"))
    policies = fewest_trainers(names, records, count)
    print(f"training {', '.join(policies)} (the fewest trainers in the swarm)", flush=True)
    return policies


def _eval_checkpoint(checkpoint: str | None, policy: str | None, run_dir: Path) -> str:
    """What `agentjet eval` scores: --checkpoint, or --policy's newest checkpoint."""
    if checkpoint is not None:
        return checkpoint
    saved = run_dir / "policies" / str(policy) / "checkpoints"
    latest = saved / "latest"
    if not latest.is_file():
        raise AgentjetError(
            f"--policy {policy}: no checkpoint in {saved} (is --run-dir the run's, and has "
            "that policy's trainer saved one?)"
        )
    return str(saved / latest.read_text().strip())


def _check_teacher_placement(config: Config, where: str) -> None:
    """Teacher nodes are found in the swarm's directory: a node without one cannot use them."""
    if config.rollout.teachers == "nodes" and not config.swarm.initial_peers:
        raise AgentjetError(
            f'rollout.teachers="nodes" uses teacher nodes of a swarm, which {where} cannot '
            'find: join a swarm (--join), or load teachers in the node (rollout.teachers="local")'
        )


def served_teachers(names: list[str], config: Config) -> list[str]:
    """The teachers a teacher node serves: `--teacher` names, else every teacher the config's
    environments name (in order, once each)."""
    names = names or list(dict.fromkeys(env.teacher for env in config.envs if env.teacher))
    if not names:
        raise AgentjetError(
            "a teacher node needs a teacher to serve: --teacher NAME (a model folder, a "
            "checkpoint, an HF id), or envs[].teacher in the config"
        )
    for name in names:
        if not_a_model_folder(name):
            raise AgentjetError(f"--teacher {name}: not a model folder (no config.json)")
    return names
