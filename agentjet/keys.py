"""The swarm's key material: one ZeroMQ CURVE keypair that every node of a swarm holds.

    agentjet keys init ──▶ swarm.keys (mode 0600: public + secret key, Z85)
                               │ copied to every machine of the swarm, `--keys swarm.keys`
                               ▼
    server socket: CURVE server with the swarm secret; its ZAP handler (agentjet/transport.py)
                   admits only clients that present the swarm's public key
    client socket: CURVE client with the swarm keypair, expecting the swarm's public key

CURVE proves that each side holds the secret key of the public key it presents, so a peer
without the file can neither talk to a server nor pose as one, and everything on the wire
is encrypted. One shared keypair (rather than one per node) keeps the set-up to one file;
the price is that a node's membership cannot be revoked alone: make new keys instead.
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

from agentjet.config import NetConfig
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
    path = Path(path)
    keys = new_keys()
    text = (
        "# agentjet swarm keys (ZeroMQ CURVE, Z85). Whoever holds this file can join the swarm:\n"
        "# copy it only to the swarm's machines and keep it private (mode 0600).\n"
        f'public = "{keys.public.decode()}"\n'
        f'secret = "{keys.secret.decode()}"\n'
    )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} already exists; keep it (every node of the swarm needs the same file) "
            "or remove it first to make new keys"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot write swarm keys to {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return keys


def read_keys(path: str | Path) -> SwarmKeys:
    """The keypair in `path`; a missing, unreadable or damaged file is one ConfigError."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read swarm keys {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise ConfigError(
            f"swarm keys {path} is not a keys file (make one with `agentjet keys init`)"
        ) from None
    public, secret = data.get("public"), data.get("secret")
    if not (_is_z85_key(public) and _is_z85_key(secret)):
        raise ConfigError(
            f"swarm keys {path} lacks a valid public and secret key "
            "(make a new file with `agentjet keys init`)"
        )
    assert isinstance(public, str) and isinstance(secret, str)
    if zmq.curve_public(secret.encode()) != public.encode():
        raise ConfigError(f"swarm keys {path}: the public key does not belong to the secret one")
    if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("swarm keys %s can be read by other users; chmod 600 it", path)
    return SwarmKeys(public=public.encode(), secret=secret.encode())


def _is_z85_key(value: object) -> bool:
    if not isinstance(value, str) or len(value) != Z85_KEY_CHARS:
        return False
    try:
        zmq.utils.z85.decode(value)
    except (ValueError, KeyError, struct.error):
        return False
    return True


def swarm_keys(net: NetConfig) -> SwarmKeys | None:
    """The keys this node's ZMQ sockets use; None only where the user opted out."""
    if net.keys:
        return read_keys(net.keys)
    if net.insecure:
        log.warning(
            "net.insecure = true: ZMQ traffic is neither encrypted nor authenticated; anyone "
            "who reaches this node's endpoint can submit trajectories and read its weights"
        )
        return None
    raise ConfigError(NO_KEYS)
