"""A private virtual network on this machine, for tests that need several hosts.

    root namespace (never touched)

    hub namespace  aj<pid>s<seq>-hub
    ┌──────────────────── bridge aj<pid>br ────────────────────┐
    │ aj<pid>h1               aj<pid>h2                  ...   │
    └────┬────────────────────────┬────────────────────────────┘
         │ veth                   │ veth
    aj<pid>n1 10.213.X.1/24   aj<pid>n2 10.213.X.2/24
    node namespace            node namespace
    aj<pid>s<seq>-<name>      aj<pid>s<seq>-<name>

Every namespace and interface a run makes carries `aj<pid>`, so two runs never clash and
a leftover is easy to trace back to its run. Each namespace is created empty and filled
with `ip -n`, so no interface or address ever exists in the root namespace. A node runs
commands through `ip netns exec`, which execs them: the Popen's PID is the command's own.

    with Swarmnet() as net:
        a, b = net.add_node("a"), net.add_node("b")
        server = a.popen([sys.executable, "-m", "http.server", "--bind", a.ip])
        a.link_down()  # a partition: packets to and from a vanish silently

Tests call `require_netns()` first: it skips without root or namespaces, and fails
instead where AGENTJET_REQUIRE_NETNS=1 (CI) says the netns tier must run.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import pytest

from tests import procs

# SIGTERM → SIGKILL: long enough for a Python process to run its shutdown handlers.
STOP_GRACE_S = 3.0
# 10.213.0.0/16 is private and unlikely to be routed on a developer's machine; each run
# takes one /24 of it. Nothing is routed there anyway: the network lives in its own
# namespaces.
SUBNET_PREFIX = "10.213"
# Host numbers 1..254 of a /24.
MAX_NODES = 254

_NODE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,15}")
_swarm_seq = itertools.count()


class NetnsError(RuntimeError):
    """An `ip` command of the harness failed; the message carries its stderr."""


def _ip(*args: str) -> str:
    done = procs.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def list_namespaces() -> set[str]:
    """Names of the network namespaces that exist now (`ip netns list`)."""
    return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}


@functools.cache
def netns_available() -> str | None:
    """None when Swarmnet can run here, otherwise a one-line reason to skip."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"aj{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", "probebr", "type", "bridge")
            _ip("-n", probe, "link", "add", "probea", "type", "veth", "peer", "name", "probeb")
        finally:
            _ip("netns", "delete", probe)
    except NetnsError as e:
        return f"cannot build a namespace network: {e}"
    return None


def require_netns() -> None:
    """Skip the calling test where Swarmnet cannot run; fail where CI requires the tier."""
    reason = netns_available()
    if reason is None:
        return
    if os.environ.get("AGENTJET_REQUIRE_NETNS") == "1":
        pytest.fail(f"{reason} (AGENTJET_REQUIRE_NETNS=1 requires it)")
    pytest.skip(reason)


@dataclass(frozen=True)
class Node:
    """One host of a Swarmnet: its own namespace, one veth to the hub's bridge."""

    name: str
    ns: str
    ip: str
    _hub_ns: str
    _hub_port: str
    _port: str  # its end of the veth, in its namespace
    _processes: list[subprocess.Popen[Any]] = field(repr=False)

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv inside this node's namespace in a new session; the Swarmnet reaps it."""
        proc = procs.popen(
            ["ip", "netns", "exec", self.ns, *argv], start_new_session=True, **kwargs
        )
        self._processes.append(proc)
        return proc

    def link_down(self) -> None:
        """Cut this node off: its bridge port goes down, so frames die both ways, silently."""
        _ip("-n", self._hub_ns, "link", "set", self._hub_port, "down")

    def link_up(self) -> None:
        """Reconnect this node; its own addresses and routes were never touched."""
        _ip("-n", self._hub_ns, "link", "set", self._hub_port, "up")

    def limit(self, rate_mbit: float) -> None:
        """Limit this node's link to `rate_mbit` each way (a token bucket, `tc tbf`, on both
        ends of its veth: what it sends, and what the bridge sends it)."""
        for ns, port in ((self.ns, self._port), (self._hub_ns, self._hub_port)):
            argv = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", port, "root"]
            argv += ["tbf", "rate", f"{rate_mbit}mbit", "burst", "128kb", "latency", "50ms"]
            done = procs.run(argv, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise NetnsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")

    def tx_bytes(self) -> int:
        """Bytes this node has sent on its link (its veth's counter)."""
        argv = [
            "ip",
            "netns",
            "exec",
            self.ns,
            "cat",
            f"/sys/class/net/{self._port}/statistics/tx_bytes",
        ]
        return int(procs.run(argv, capture_output=True, text=True, check=True).stdout)


class Swarmnet:
    """A hub namespace with a bridge, and one namespace per node wired to it.

    Leaving the context (also on error) stops every process its nodes started, then
    deletes every namespace it made; `close()` does the same and may be called again.
    """

    def __init__(self, *, stop_grace_s: float = STOP_GRACE_S) -> None:
        self.stop_grace_s = stop_grace_s
        pid, seq = os.getpid(), next(_swarm_seq)
        # Carried by every namespace and interface name this swarm makes.
        self.tag = f"aj{pid}"
        self._ns_prefix = f"{self.tag}s{seq}"
        self._bridge = f"{self.tag}br"
        self.subnet_base = f"{SUBNET_PREFIX}.{(pid + seq) % 254 + 1}"
        self.subnet = f"{self.subnet_base}.0/24"
        self.hub_ns = f"{self._ns_prefix}-hub"
        self.nodes: list[Node] = []
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._entered = False

    @property
    def namespaces(self) -> list[str]:
        """The namespaces this swarm made and has not deleted yet."""
        return list(self._namespaces)

    def __enter__(self) -> Swarmnet:
        self._entered = True
        try:
            self._add_namespace(self.hub_ns)
            _ip("-n", self.hub_ns, "link", "add", self._bridge, "type", "bridge")
            _ip("-n", self.hub_ns, "link", "set", self._bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def add_node(self, name: str) -> Node:
        """A new namespace with `lo` up and one address on the swarm's /24."""
        if not self._entered:
            raise RuntimeError("enter the Swarmnet (`with Swarmnet() as net:`) before adding nodes")
        if not _NODE_NAME.fullmatch(name) or name == "hub":
            raise ValueError(f"node name {name!r}: use 1-16 of [a-z0-9-], not 'hub'")
        if any(node.name == name for node in self.nodes):
            raise ValueError(f"node name {name!r} is taken in this swarm")
        index = len(self.nodes) + 1
        if index > MAX_NODES:
            raise ValueError(f"a swarm holds at most {MAX_NODES} nodes (one /24)")
        ns = f"{self._ns_prefix}-{name}"
        hub_port, node_port = f"{self.tag}h{index}", f"{self.tag}n{index}"
        ip = f"{self.subnet_base}.{index}"
        self._add_namespace(ns)
        # The peer is born inside the node's namespace: it never appears in the root one.
        _ip(
            "-n",
            self.hub_ns,
            "link",
            "add",
            hub_port,
            "type",
            "veth",
            "peer",
            "name",
            node_port,
            "netns",
            ns,
        )
        _ip("-n", self.hub_ns, "link", "set", hub_port, "master", self._bridge, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", node_port)
        _ip("-n", ns, "link", "set", node_port, "up")
        node = Node(name, ns, ip, self.hub_ns, hub_port, node_port, self._processes)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        """Stop every tracked process, then delete every namespace; idempotent."""
        self._stop_processes()
        if not self._namespaces:
            return
        existing = list_namespaces()
        while self._namespaces:
            ns = self._namespaces[-1]
            if ns in existing:
                self._kill_strays(ns)
                _ip("netns", "delete", ns)
            self._namespaces.pop()

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _stop_processes(self) -> None:
        """SIGTERM each tracked group, SIGKILL what outlives the grace period, reap by PID.

        A group is signalled only while its leader is unreaped: until then its PID, and
        so the group id, cannot belong to anyone else.
        """
        live = [proc for proc in self._processes if proc.returncode is None]
        for proc in live:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        for proc in self._processes:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self._processes.clear()

    @staticmethod
    def _kill_strays(ns: str) -> None:
        """SIGKILL processes left in ns (ones that left their group): a namespace with a
        process inside outlives `ip netns delete`, veths and all."""
        for pid in _ip("netns", "pids", ns).split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, signum)
