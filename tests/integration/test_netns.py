"""The Swarmnet harness itself: nodes reach each other over the bridge, a downed link
partitions a node both ways and heals on link_up, and cleanup leaves no process or
namespace behind, also when the test body raised."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import procs
from tests.netns import Node, Swarmnet, list_namespaces, require_netns

pytestmark = pytest.mark.netns

ECHO_PORT = 7007
# A client's connect gives up after this: a partition shows as a connect that never completes.
CONNECT_TIMEOUT_S = 2.0
# A link set up again forwards within moments; this bounds the client's retries.
RECONNECT_WITHIN_S = 10.0
# Bound on a whole client process, Python's start-up included.
CLIENT_WAIT_S = 30.0
# The stubborn process ignores SIGTERM anyway; a short grace keeps the test quick.
STUBBORN_GRACE_S = 0.5
# A SIGKILLed process is gone (or a zombie) within this.
DEATH_WITHIN_S = 5.0

ECHO_SERVER = """
import socket, sys
listener = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    with conn:
        conn.sendall(conn.recv(1024))
"""

# Connects until one echo comes back or `within_s` has passed; prints the outcome.
ECHO_CLIENT = """
import errno, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
connect_timeout_s, within_s = float(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + within_s
while True:
    try:
        with socket.create_connection((host, port), timeout=connect_timeout_s) as conn:
            conn.sendall(b"ping")
            print("echo:" + conn.recv(1024).decode())
            break
    except OSError as e:
        if time.monotonic() >= deadline:
            print(f"failed:{type(e).__name__}:{errno.errorcode.get(e.errno, e.errno)}")
            sys.exit(1)
        time.sleep(0.1)
"""

# Ignores SIGTERM and forks a child that leaves the process group for a session of its own.
STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
escaped = os.fork()
if escaped == 0:
    os.setsid()
    time.sleep(600)
    os._exit(0)
print(f"ready {escaped}", flush=True)
time.sleep(600)
"""


def start_echo_server(node: Node) -> subprocess.Popen[Any]:
    server = node.popen(
        [sys.executable, "-c", ECHO_SERVER, node.ip, str(ECHO_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    assert server.stdout.readline() == "ready\n"
    return server


def start_echo_client(client: Node, server: Node, *, within_s: float) -> subprocess.Popen[Any]:
    argv = [server.ip, str(ECHO_PORT), str(CONNECT_TIMEOUT_S), str(within_s)]
    return client.popen(
        [sys.executable, "-c", ECHO_CLIENT, *argv], stdout=subprocess.PIPE, text=True
    )


def outcome(client: subprocess.Popen[Any]) -> str:
    out, _ = client.communicate(timeout=CLIENT_WAIT_S)
    return out.strip()


def echo(client: Node, server: Node, *, within_s: float = 0.0) -> str:
    return outcome(start_echo_client(client, server, within_s=within_s))


def root_namespace_mentions(net: Swarmnet) -> list[str]:
    """Lines of the root namespace's links and addresses that belong to this swarm."""
    links = procs.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    addrs = procs.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
    lines = links.stdout.splitlines() + addrs.stdout.splitlines()
    return [line for line in lines if net.tag in line or f" {net.subnet_base}." in line]


def is_dead(pid: int) -> bool:
    """True once pid is gone or a zombie; its parent is init, which may reap it any time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_partition_cuts_a_node_off_both_ways_and_link_up_heals_it() -> None:
    require_netns()
    with Swarmnet() as net:
        a, b = net.add_node("a"), net.add_node("b")
        made = net.namespaces
        assert root_namespace_mentions(net) == []
        servers = [start_echo_server(a), start_echo_server(b)]
        assert echo(b, a) == "echo:ping"
        assert echo(a, b) == "echo:ping"

        a.link_down()
        cut = [start_echo_client(b, a, within_s=0.0), start_echo_client(a, b, within_s=0.0)]
        for failed in map(outcome, cut):
            # Refused would mean a packet crossed: a partition drops them silently.
            assert failed.startswith("failed:")
            assert "ConnectionRefused" not in failed

        a.link_up()
        assert echo(b, a, within_s=RECONNECT_WITHIN_S) == "echo:ping"
        assert echo(a, b, within_s=RECONNECT_WITHIN_S) == "echo:ping"

    assert set(made) & list_namespaces() == set()
    assert [server.returncode for server in servers] == [-signal.SIGTERM, -signal.SIGTERM]


def test_cleanup_after_an_error_kills_stubborn_and_escaped_processes() -> None:
    require_netns()
    net = Swarmnet(stop_grace_s=STUBBORN_GRACE_S)
    with pytest.raises(RuntimeError, match="body failed"), net:
        node = net.add_node("a")
        made = net.namespaces
        stubborn = node.popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
        assert stubborn.stdout is not None
        ready, escaped = stubborn.stdout.readline().split()
        assert ready == "ready"
        raise RuntimeError("body failed")

    assert stubborn.returncode == -signal.SIGKILL
    assert set(made) & list_namespaces() == set()
    deadline = time.monotonic() + DEATH_WITHIN_S
    while not is_dead(int(escaped)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert is_dead(int(escaped))
    net.close()  # a second close finds nothing left and does not raise
