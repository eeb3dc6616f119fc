"""The `agentjet` command. Parses arguments and config, then dispatches lazily to a role.

    agentjet local        coordinator + trainer + rollout node on this box
    agentjet node         --role trainer|rollout, one role of a swarm
    agentjet coordinator  hands out (environment, task) work
    agentjet eval         greedy accuracy of a checkpoint on a task file
    agentjet tasks        write a generated arithmetic task file

Heavy imports (torch, hivemind) happen only after arguments and config are valid, so
`--help` and `--dry-run` are instant and every user error is one clear line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NoReturn

from agentjet.config import ENV_NAMES, Config, load_config, to_toml
from agentjet.errors import AgentjetError


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="agentjet", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )

    local = sub.add_parser("local", help="train on one box: all roles on loopback")
    _config_args(local)
    local.add_argument("--max-steps", type=int, help="stop after this many policy versions")

    node = sub.add_parser("node", help="run one trainer or rollout node")
    node.add_argument("--role", choices=["trainer", "rollout"], required=True)
    _config_args(node)

    coord = sub.add_parser("coordinator", help="run the coordinator")
    _config_args(coord)

    ev = sub.add_parser("eval", help="greedy accuracy of a checkpoint on a JSONL task file")
    ev.add_argument("--checkpoint", required=True, help="checkpoint dir, or 'base'")
    ev.add_argument("--tasks", required=True, type=Path, help="JSONL task file")
    ev.add_argument("--env", default="arithmetic", choices=ENV_NAMES)
    ev.add_argument("--batch-size", type=int, default=64, help="tasks per engine batch")
    _config_args(ev)

    tasks = sub.add_parser("tasks", help="write generated arithmetic tasks as JSONL")
    tasks.add_argument("--count", type=int, required=True)
    tasks.add_argument("--seed", type=int, default=0)
    tasks.add_argument("--difficulties", default="1,2,3", help="comma-separated digits, 1-3")
    tasks.add_argument("--ops", default="+,-,*", help="comma-separated operators")
    tasks.add_argument("--out", type=Path, required=True)
    return parser


def _resolve(args: argparse.Namespace, default_run_dir: str | None = None) -> Config:
    overrides = list(args.set)
    if getattr(args, "max_steps", None) is not None:
        if args.max_steps < 0:
            raise AgentjetError(f"--max-steps must be >= 0, got {args.max_steps}")
        overrides.append(f"run.max_steps={args.max_steps}")
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


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "tasks":
        return _tasks(args)
    if args.command == "local":
        default_dir = None
        if args.run_dir is None and not any(s.startswith("run.dir=") for s in args.set):
            default_dir = f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        config = _resolve(args, default_dir)
        if args.dry_run:
            return _dry_run(config)
        from agentjet.local import run_local

        return run_local(config, Path(config.run.dir))
    config = _resolve(args)
    if args.dry_run:
        return _dry_run(config)
    if args.command == "coordinator":
        from coordinator.service import main as coordinator_main

        return coordinator_main(config)
    if args.command == "node" and args.role == "trainer":
        from node.trainer import main as trainer_main

        return trainer_main(config)
    if args.command == "node":
        from node.rollout import main as rollout_main

        return rollout_main(config)
    if args.command == "eval":
        from node.evaluate import evaluate_checkpoint

        summary = evaluate_checkpoint(
            config, args.checkpoint, args.tasks, args.env, batch_size=args.batch_size
        )
        print(json.dumps(summary, indent=2))
        return 0
    raise AssertionError(args.command)


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
    tasks = generate_tasks(args.count, args.seed, difficulties, ops)
    write_task_file(tasks, args.out)
    print(f"wrote {len(tasks)} tasks to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
