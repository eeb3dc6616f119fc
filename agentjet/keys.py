"""The swarm's root key file: one ZeroMQ CURVE keypair, made once per swarm.

    agentjet keys init ──▶ swarm.keys (mode 0600: public + secret key, Z85)
        │ the root of the swarm (agentjet/identity.py): it derives the root's signing key,
        │ which certifies nodes (`agentjet keys issue`), and the swarm's server keys
        ▼
    a node given swarm.keys certifies itself; a node given NAME.keys is that node

This module reads and writes the files; agentjet/identity.py says what the keys mean.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.z85

from agentjet.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_KEYS_FILE = "swarm.keys"
# A CURVE key is 32 bytes, 40 characters in Z85.
Z85_KEY_CHARS = 40

NO_KEYS = (
    "this node has no swarm keys: run `agentjet keys init` once, copy swarm.keys to every "
    "machine of the swarm and pass --keys swarm.keys (or set net.insecure = true to run "
    "without encryption and authentication)"
)


@dataclass(frozen=True)
class SwarmKeys:
    """The swarm's CURVE keypair, Z85-encoded as pyzmq takes it."""

    public: bytes
    secret: bytes

    @property
    def public_raw(self) -> bytes:
        """The public key as the 32 bytes a ZAP request carries."""
        return zmq.utils.z85.decode(self.public)

    def secure_server(self, socket: zmq.Socket[Any]) -> None:
        """Make `socket` (before bind) a CURVE server holding the swarm's secret."""
        socket.curve_server = True
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public

    def secure_client(self, socket: zmq.Socket[Any]) -> None:
        """Make `socket` (before connect) a CURVE client that presents the swarm's key."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.public


def new_keys() -> SwarmKeys:
    public, secret = zmq.curve_keypair()
    return SwarmKeys(public=public, secret=secret)


def write_keys(path: str | Path) -> SwarmKeys:
    """Make a fresh keypair and write it to `path` (mode 0600); never overwrites a file."""
    keys = new_keys()
    write_private(
        path,
        "# agentjet swarm keys (ZeroMQ CURVE, Z85). Whoever holds this file can join the swarm:\n"
        "# copy it only to the swarm's machines and keep it private (mode 0600).\n"
        f'public = "{keys.public.decode()}"\n'
        f'secret = "{keys.secret.decode()}"\n',
        "every node of the swarm needs the same file",
    )
    return keys


def write_private(path: str | Path, text: str, keep_why: str) -> None:
    """Write key material to a new file, mode 0600; an existing file is an error that says
    why to keep it (`keep_why`)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} already exists; keep it ({keep_why}) or remove it first to make new keys"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot write keys to {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_key_data(path: str | Path) -> dict[str, Any]:
    """A key file's fields; a missing, unreadable or damaged file is one ConfigError."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read swarm keys {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise ConfigError(
            f"swarm keys {path} is not a keys file (make one with `agentjet keys init`)"
        ) from None


def read_keys(path: str | Path, data: dict[str, Any] | None = None) -> SwarmKeys:
    """The keypair in root key file `path` (`data`: its fields, if already read)."""
    data = read_key_data(path) if data is None else data
    if data.get("kind") == "node":
        raise ConfigError(
            f"{path} holds one node's keys (`agentjet keys issue`), not the swarm's root keys "
            "this needs (`agentjet keys init`)"
        )
    public, secret = data.get("public"), data.get("secret")
    if not (is_z85_key(public) and is_z85_key(secret)):
        raise ConfigError(
            f"swarm keys {path} lacks a valid public and secret key "
            "(make a new file with `agentjet keys init`)"
        )
    assert isinstance(public, str) and isinstance(secret, str)
    if zmq.curve_public(secret.encode()) != public.encode():
        raise ConfigError(f"swarm keys {path}: the public key does not belong to the secret one")
    warn_if_shared(path)
    return SwarmKeys(public=public.encode(), secret=secret.encode())


def warn_if_shared(path: str | Path) -> None:
    if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("keys %s can be read by other users; chmod 600 it", path)


def is_z85_key(value: object) -> bool:
    if not isinstance(value, str) or len(value) != Z85_KEY_CHARS:
        return False
    try:
        zmq.utils.z85.decode(value)
    except (ValueError, KeyError, struct.error):
        return False
    return True
