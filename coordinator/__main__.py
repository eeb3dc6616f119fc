"""`python -m coordinator CONFIG [--set key=value ...]`: run the coordinator role alone.

The `agentjet` CLI is the usual entry; this one needs nothing but the config file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentjet.config import load_config
from agentjet.errors import AgentjetError
from agentjet.rundir import default_run_dir, hold_run_dir, node_name


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__)
    parser.add_argument("config", help="TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from coordinator.service import main  # after parsing: --help stays instant

    try:
        config = load_config(args.config, args.overrides)
        own_dir = default_run_dir("coordinator", config)
        if own_dir is not None:
            config = load_config(args.config, [*args.overrides, f"run.dir={json.dumps(own_dir)}"])
            print(f"run dir: {own_dir} (--set run.dir=DIR to choose another)", flush=True)
        with hold_run_dir(Path(config.run.dir), "coordinator", node_name(config)):
            return main(config)
    except AgentjetError as e:  # a bad config or key file, no keys: one line
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
