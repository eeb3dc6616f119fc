"""`python -m coordinator CONFIG [--set key=value ...]`: run the coordinator role alone.

The `agentjet` CLI is the usual entry; this one needs nothing but the config file.
"""

from __future__ import annotations

import argparse
import sys

from agentjet.config import load_config
from agentjet.errors import AgentjetError


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__)
    parser.add_argument("config", help="TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from coordinator.service import main  # after parsing: --help stays instant

    try:
        return main(load_config(args.config, args.overrides))
    except AgentjetError as e:  # a bad config or key file, no keys: one line
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
