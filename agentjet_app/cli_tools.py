"""The commands beside a run's roles, which take no --config: `agentjet tasks` (a generated
task file), `agent` (external agents playing a rollout node's episodes), `dashboard` (a run
dir or a live swarm in a browser) and `sandbox build-image`. Each checks its flags, then
imports what does the work.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from agentjet.errors import AgentjetError
from agentjet.identity import node_keys


def write_tasks(args: argparse.Namespace) -> int:
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


def run_agent(args: argparse.Namespace) -> int:
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


def serve_dashboard(args: argparse.Namespace) -> int:
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


def build_sandbox_image(args: argparse.Namespace) -> int:
    from sandboxes.image import DEFAULT_IMAGE, build_image

    build_image(args.tag or DEFAULT_IMAGE, mirror=args.mirror, suite=args.suite, force=args.force)
    return 0
