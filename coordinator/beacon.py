"""The coordinator's entry in the swarm's directory, kept alive by a child process.

    Coordinator ──spawn──▶ python -m node.beacon  (a DHT peer; it loads hivemind and torch
                 ──stdin: swarm config + record──▶  so that the coordinator never does)
                 ◀──stdout: {"maddrs": [...]}──     (ready: the swarm's join address)
                 ◀──stdout: {"revoked": [...]}──    (revocations read in the swarm, as they
                                                     appear: `take_revocations`)

The child lives as long as its stdin is open: when the coordinator stops, or dies, the
pipe closes and the beacon withdraws the record and shuts its DHT down by itself.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import os
import select
import signal
import subprocess
import sys

import msgspec

from agentjet import protocol
from agentjet.config import SwarmConfig
from agentjet.errors import AgentjetError
from agentjet.identity import Membership

log = logging.getLogger(__name__)

# Python start-up plus importing hivemind and torch, before the DHT's own start-up time.
IMPORT_S = 60.0
STOP_GRACE_S = 15.0


class Beacon:
    def __init__(self, swarm: SwarmConfig, record: protocol.NodeRecord, keys_path: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "node.beacon"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches only the coordinator
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {
            "swarm": msgspec.to_builtins(swarm),
            "record": msgspec.to_builtins(record),
            "keys": keys_path,  # "" with net.insecure
        }
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        timeout_s = IMPORT_S + swarm.startup_timeout_s * swarm.startup_attempts
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else b""
        try:
            reply = json.loads(line)
        except ValueError:
            reply = {"error": f"no answer within {timeout_s:.0f} s" if not ready else "it died"}
        if "maddrs" not in reply:
            self.close()
            raise AgentjetError(f"the coordinator's DHT peer did not start: {reply['error']}")
        self.maddrs: list[str] = reply["maddrs"]

    async def take_revocations(self, membership: Membership) -> None:
        """Hand `membership` each revocation the beacon reports, as its lines arrive (the
        event loop watches the pipe; nothing blocks). A beacon that exits ends the run: the
        coordinator would be out of the directory, deaf to revocations."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        os.set_blocking(fd, False)
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[bytes] = asyncio.Queue()
        pending = b""

        def readable() -> None:
            nonlocal pending
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                loop.remove_reader(fd)
                lines.put_nowait(b"")
                return
            *complete, pending = (pending + chunk).split(b"\n")
            for line in complete:
                lines.put_nowait(line)

        loop.add_reader(fd, readable)
        try:
            while line := await lines.get():
                for data in _revocations_in(line):
                    membership.revoke(data)
        finally:
            loop.remove_reader(fd)
        raise AgentjetError(
            "the coordinator's DHT peer (python -m node.beacon) exited: the coordinator is "
            "out of the swarm's directory; restart it"
        )

    def close(self) -> None:
        """Close the pipe (the beacon then stops by itself), wait, kill if it hangs, reap."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("the DHT peer did not stop in %.0f s; killing it", STOP_GRACE_S)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _revocations_in(line: bytes) -> list[bytes]:
    """The revocations a beacon's line carries (base64); a line of anything else, none."""
    try:
        reply = json.loads(line)
        return [base64.b64decode(item, validate=True) for item in reply.get("revoked", [])]
    except (ValueError, TypeError, AttributeError, binascii.Error):
        log.warning("ignored a line from the DHT peer: %r", line[:200])
        return []
