"""Free TCP ports for addresses a launcher picks before the process that binds them starts.

A port the kernel hands out for `bind(0)` lies in its ephemeral range, the range every
outgoing connection also draws from: between picking it and the child binding it, any
connection on the box (a ZMQ peer, p2pd dialling out) can take it, and the child fails
with "address already in use". Ports below that range are never given to outgoing
connections, so one found free there stays free unless something binds it on purpose.
A port handed out is not handed out again by this process: the launcher (or a test) that
picks ports for several children picks them all before any child has bound its own, and
two picks of one port (seen: two trainers given one port in the swarm tests) would both
look free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range, where the file cannot be read.
DEFAULT_EPHEMERAL = (32768, 60999)
# Below this, ports are privileged or well known.
LOWEST_PORT = 10000
# Random candidates tried before giving up (a box with ~20 000 ports bound is not one to run on).
ATTEMPTS = 1000
# Every port free_port returned in this process.
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port P such that P .. P+span-1 are all free on `host` now, outside the ephemeral
    range, and none of them handed out by this process before. OSError if none is found."""
    low, high = ephemeral_range()
    candidates = [range(LOWEST_PORT, low - span + 1), range(high + 1, 65536 - span + 1)]
    candidates = [r for r in candidates if len(r) > 0]
    if not candidates:
        raise OSError(f"no ports outside the ephemeral range {low}-{high} to choose from")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    rng = random.SystemRandom()
    for _ in range(ATTEMPTS):
        port = rng.choice(rng.choice(candidates))
        if _handed_out.intersection(range(port, port + span)):
            continue
        sockets = [socket.socket(family) for _ in range(span)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind((host, port + offset))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        _handed_out.update(range(port, port + span))
        return port
    raise OSError(f"no {span} free consecutive port(s) on {host} after {ATTEMPTS} tries")
