"""`model.name = "org/model-id"`: download from the Hugging Face hub, or one line saying why not.

The hub here is a real HTTP server on loopback that serves a tiny model through the endpoints
the installed huggingface_hub's `snapshot_download` calls (repo info, tree listing, HEAD and GET
of `resolve/` URLs), so the download runs through the library unchanged. huggingface_hub reads
HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once at import, so every resolution runs in a child
process started with its own environment; the child prints the folder, or the ModelError's
message, as JSON on stdout, and the test also checks what it printed on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from agentjet.config import EMBEDDED_MODEL
from agentjet.errors import ModelError
from node.model import load_causal_lm, resolve_model
from tests import procs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 180
SHA = hashlib.sha1(b"tiny model commit").hexdigest()
# Served next to the model but not needed to load it: a download must skip them.
DECOYS = {"pytorch_model.bin": b"pickled duplicate of the weights", "README.md": b"# tiny\n"}

CHILD = """
import json, sys
from agentjet.errors import ModelError
from node.model import resolve_model
try:
    path = resolve_model(sys.argv[1])
except ModelError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(3)
print(json.dumps({"path": str(path)}))
"""


class FakeHub:
    """Serves repos (repo id -> {filename: bytes}) the way the Hugging Face hub's API does."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: set[str]) -> None:
        self.repos = repos
        self.gated = gated
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=10)

    def requested_files(self) -> set[str]:
        """Names of the files requested through `resolve/` URLs (HEAD or GET, any revision)."""
        with self._lock:
            paths = [p for _, p in self.requests if "/resolve/" in p]
        return {p.split("/resolve/", 1)[1].split("/", 1)[1] for p in paths}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._serve(body=True)

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                with hub._lock:
                    hub.requests.append((self.command, path))
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                    repo, rev = m.groups()
                    if self._repo_ok(repo, rev):
                        siblings = [{"rfilename": name} for name in hub.repos[repo]]
                        self._json({"id": repo, "sha": SHA, "siblings": siblings}, body)
                elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                    repo, rev = m.groups()
                    if self._repo_ok(repo, rev):
                        tree = [
                            {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                            for name, data in hub.repos[repo].items()
                        ]
                        self._json(tree, body)
                elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    repo, rev, name = m.groups()
                    if self._repo_ok(repo, rev):
                        if name not in hub.repos[repo]:
                            self._error(404, "EntryNotFound", body)
                        else:
                            data = hub.repos[repo][name]
                            headers = {
                                "X-Repo-Commit": SHA,
                                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                            }
                            self._send(200, data, "application/octet-stream", headers, body)
                else:
                    self._send(404, b"not found", "text/plain", {}, body)

            def _repo_ok(self, repo: str, rev: str) -> bool:
                if repo in hub.gated:
                    self._error(403, "GatedRepo", body=self.command == "GET")
                    return False
                if repo not in hub.repos:
                    self._error(404, "RepoNotFound", body=self.command == "GET")
                    return False
                if rev not in ("main", SHA):
                    self._error(404, "RevisionNotFound", body=self.command == "GET")
                    return False
                return True

            def _error(self, status: int, code: str, body: bool) -> None:
                payload = json.dumps({"error": code}).encode()
                self._send(status, payload, "application/json", {"X-Error-Code": code}, body)

            def _json(self, value: object, body: bool) -> None:
                self._send(200, json.dumps(value).encode(), "application/json", {}, body)

            def _send(
                self, status: int, data: bytes, ctype: str, headers: dict[str, str], body: bool
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def served_model(tiny_model_dir: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(tiny_model_dir.iterdir()) if p.is_file()}
    assert "config.json" in files and "model.safetensors" in files
    return files


@pytest.fixture
def hub(served_model: dict[str, bytes]) -> Iterator[FakeHub]:
    server = FakeHub({"test-org/tiny": {**served_model, **DECOYS}}, gated={"test-org/gated"})
    yield server
    server.stop()


@dataclass
class Child:
    returncode: int
    result: dict[str, str]
    stderr_lines: list[str]


def _resolve_in_child(name: str, endpoint: str, hf_home: Path, offline: bool = False) -> Child:
    """Run resolve_model(name) in a fresh interpreter that sees only the given HF settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_")) and "proxy" not in k.lower()
    }
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    proc = procs.run(
        [sys.executable, "-c", CHILD, name],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    stdout_lines = proc.stdout.strip().splitlines()
    assert len(stdout_lines) == 1, f"stdout: {proc.stdout!r}\nstderr: {proc.stderr}"
    return Child(proc.returncode, json.loads(stdout_lines[0]), proc.stderr.strip().splitlines())


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_an_id_downloads_into_the_hf_cache_and_is_found_there_offline(
    hub: FakeHub, served_model: dict[str, bytes], tmp_path: Path
) -> None:
    hf_home = tmp_path / "hf"
    first = _resolve_in_child("test-org/tiny", hub.url, hf_home)
    assert first.returncode == 0, first
    folder = Path(first.result["path"])
    assert folder.is_relative_to(hf_home / "hub")
    got = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert got == served_model  # every file the model needs, byte for byte, and no decoy
    assert not hub.requested_files() & set(DECOYS)
    assert len(first.stderr_lines) == 2, first.stderr_lines
    assert first.stderr_lines[0] == (
        f"downloading test-org/tiny from the Hugging Face hub into {hf_home / 'hub'} ..."
    )
    assert re.fullmatch(
        rf"downloaded test-org/tiny: {len(served_model)} files, [\d.]+ MB in [\d.]+ s",
        first.stderr_lines[1],
    )
    model, tokenizer = load_causal_lm(folder)
    assert model.config.vocab_size == len(tokenizer)

    hub.stop()  # the endpoint is now a closed port: the cache alone must answer
    second = _resolve_in_child("test-org/tiny", hub.url, hf_home)
    assert second.returncode == 0, second
    assert Path(second.result["path"]) == folder
    assert second.stderr_lines == []

    offline = _resolve_in_child("test-org/tiny", hub.url, hf_home, offline=True)
    assert offline.returncode == 0, offline
    assert Path(offline.result["path"]) == folder


def test_without_a_network_one_line_says_how_to_pre_download(tmp_path: Path) -> None:
    hf_home = tmp_path / "hf"
    child = _resolve_in_child("test-org/tiny", _closed_port_url(), hf_home)
    assert child.returncode == 3, child
    message = child.result["error"]
    assert "\n" not in message
    assert "not in the Hugging Face cache" in message
    assert "could not be reached" in message
    assert "hf download test-org/tiny" in message
    assert EMBEDDED_MODEL in message
    # Nothing but the one progress line before it: no traceback, no library warnings.
    assert child.stderr_lines == [
        f"downloading test-org/tiny from the Hugging Face hub into {hf_home / 'hub'} ..."
    ]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("test-org/missing", "neither a local folder nor a model on the Hugging Face hub"),
        ("test-org/gated", "is gated on the Hugging Face hub"),
    ],
)
def test_a_repo_the_hub_does_not_serve_says_so_in_one_line(
    hub: FakeHub, tmp_path: Path, name: str, expected: str
) -> None:
    child = _resolve_in_child(name, hub.url, tmp_path / "hf")
    assert child.returncode == 3, child
    message = child.result["error"]
    assert "\n" not in message
    assert expected in message
    assert name in message
    assert len(child.stderr_lines) == 1 and child.stderr_lines[0].startswith("downloading ")


def test_an_invalid_id_says_so_without_touching_the_network() -> None:
    expected = "neither a local folder nor a valid Hugging Face model id"
    with pytest.raises(ModelError, match=expected) as e:
        resolve_model("org/model/extra")
    assert "\n" not in str(e.value)
