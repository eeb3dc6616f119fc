"""`python -m node.beacon`: a swarm DHT peer that keeps one node's record alive, for a
process that must not load torch or hivemind itself (the coordinator).

    parent ──stdin: one JSON line {"swarm": SwarmConfig, "record": NodeRecord,
                                   "keys": the swarm's key file or "" (insecure)}──▶ beacon
    beacon ──stdout: one JSON line {"maddrs": [...]} once the DHT is up ──▶ parent
           then publishes the record every swarm.heartbeat_s until its stdin closes (the
           parent stopped or died) or it gets SIGTERM/SIGINT; then withdraws the record
           and shuts the DHT down. A start that fails prints {"error": "..."} and exits 1.
           With keys, each heartbeat also reads the swarm's revocations and prints those
           new to it, {"revoked": [base64 revocation, ...]}, for the parent's server.
"""

from __future__ import annotations

import base64
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import msgspec

from agentjet import protocol
from agentjet.config import SwarmConfig
from agentjet.errors import AgentjetError
from agentjet.identity import encode_revocation, read_node_keys
from node.dht import start_dht, visible_maddrs
from node.directory import Directory

log = logging.getLogger("beacon")


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s beacon %(levelname)s %(message)s")
    request = json.loads(sys.stdin.readline())
    swarm = msgspec.convert(request["swarm"], SwarmConfig)
    record = msgspec.convert(request["record"], protocol.NodeRecord)
    keys_path = str(request["keys"])
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        keys = read_node_keys(keys_path, record.node_id) if keys_path else None
        dht = start_dht(swarm, keys)
    except AgentjetError as e:
        _reply({"error": str(e)})
        return 1
    try:
        directory = Directory(dht, swarm, keys)
        record.maddrs = visible_maddrs(dht)
        _reply({"maddrs": record.maddrs})

        # The parent holds our stdin open for as long as it lives.
        def wait_for_eof() -> None:
            sys.stdin.read()
            done.set()

        threading.Thread(target=wait_for_eof, daemon=True).start()
        while not done.is_set():
            record.time = time.time()
            if not directory.publish(record):
                log.warning("could not store the %s record in the DHT", record.role)
            if keys is not None:
                membership = keys.membership
                revoked = directory.sync_revocations(membership)
                if revoked:
                    encoded = [encode_revocation(membership.revocations[name]) for name in revoked]
                    _reply({"revoked": [base64.b64encode(data).decode() for data in encoded]})
            done.wait(swarm.heartbeat_s)
        directory.withdraw(record.node_id)
    finally:
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
