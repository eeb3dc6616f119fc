"""Building the sandbox image, the steps that run programs: debootstrap (a stand-in script)
shown step by step, quoted when it fails, stopped when it hangs; the rootfs imported as a
tar stream."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

import sandboxes.image
from sandboxes.base import SandboxError
from sandboxes.image import _debootstrap, _import, _tar_bytes
from tests.unit.test_sandbox_image import MIRROR

pytestmark = pytest.mark.integration


def fake_debootstrap(tmp_path: Path, body: str) -> str:
    """An executable that stands in for debootstrap: `body` as a shell script."""
    path = tmp_path / "debootstrap"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_debootstrap_shows_each_line_it_prints_as_a_step(tmp_path: Path) -> None:
    script = fake_debootstrap(
        tmp_path, 'printf "I: Retrieving libc6 2.36\\nI: Unpacking libc6...\\n"; echo "$4 $6"'
    )
    out = io.StringIO()
    _debootstrap(script, tmp_path / "rootfs", MIRROR, "bookworm", ["python3"], out)
    assert re.fullmatch(r"debootstrap: 3 steps in [\d.]+ s \([\d.]+ steps/s\)\n", out.getvalue())


def test_a_failed_debootstrap_quotes_its_last_lines(tmp_path: Path) -> None:
    script = fake_debootstrap(
        tmp_path, 'echo "I: Retrieving libc6 2.36"; echo "E: Couldn\'t download libc6"; exit 1'
    )
    with pytest.raises(SandboxError, match=r"exit 1\): I: Retrieving libc6 2.36 \| E: Couldn't"):
        _debootstrap(script, tmp_path / "rootfs", MIRROR, "bookworm", [], io.StringIO())


def test_a_debootstrap_that_hangs_is_stopped_at_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandboxes.image, "DEBOOTSTRAP_TIMEOUT_S", 0.3)
    script = fake_debootstrap(tmp_path, 'echo "I: Retrieving libc6 2.36"; exec sleep 60')
    with pytest.raises(SandboxError, match=f"did not finish within 0.3 s; is {MIRROR} reachable"):
        _debootstrap(script, tmp_path / "rootfs", MIRROR, "bookworm", [], io.StringIO())


def test_the_import_reports_the_bytes_of_the_tar_stream_as_docker_reads_them(
    tmp_path: Path,
) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "bin/sh").write_bytes(b"x" * 5000)
    read_by_docker: list[int] = []

    class Api:
        def import_image_from_data(self, data: Iterator[bytes], **options: object) -> str:
            read_by_docker.extend(len(chunk) for chunk in data)
            return '{"status": "sha256:0123"}\n'

    sent: list[int] = []
    client = cast(Any, SimpleNamespace(api=Api()))
    assert _import(client, rootfs, "agentjet-sandbox:test", sent.append) == "sha256:0123"
    assert sent == read_by_docker and sum(sent) % 512 == 0
    assert _tar_bytes(rootfs) <= sum(sent)  # the estimate leaves out the end-of-archive blocks
