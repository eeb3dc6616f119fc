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

Here are the argparse table and the dispatch; each command's work is in a module by topic:
cli_run.py (local, node, coordinator, eval: the commands that run on a config),
cli_status.py (status), cli_keys.py (keys) and cli_tools.py (tasks, agent, dashboard,
sandbox); plot is agentjet_app/plot.py.
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path
from typing import NoReturn

from agentjet.config import ENV_NAMES
from agentjet.errors import AgentjetError
from agentjet.identity import CERTIFICATE_DAYS
from agentjet.keys import DEFAULT_KEYS_FILE
from agentjet_app.cli_keys import keys_init, keys_issue, keys_revoke
from agentjet_app.cli_run import run_configured
from agentjet_app.cli_status import STATUS_TIMEOUT_S, show_status
from agentjet_app.cli_tools import build_sandbox_image, run_agent, serve_dashboard, write_tasks


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
        type=Path,
        help="task file: JSONL, JSON, CSV, Parquet or a datasets folder (read as the "
        "config's [[envs]] entry for --env reads its task_file); default: that entry's "
        "held-out tasks (its eval_file, or a reasoning_gym entry's held-out rows)",
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
        return write_tasks(args)
    if args.command == "status":
        return show_status(args)
    if args.command == "sandbox" and args.action == "build-image":
        return build_sandbox_image(args)
    if args.command == "agent":
        return run_agent(args)
    if args.command == "dashboard":
        return serve_dashboard(args)
    if args.command == "plot":
        from agentjet_app.plot import DEFAULT_DPI, write_plots

        write_plots(args.run_dir, args.out, DEFAULT_DPI if args.dpi is None else args.dpi)
        return 0
    if args.command == "keys" and args.action == "init":
        return keys_init(args.out)
    if args.command == "keys" and args.action == "issue":
        return keys_issue(args.keys, args.node, args.out, args.days)
    if args.command == "keys" and args.action == "revoke":
        return keys_revoke(args)
    return run_configured(args)


if __name__ == "__main__":
    sys.exit(main())
