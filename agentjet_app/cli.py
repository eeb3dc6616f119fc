"""The `agentjet` command. Parses arguments and config, then dispatches lazily to a role.

    agentjet local        coordinator + trainer + rollout node on this box
    agentjet node         --role trainer|rollout|teacher, one role of a swarm
    agentjet coordinator  hands out (environment, task) work
    agentjet eval         accuracy of a checkpoint on a task file (greedy or sampled)
    agentjet tasks        write a generated task file
    agentjet status       ask a running coordinator what it hands out and has learned
    agentjet keys         init: the swarm's root key file; issue, revoke: one node's keys
    agentjet sandbox      build-image: the docker sandbox image, offline from Debian packages
    agentjet agent        play a rollout node's agent episodes from another process
    agentjet dashboard    watch a run (--run-dir) or a live swarm (--join) in a browser
    agentjet plot         PNGs of a run's main curves, for reports

Heavy imports (torch, hivemind) happen only after arguments and config are valid, so
`--help` and `--dry-run` are instant and every user error is one clear line.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from agentjet.config import (
    ENV_NAMES,
    Config,
    is_endpoint,
    load_config,
    not_a_model_folder,
    to_toml,
)
from agentjet.errors import AgentjetError
from agentjet.identity import (
    CERTIFICATE_DAYS,
    NodeIdentity,
    NodeKeys,
    RootKey,
    node_keys,
    server_keys,
    write_node_keys,
)
from agentjet.keys import DEFAULT_KEYS_FILE, read_keys, write_keys
from agentjet.rundir import default_run_dir, hold_run_dir, node_name

if TYPE_CHECKING:
    from agentjet.protocol import CoordinatorStatus, GpuStats, NodeRecord, SchedulerRow

# `agentjet status` gives up on a coordinator that has not answered within this long.
STATUS_TIMEOUT_S = 5.0


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line that names the problem, like config errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"agentjet: error: {message} (see {self.prog} --help)\n")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML config file (default: built-in defaults)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set trainer.lr=2e-5 (repeatable)",
    )
    p.add_argument("--run-dir", type=Path, help="where metrics, logs and checkpoints go")
    p.add_argument("--dry-run", action="store_true", help="validate, write the config, exit")


def _keys_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keys",
        type=Path,
        metavar="FILE",
        help="the swarm's key file from `agentjet keys init` (sets net.keys)",
    )


def _swarm_args(p: argparse.ArgumentParser) -> None:
    _keys_arg(p)
    p.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="a peer of the swarm to join, as printed by its first node (repeatable)",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="serve on PORT (ZMQ) and run the swarm peer on PORT+1; 0.0.0.0 needs --announce",
    )
    p.add_argument(
        "--announce", metavar="HOST:PORT", help="the address other machines reach --listen at"
    )
    p.add_argument(
        "--identity", metavar="FILE", help="this node's peer key (made on first use): a stable id"
    )


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="agentjet", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )

    local = sub.add_parser("local", help="train on one box: all roles on loopback")
    _config_args(local)
    _keys_arg(local)
    local.add_argument("--max-steps", type=int, help="stop after this many policy versions")

    node = sub.add_parser("node", help="run one trainer, rollout or teacher node of a swarm")
    node.add_argument("--role", choices=["trainer", "rollout", "teacher"], required=True)
    node.add_argument(
        "--teacher",
        action="append",
        default=[],
        metavar="NAME",
        help="with --role teacher: a teacher to serve, as envs[].teacher names it "
        "(repeatable; default: every teacher the config's environments name)",
    )
    node.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME",
        help="with --role trainer and [[policies]]: a policy to train (repeatable, or "
        "NAME,NAME; default: every policy, or with --join the --policy-count policies with "
        "the fewest trainers in the swarm)",
    )
    node.add_argument(
        "--policy-count",
        type=int,
        default=1,
        metavar="N",
        help="with --role trainer, --join and no --policy: how many policies to train (those "
        "with the fewest trainers; default 1)",
    )
    _swarm_args(node)
    _config_args(node)

    coord = sub.add_parser("coordinator", help="run the coordinator")
    _swarm_args(coord)
    _config_args(coord)

    ev = sub.add_parser("eval", help="accuracy of a checkpoint on a task file")
    ev.add_argument("--checkpoint", help="checkpoint dir, or 'base'")
    ev.add_argument(
        "--policy",
        metavar="NAME",
        help="instead of --checkpoint: the newest checkpoint of [[policies]] entry NAME "
        "in the run dir (--run-dir, RUN_DIR/policies/NAME/checkpoints)",
    )
    ev.add_argument(
        "--tasks",
        required=True,
        type=Path,
        help="task file: JSONL, JSON, CSV, Parquet or a datasets folder (read as the "
        "config's [[envs]] entry for --env reads its task_file)",
    )
    ev.add_argument("--env", default="arithmetic", choices=ENV_NAMES)
    ev.add_argument("--batch-size", type=int, default=64, help="answers per engine batch")
    ev.add_argument(
        "--samples",
        type=int,
        default=0,
        help="answers sampled per task at rollout.sampling's temperature (default 0: greedy)",
    )
    _config_args(ev)

    tasks = sub.add_parser("tasks", help="write generated tasks as JSONL (for eval)")
    tasks.add_argument("--env", default="arithmetic", choices=ENV_NAMES)
    tasks.add_argument("--count", type=int, required=True)
    tasks.add_argument("--seed", type=int, default=0)
    tasks.add_argument("--difficulties", default="1,2,3", help="comma-separated digits, 1-3")
    tasks.add_argument(
        "--ops", default="+,-,*", help="comma-separated operators (arithmetic environments)"
    )
    tasks.add_argument("--out", type=Path, required=True)

    status = sub.add_parser(
        "status", help="the swarm's nodes (--join), or what a coordinator hands out and has learned"
    )
    where = status.add_mutually_exclusive_group(required=True)
    where.add_argument("--join", metavar="MULTIADDR", help="any peer of the swarm: list its nodes")
    where.add_argument(
        "--coordinator", metavar="ENDPOINT", help="tcp://HOST:PORT or ipc://PATH: its scheduler"
    )
    status.add_argument("--run-id", default="agentjet", help="the swarm's swarm.run_id (--join)")
    status.add_argument(
        "--timeout-s", type=float, default=STATUS_TIMEOUT_S, help="give up after this long"
    )
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    _keys_arg(status)
    status.add_argument(
        "--insecure", action="store_true", help="talk to a swarm that runs with net.insecure"
    )

    keys = sub.add_parser("keys", help="the swarm's key material (ZeroMQ CURVE)")
    key_actions = keys.add_subparsers(
        dest="action", required=True, metavar="ACTION", parser_class=_Parser
    )
    init = key_actions.add_parser(
        "init",
        help="make a new swarm key file (mode 0600); copy it to every node of the swarm",
    )
    init.add_argument("--out", type=Path, default=Path(DEFAULT_KEYS_FILE), help="where to write it")
    issue = key_actions.add_parser(
        "issue",
        help="make one node's own keys and certificate, signed with the swarm's root file",
    )
    issue.add_argument("--node", required=True, metavar="NAME", help="the node's name")
    issue.add_argument(
        "--keys", type=Path, default=Path(DEFAULT_KEYS_FILE), help="the swarm's root key file"
    )
    issue.add_argument("--out", type=Path, help="where to write it (default: NAME.keys)")
    issue.add_argument(
        "--days", type=float, default=CERTIFICATE_DAYS, help="how long the certificate is valid"
    )
    revoke = key_actions.add_parser(
        "revoke",
        help="shut one node out of a live swarm (its certificates issued so far), signed with "
        "the swarm's root file",
    )
    revoke.add_argument("node", metavar="NAME", help="the node's name")
    revoke.add_argument(
        "--keys", type=Path, default=Path(DEFAULT_KEYS_FILE), help="the swarm's root key file"
    )
    revoke.add_argument(
        "--join", action="append", required=True, metavar="MULTIADDR", help="a peer of the swarm"
    )
    revoke.add_argument("--run-id", default="agentjet", help="the swarm's swarm.run_id")

    sandbox = sub.add_parser("sandbox", help="manage the docker sandbox image")
    actions = sandbox.add_subparsers(
        dest="action", required=True, metavar="ACTION", parser_class=_Parser
    )
    image = actions.add_parser(
        "build-image",
        help="build the docker sandbox image offline from Debian packages (root, ~30 s)",
        description="debootstrap a minimal Debian with python3 from this machine's apt "
        "mirror and import it into docker; an existing image is kept unless --force",
    )
    image.add_argument("--tag", help="image name (default: the docker backend's default image)")
    image.add_argument("--mirror", metavar="URL", help="Debian mirror (default: from apt sources)")
    image.add_argument("--suite", help="Debian suite, e.g. bookworm (default: from apt sources)")
    image.add_argument("--force", action="store_true", help="rebuild even if the image exists")

    agent = sub.add_parser(
        "agent",
        help="play a rollout node's agent episodes from this process (external agents)",
        description="claim episodes of an agent environment with external = true from a "
        "rollout node, run your agent against the episode's OpenAI endpoint, report rewards",
    )
    agent.add_argument("--rollout", required=True, metavar="URL", help="e.g. http://HOST:PORT")
    agent.add_argument(
        "--agent", required=True, metavar="MODULE:FUNCTION", help="async (task, client) -> reward"
    )
    agent.add_argument("--token", default="", help="the node's rollout.agent_token")
    agent.add_argument("--concurrency", type=int, default=4, help="episodes played at once")
    agent.add_argument("--episodes", type=int, default=0, help="stop after N (0 = run on)")
    agent.add_argument(
        "--app-dir",
        default=".",
        metavar="DIR",
        help="import MODULE from DIR first (default: the current directory), as uvicorn does",
    )

    dashboard = sub.add_parser(
        "dashboard",
        help="watch a run in a browser: curves, nodes, trajectories down to the token",
        description="serve a run dir (running or finished), or a live swarm (--join), as a "
        "live web page; with --run-dir, settings not given here come from [dashboard] in the "
        "run dir's config.toml",
    )
    shown = dashboard.add_mutually_exclusive_group(required=True)
    shown.add_argument("--run-dir", type=Path, help="the run to show")
    shown.add_argument(
        "--join",
        action="append",
        metavar="MULTIADDR",
        help="a peer of a live swarm: show its nodes from the directory (repeatable)",
    )
    dashboard.add_argument(
        "--run-id", default="agentjet", help="the swarm's swarm.run_id (with --join)"
    )
    _keys_arg(dashboard)
    dashboard.add_argument(
        "--insecure", action="store_true", help="a swarm that runs with net.insecure (--join)"
    )
    dashboard.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="where to serve (default dashboard.listen: 127.0.0.1 on a free port); any "
        "address but loopback needs a token",
    )
    dashboard.add_argument(
        "--token",
        help="what the browser must send (?token= or Authorization: Bearer); default "
        "dashboard.token",
    )

    plot = sub.add_parser(
        "plot",
        help="PNGs of a run's main curves, for reports",
        description="draw a run dir's curves (reward, held-out accuracy, zero-variance "
        "share, samples/s, staleness, step time, logprob gap, losses, an overview) as PNG "
        "files with matplotlib; x axis: wall time since the run's first metrics row",
    )
    plot.add_argument("--run-dir", type=Path, required=True, help="the run to plot")
    plot.add_argument("--out", type=Path, help="where the PNGs go (default <run dir>/plots)")
    plot.add_argument("--dpi", type=int, help="pixels per inch (default 100)")
    return parser


def _resolve(args: argparse.Namespace, default_run_dir: str | None = None) -> Config:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except AgentjetError as e:
        print(f"agentjet: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        where = f" ({e.filename})" if e.filename else ""
        print(
            f"agentjet: error: the disk is full{where}. Free space (old run dirs; fewer "
            "checkpoints with trainer.keep_checkpoints) and start again on the same run dir: "
            "nodes resume from their spool and newest checkpoint.",
            file=sys.stderr,
        )
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "tasks":
        return _tasks(args)
    if args.command == "status":
        return _status(args)
    if args.command == "sandbox" and args.action == "build-image":
        return _build_image(args)
    if args.command == "agent":
        return _agent(args)
    if args.command == "dashboard":
        return _dashboard(args)
    if args.command == "plot":
        from agentjet_app.plot import DEFAULT_DPI, write_plots

        write_plots(args.run_dir, args.out, DEFAULT_DPI if args.dpi is None else args.dpi)
        return 0
    if args.command == "keys" and args.action == "init":
        return _keys_init(args.out)
    if args.command == "keys" and args.action == "issue":
        return _keys_issue(args.keys, args.node, args.out, args.days)
    if args.command == "keys" and args.action == "revoke":
        return _keys_revoke(args)
    if args.command == "local":
        default_dir = None
        if args.run_dir is None and not any(s.startswith("run.dir=") for s in args.set):
            default_dir = f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        config = _resolve(args, default_dir)
        _check_teacher_placement(config, "agentjet local")
        if args.dry_run:
            return _dry_run(config)
        from agentjet_app.local import run_local

        return run_local(config, Path(config.run.dir))
    config = _resolve(args)
    role = args.role if args.command == "node" else args.command
    own_dir = default_run_dir(role, config) if args.command in ("node", "coordinator") else None
    if own_dir is not None and args.run_dir is None:
        # Not set anywhere: a run dir of this node's own, the same at every restart (a
        # trainer resumes from its newest checkpoint there, a rollout node from its spool).
        config = _resolve(args, own_dir)
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
    if args.command == "eval":
        from node.evaluate import evaluate_checkpoint

        if args.samples < 0 or args.batch_size < 1:
            raise AgentjetError("--samples must be >= 0 and --batch-size >= 1")
        checkpoint = _eval_checkpoint(args.checkpoint, args.policy, Path(config.run.dir))
        summary = evaluate_checkpoint(
            config, checkpoint, args.tasks, args.env, args.batch_size, args.samples
        )
        print(json.dumps(summary, indent=2))
        return 0
    raise AssertionError(args.command)


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


def _eval_checkpoint(checkpoint: str | None, policy: str | None, run_dir: Path) -> str:
    """What `agentjet eval` scores: --checkpoint, or --policy's newest checkpoint."""
    if (checkpoint is None) == (policy is None):
        raise AgentjetError("give --checkpoint DIR (or base), or --policy NAME (one of the two)")
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


def _tasks(args: argparse.Namespace) -> int:
    from agentjet.tasks import generate_tasks, write_task_file

    try:
        difficulties = [int(d) for d in args.difficulties.split(",")]
    except ValueError:
        raise AgentjetError(
            f"--difficulties: {args.difficulties!r} is not a comma-separated list of 1,2,3"
        ) from None
    ops = args.ops.split(",")
    if not set(difficulties) <= {1, 2, 3} or not set(ops) <= {"+", "-", "*"} or args.count < 1:
        raise AgentjetError("--difficulties must be within 1,2,3, --ops within +,-,*, --count >= 1")
    try:
        tasks = generate_tasks(args.count, args.seed, difficulties, ops, args.env)
    except ValueError as e:
        raise AgentjetError(str(e)) from None
    write_task_file(tasks, args.out)
    print(f"wrote {len(tasks)} tasks to {args.out}")
    return 0


def _keys_init(path: Path) -> int:
    write_keys(path)
    print(
        f"wrote the swarm's keys to {path} (mode 0600)\n"
        f"copy it to every machine of the swarm and start each node with --keys {path}; "
        "whoever holds it can join the swarm, so keep it private"
    )
    return 0


def _keys_issue(root_file: Path, name: str, out: Path | None, days: float) -> int:
    root = read_keys(root_file)
    identity = NodeIdentity.new(RootKey.from_swarm_keys(root), name, days=days)
    out = out or Path(f"{name}.keys")
    write_node_keys(out, identity, server_keys(root))
    print(
        f"wrote {name}'s keys to {out} (mode 0600; certificate {identity.certificate.serial}, "
        f"valid {days:g} days): copy it to that node only and start it with --keys {out}"
    )
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    from agentjet.config import SwarmConfig

    root = read_keys(args.keys)
    revocation = RootKey.from_swarm_keys(root).revoke(args.node)
    config = SwarmConfig(run_id=args.run_id, initial_peers=args.join)
    from node.dht import start_dht
    from node.directory import Directory

    dht = start_dht(config, NodeKeys.from_root(root, f"revoker-{os.getpid()}"), client_mode=True)
    try:
        stored = Directory(dht, config).revoke(revocation)
    finally:
        dht.shutdown()
    if not stored:
        raise AgentjetError(f"could not store the revocation of {args.node} in the swarm's DHT")
    print(
        f"revoked {args.node}: every trainer refuses it from its next directory read "
        f"(swarm.heartbeat_s, default {config.heartbeat_s:g} s); a certificate issued to "
        f"{args.node} from now on is valid again"
    )
    return 0


def _agent(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    import uvloop

    from agentjet.agent_runner import load_callable, run_agents
    from agentjet.roles import setup_logging

    if args.concurrency < 1 or args.episodes < 0:
        raise AgentjetError("--concurrency must be >= 1 and --episodes >= 0")
    if not args.rollout.startswith(("http://", "https://")):
        raise AgentjetError(f"--rollout {args.rollout!r} must be a URL: http://HOST:PORT")
    if not Path(args.app_dir).is_dir():
        raise AgentjetError(f"--app-dir {args.app_dir}: no such directory")
    agent = load_callable(args.agent, "--agent", args.app_dir)
    setup_logging("agent")
    for chatty in ("httpx", "httpx2", "httpcore", "openai"):  # a line per request otherwise
        logging.getLogger(chatty).setLevel(logging.WARNING)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_agents(
            args.rollout.rstrip("/"),
            agent,
            token=args.token,
            concurrency=args.concurrency,
            episodes=args.episodes,
            stop=stop,
        )

    finished = uvloop.run(main())
    print(f"{finished} episodes finished")
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    import tomllib

    from agentjet.config import config_from_dict, dashboard_address

    if args.join:
        return _live_dashboard(args)
    if args.keys or args.insecure or args.run_id != "agentjet":
        raise AgentjetError("--keys, --insecure and --run-id go with --join (a live swarm)")
    if not args.run_dir.is_dir():
        raise AgentjetError(f"--run-dir {args.run_dir}: no such directory")
    section = {}
    run_config = args.run_dir / "config.toml"
    if run_config.is_file():
        try:
            section = tomllib.loads(run_config.read_text()).get("dashboard", {})
        except tomllib.TOMLDecodeError as e:
            raise AgentjetError(f"{run_config} is not valid TOML: {e}") from None
    settings = config_from_dict({"dashboard": section}).dashboard
    token = settings.token if args.token is None else args.token
    where = "--listen" if args.listen else f"dashboard.listen in {run_config}"
    host, port = dashboard_address(args.listen or settings.listen, token, where)
    from agentjet_app.dashboard.server import run_dashboard

    return run_dashboard(args.run_dir, host, port, token)


def _live_dashboard(args: argparse.Namespace) -> int:
    from agentjet.config import DashboardConfig, NetConfig, SwarmConfig, dashboard_address

    net = NetConfig(keys=str(args.keys or ""), insecure=args.insecure)
    keys = node_keys(net, f"dashboard-{os.getpid()}")
    token = args.token or ""
    host, port = dashboard_address(args.listen or DashboardConfig().listen, token, "--listen")
    config = SwarmConfig(run_id=args.run_id, initial_peers=args.join)
    from agentjet_app.dashboard.swarm import run_live_dashboard

    return run_live_dashboard(config, keys, host, port, token)


def _build_image(args: argparse.Namespace) -> int:
    from sandboxes.image import DEFAULT_IMAGE, build_image

    build_image(args.tag or DEFAULT_IMAGE, mirror=args.mirror, suite=args.suite, force=args.force)
    return 0


def _status(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    from agentjet.config import NetConfig

    net = NetConfig(keys=str(args.keys or ""), insecure=args.insecure)
    keys = node_keys(net, f"status-{os.getpid()}")
    if args.join:
        return _swarm_status(args, keys)
    status = asyncio.run(_fetch_status(args.coordinator, args.timeout_s, keys))
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(status)).decode())
    else:
        print(format_status(status))
    return 0


def _swarm_status(args: argparse.Namespace, keys: NodeKeys | None) -> int:
    import msgspec

    from agentjet.config import SwarmConfig

    if args.timeout_s <= 0:
        raise AgentjetError(f"--timeout-s must be > 0, got {args.timeout_s}")
    config = SwarmConfig(
        run_id=args.run_id,
        initial_peers=[args.join],
        startup_timeout_s=args.timeout_s,
        startup_attempts=1,
    )
    from node.directory import read_directory

    records = read_directory(config, keys)
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(records)).decode())
    else:
        print(format_swarm(records, now=time.time()))
    return 0


def format_swarm(records: list[NodeRecord], now: float) -> str:
    """The swarm's nodes by role: address, policy version, queue, throughput, last heartbeat,
    each GPU the node uses (one line each); then each teacher node's teachers (its queue:
    requests waiting, its samples/s: samples scored), the nodes each trainer has quarantined,
    why a trainer's gradient rounds keep failing, and what each trainer refused (non-members'
    calls, bad certificates) by kind."""
    if not records:
        return "no live nodes in the swarm's directory (is --run-id right?)"
    order = {"coordinator": 0, "trainer": 1, "rollout": 2, "teacher": 3}
    header = ("role", "node", "address", "version", "queue", "samples/s", "heartbeat", "gpus")
    rows = [
        row
        for r in sorted(records, key=lambda r: (order.get(r.role, 3), r.node_id))
        for row in _node_rows(r, now)
    ]
    counts = ", ".join(
        f"{n} {role}"
        for role in order
        if (n := sum(r.role == role for r in records)) or role != "teacher"
    )
    by_id = sorted(records, key=lambda r: r.node_id)
    teachers = [f"teachers on {r.node_id}: {', '.join(r.teachers)}" for r in by_id if r.teachers]
    quarantines = [
        f"quarantined by {r.node_id}: {', '.join(r.quarantined)}" for r in by_id if r.quarantined
    ]
    rounds = [f"rounds of {r.node_id}: {r.rounds}" for r in by_id if r.rounds]
    refusals = [
        f"refused by {r.node_id}: "
        + ", ".join(f"{kind.replace('_', ' ')} {n}" for kind, n in sorted(r.refused.items()))
        for r in by_id
        if r.refused
    ]
    table = _aligned([header, *rows], left=(0, len(header) - 1))
    return "\n".join([f"swarm: {counts}", *table, *teachers, *quarantines, *rounds, *refusals])


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


def _node_rows(r: NodeRecord, now: float) -> list[tuple[str, ...]]:
    """A node's line of the swarm's table, and one more (blank but for the gpus column) per
    GPU past its first."""
    working = r.role != "coordinator"
    gpus = [_gpu_cell(gpu) for gpu in r.gpus] or ["-"]
    first = (
        r.role,
        r.node_id,
        r.endpoint or (r.maddrs[0] if r.maddrs else "-"),
        _version_cell(r),
        f"{r.queue}/{r.capacity}" if working else "-",
        f"{r.samples_per_s:.2f}" if working else "-",
        f"{max(now - r.time, 0):.1f} s ago",
        gpus[0],
    )
    return [first, *(("",) * (len(first) - 1) + (gpu,) for gpu in gpus[1:])]


def _version_cell(r: NodeRecord) -> str:
    """The policy version a node trains or samples with; with [[policies]], `NAME:VERSION`
    (a trainer's policy, each policy a rollout node holds)."""
    if r.role == "trainer":
        return f"{r.policy}:{r.policy_version}" if r.policy else str(r.policy_version)
    if r.role == "rollout":
        held = " ".join(f"{name}:{v}" for name, v in sorted(r.policy_versions.items()))
        return held or str(r.policy_version)
    return "-"


def _gpu_cell(gpu: GpuStats) -> str:
    """One GPU as `0: 87% 30.1/80.0 GiB 312 W 64C` (power and temperature where reported)."""
    used, total = gpu.mem_used_mb / 1024, gpu.mem_total_mb / 1024
    cell = f"{gpu.index}: {gpu.util_pct:.0f}% {used:.1f}/{total:.1f} GiB"
    if gpu.power_w is not None:
        cell += f" {gpu.power_w:.0f} W"
    if gpu.temp_c is not None:
        cell += f" {gpu.temp_c:.0f}C"
    return cell


async def _fetch_status(
    endpoint: str, timeout_s: float, keys: NodeKeys | None
) -> CoordinatorStatus:
    from agentjet import protocol
    from agentjet.transport import PeerUnavailable, outsider_client

    if not is_endpoint(endpoint):
        raise AgentjetError(f"--coordinator {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    if timeout_s <= 0:
        raise AgentjetError(f"--timeout-s must be > 0, got {timeout_s}")
    client = outsider_client(endpoint, "coordinator", keys, timeout_s, "status")
    try:
        reply = await client.request(protocol.StatusRequest())
    except PeerUnavailable:
        raise AgentjetError(
            f"no answer from {endpoint} within {timeout_s:g} s; is the coordinator running "
            "there, and are these its swarm's keys?"
        ) from None
    finally:
        client.close()
    if not isinstance(reply, protocol.CoordinatorStatus):
        raise AgentjetError(f"{endpoint} answered the status request with {reply}")
    return reply


def format_status(status: CoordinatorStatus) -> str:
    """The status as a user reads it: counters, nodes, then the scheduler's table."""
    nodes = ", ".join(f"{node} ({age:.1f} s ago)" for node, age in sorted(status.nodes.items()))
    lines = [
        f"scheduler {status.scheduler or '?'}: {status.grants_issued} grants issued, "
        f"{status.grants_completed} completed, {status.grants_expired} expired, "
        f"{status.leases_open} leases open, {status.regrants_queued} queued for re-grant, "
        f"{status.rejected_messages} messages rejected, "
        f"{status.denied_handshakes} connections without the swarm's keys refused",
        f"nodes: {nodes or 'none'}",
    ]
    if status.refused:
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(status.refused.items()))
        lines.insert(1, f"requests refused as no member's: {kinds}")
    share = f"last {status.recent_grants}"
    for level, title, extra in (
        ("env", "environment (observed)", ("target", "failed", "keep")),
        ("cell", "top cells (predicted)", ("score",)),
        ("task", "top tasks (predicted)", ()),
    ):
        rows = [row for row in status.table if row.level == level]
        if rows:
            header = (title, "visits", "reward", "variance", "P(mixed)", *extra, share)
            body = [_row_cells(row, extra) for row in rows]
            lines += ["", *_aligned([header, *body])]
    return "\n".join(lines)


def _row_cells(row: SchedulerRow, extra: tuple[str, ...]) -> tuple[str, ...]:
    def num(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    extras = {
        "target": num(row.target_share, 2),
        "failed": num(row.failure_rate, 2),
        "score": num(row.score),
        "keep": num(row.keep, 2),
    }
    return (
        row.name,
        str(row.visits),
        num(row.mean_reward),
        num(row.variance),
        num(row.mixed, 2),
        *(extras[name] for name in extra),
        f"{row.grant_share:.0%}",
    )


def _aligned(rows: list[tuple[str, ...]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Columns padded to their widest cell: the `left` columns (names) left-aligned, the
    others (numbers) right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i in left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


if __name__ == "__main__":
    sys.exit(main())
