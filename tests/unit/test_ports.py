"""Ports a launcher picks for its children: free, and outside the kernel's ephemeral range
(where an outgoing connection could take them before the child binds)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agentjet import ports

pytestmark = pytest.mark.unit


def test_a_picked_port_and_the_next_are_free_and_below_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    for _ in range(50):
        port = ports.free_port(span=2)
        assert not low <= port <= high and not low <= port + 1 <= high
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 1))


def test_a_port_someone_listens_on_or_handed_out_before_is_never_picked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """With the choice narrowed to two ports and one of them taken, the other comes back,
    once: it is not handed out again, though nobody has bound it yet."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        for port in range(ports.LOWEST_PORT, ports.LOWEST_PORT + 1000):
            try:
                taken.bind(("127.0.0.1", port))
            except OSError:
                continue
            break
        taken.listen()
        range_file = tmp_path / "ip_local_port_range"
        range_file.write_text(f"{port + 2}\t65535\n")
        monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
        monkeypatch.setattr(ports, "LOWEST_PORT", port)
        monkeypatch.setattr(ports, "_handed_out", set())
        assert ports.free_port() == port + 1
        with pytest.raises(OSError, match="no 1 free consecutive port"):
            ports.free_port()


def test_no_room_outside_the_ephemeral_range_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    with pytest.raises(OSError, match="outside the ephemeral range 1024-65535"):
        ports.free_port()


def test_an_unreadable_range_falls_back_to_linux_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_range() == ports.DEFAULT_EPHEMERAL
