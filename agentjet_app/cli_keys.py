"""`agentjet keys`: the swarm's key material. `init` writes the root key file, `issue` one
node's own keys and certificate signed with it, `revoke` stores a signed revocation of a
node in the swarm's DHT (agentjet/identity.py, docs/security.md).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from agentjet.errors import AgentjetError
from agentjet.identity import NodeIdentity, NodeKeys, RootKey, server_keys, write_node_keys
from agentjet.keys import read_keys, write_keys


def keys_init(path: Path) -> int:
    write_keys(path)
    print(
        f"wrote the swarm's keys to {path} (mode 0600)\n"
        f"copy it to every machine of the swarm and start each node with --keys {path}; "
        "whoever holds it can join the swarm, so keep it private"
    )
    return 0


def keys_issue(root_file: Path, name: str, out: Path | None, days: float) -> int:
    root = read_keys(root_file)
    identity = NodeIdentity.new(RootKey.from_swarm_keys(root), name, days=days)
    out = out or Path(f"{name}.keys")
    write_node_keys(out, identity, server_keys(root))
    print(
        f"wrote {name}'s keys to {out} (mode 0600; certificate {identity.certificate.serial}, "
        f"valid {days:g} days): copy it to that node only and start it with --keys {out}"
    )
    return 0


def keys_revoke(args: argparse.Namespace) -> int:
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
