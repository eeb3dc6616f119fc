"""One identity per node: certificates issued by the swarm's root, and revocations.

    swarm.keys (agentjet keys init) ── is the root: its CURVE secret derives the root's
        │                                Ed25519 signing key (RootKey.from_swarm_keys) and
        │                                the swarm's server keypair (server_keys)
        │ agentjet keys issue --node NAME
        ▼
    NAME.keys: the node's own CURVE keypair and Ed25519 signing key, its Certificate
               (name, both public keys, serial, validity, signed by the root), and the
               server keypair
        │ node_keys(net, name) ──▶ NodeKeys (a root file certifies the node on the spot)
        ▼
    every server checks a peer's certificate with `Membership.verdict` (transport.py)
    Membership: the root's public key + the revocations it has seen
        ──▶ a Certificate, or a refusal counted per kind (`Refusal`)

The root is derived from today's key file, not stored beside it, so a swarm made with a
single key file keeps working: that file is the root, and a node that holds it issues its
own certificate at start (`NodeKeys.from_root`). A node given only its NAME.keys holds no
root secret: it can prove who it is, but cannot admit anyone else.

A revocation names a node and a time, signed by the root: every certificate of that name
issued up to that time is refused from then on, and a certificate issued to the name later
is valid again (a node re-admitted on purpose). Revocations travel as signed records (the
swarm keeps them in its DHT, node/directory.py `Directory.sync_revocations`); a forged one is
refused like a forged certificate.

Signatures are Ed25519 (the `cryptography` package, which hivemind already needs); what a
certificate signs is its msgpack encoding with an empty signature field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import math
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import zmq
import zmq.utils.z85
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from agentjet.config import NetConfig
from agentjet.errors import ConfigError
from agentjet.keys import (
    NO_KEYS,
    SwarmKeys,
    is_z85_key,
    read_key_data,
    read_keys,
    warn_if_shared,
    write_private,
)

log = logging.getLogger(__name__)

# A certificate's default lifetime; `agentjet keys issue --days` chooses another.
CERTIFICATE_DAYS = 365
# A node holding the root re-issues its own certificate at every start, valid this long.
SELF_ISSUED_DAYS = 30
# Clocks of the swarm's machines may disagree this much (hivemind's DHT already needs a
# minute): a certificate issued "in the future" by less than this is accepted.
CLOCK_SKEW_S = 60.0
# Node names: printable, no spaces, short enough for every log line and table.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Longest encoded certificate or revocation accepted from anyone (ours are at most ~360 bytes).
MAX_CERTIFICATE_BYTES = 1024
# Longest signed record accepted (a directory record lists a node's environments and
# addresses: a few hundred bytes to a few KiB).
MAX_SIGNED_RECORD_BYTES = 64 * 1024
# A kind of refusal is logged at most this often (each one is counted).
REFUSAL_LOG_EVERY_S = 60.0
ED25519_KEY_BYTES = 32
ED25519_SIGNATURE_BYTES = 64

# forged, expired, revoked: the certificate itself. impersonation: a message naming another
# node than its sender's certificate. anonymous: a message from a connection that presented
# no certificate (agentjet/transport.py).
Refusal = Literal["forged", "expired", "revoked", "impersonation", "anonymous"]


def _unsigned(record: Any) -> bytes:
    """What a record's signature covers: its msgpack encoding with the signature empty."""
    return msgspec.msgpack.encode(msgspec.structs.replace(record, signature=b""))


class Certificate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A node's name bound to its keys by the swarm's root."""

    name: str
    curve_public: str  # Z85: the node's ZeroMQ CURVE key
    signing_public: bytes  # Ed25519: the key its DHT records and trajectories are signed with
    serial: str  # random, for logs
    issued_at: float  # unix seconds
    expires_at: float
    root: bytes  # the issuing root's Ed25519 public key
    signature: bytes = b""  # the root's signature over the certificate with this field empty

    def signed_part(self) -> bytes:
        return _unsigned(self)


class Revocation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every certificate of `name` issued up to `revoked_at` is refused, signed by the root."""

    name: str
    revoked_at: float
    root: bytes
    signature: bytes = b""

    def signed_part(self) -> bytes:
        return _unsigned(self)


class PeerBinding(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A node's hivemind peer id, bound to its certificate by the node's own signature:
    what a trainer's averaging handlers admit callers by (node/members.py `MemberGate`)."""

    certificate: bytes  # encode_certificate
    peer_id: str  # base58
    expires_at: float  # unix seconds; the node stores it again before then
    signature: bytes = b""  # the node's Ed25519 signature over the rest

    def signed_part(self) -> bytes:
        return _unsigned(self)


class SignedRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A record a node writes where others read it (its directory entry in the DHT), signed
    by the node: who wrote it is its certificate's name, whatever the record says."""

    certificate: bytes  # encode_certificate
    payload: bytes  # the record, encoded
    signature: bytes = b""  # the node's Ed25519 signature over the rest

    def signed_part(self) -> bytes:
        return _unsigned(self)


def _public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _verifies(public: bytes, signature: bytes, data: bytes) -> bool:
    if len(public) != ED25519_KEY_BYTES or len(signature) != ED25519_SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class RootKey:
    """The swarm's signing root, derived from the swarm key file's CURVE secret."""

    private: Ed25519PrivateKey

    @classmethod
    def from_swarm_keys(cls, keys: SwarmKeys) -> RootKey:
        seed = hashlib.sha256(b"agentjet root signing key\0" + keys.secret).digest()
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public(self) -> bytes:
        return _public_bytes(self.private)

    def issue(
        self,
        name: str,
        curve_public: bytes,
        signing_public: bytes,
        *,
        days: float = CERTIFICATE_DAYS,
        now: float | None = None,
    ) -> Certificate:
        """A certificate for `name` holding these public keys, valid `days` from now."""
        if not NAME_PATTERN.fullmatch(name):
            raise ConfigError(
                f"node name {name!r}: use 1-128 letters, digits, '.', '_' or '-' "
                "(starting with a letter or digit)"
            )
        if not (isinstance(days, int | float) and math.isfinite(days) and days > 0):
            raise ConfigError(
                f"a certificate's lifetime must be a positive number of days, not {days}"
            )
        issued = time.time() if now is None else now
        unsigned = Certificate(
            name=name,
            curve_public=curve_public.decode(),
            signing_public=signing_public,
            serial=uuid.uuid4().hex[:16],
            issued_at=issued,
            expires_at=issued + days * 86400.0,
            root=self.public,
        )
        return msgspec.structs.replace(
            unsigned, signature=self.private.sign(unsigned.signed_part())
        )

    def revoke(self, name: str, *, now: float | None = None) -> Revocation:
        """The root's revocation of every certificate of `name` issued until now."""
        if not NAME_PATTERN.fullmatch(name):
            raise ConfigError(f"node name {name!r} is not one a certificate can name")
        unsigned = Revocation(
            name=name, revoked_at=time.time() if now is None else now, root=self.public
        )
        return msgspec.structs.replace(
            unsigned, signature=self.private.sign(unsigned.signed_part())
        )


@dataclass(frozen=True)
class NodeIdentity:
    """What a node proves itself with: its keys and the root's certificate for them."""

    curve: SwarmKeys  # the node's own CURVE keypair (Z85), as the ZMQ sockets take it
    signing: Ed25519PrivateKey
    certificate: Certificate

    @property
    def name(self) -> str:
        return self.certificate.name

    @classmethod
    def new(
        cls, root: RootKey, name: str, *, days: float = CERTIFICATE_DAYS, now: float | None = None
    ) -> NodeIdentity:
        """Fresh keys for `name`, certified by `root`."""
        public, secret = zmq.curve_keypair()
        signing = Ed25519PrivateKey.generate()
        certificate = root.issue(name, public, _public_bytes(signing), days=days, now=now)
        return cls(SwarmKeys(public=public, secret=secret), signing, certificate)

    @classmethod
    def self_issued(cls, keys: SwarmKeys, name: str) -> NodeIdentity:
        """A node that holds the swarm's root file certifies itself (today's single-file
        swarms, and `agentjet local`)."""
        return cls.new(RootKey.from_swarm_keys(keys), name, days=SELF_ISSUED_DAYS)

    def sign(self, data: bytes) -> bytes:
        """This node's signature over `data` (a DHT record, a trajectory)."""
        return self.signing.sign(data)

    def sign_record(self, payload: bytes) -> bytes:
        """`payload` signed by this node (an encoded `SignedRecord`)."""
        unsigned = SignedRecord(encode_certificate(self.certificate), payload)
        record = msgspec.structs.replace(unsigned, signature=self.sign(unsigned.signed_part()))
        return msgspec.msgpack.encode(record)

    def bind_peer(self, peer_id: str, expires_at: float) -> bytes:
        """This node's signed binding of its hivemind peer id (encoded `PeerBinding`)."""
        unsigned = PeerBinding(encode_certificate(self.certificate), peer_id, expires_at)
        binding = msgspec.structs.replace(unsigned, signature=self.sign(unsigned.signed_part()))
        return msgspec.msgpack.encode(binding)


def server_keys(root: SwarmKeys) -> SwarmKeys:
    """The swarm's server keypair, derived from the root file: every member's ZMQ servers
    use it and its clients expect it, so a stranger who never held a key file cannot even
    complete a handshake. It is in every node's key file (any node may serve), so it
    proves membership of the swarm, not which node; clients prove that with their own key
    and certificate (agentjet/transport.py)."""
    raw = hashlib.sha256(b"agentjet server key\0" + root.secret).digest()
    secret = zmq.utils.z85.encode(raw)
    return SwarmKeys(public=zmq.curve_public(secret), secret=secret)


@dataclass(frozen=True)
class NodeKeys:
    """Everything a node's sockets and DHT need: who it is, the swarm's server keys, and
    whom it admits."""

    identity: NodeIdentity
    server: SwarmKeys
    membership: Membership

    @property
    def name(self) -> str:
        return self.identity.name

    def secure_server(self, socket: zmq.Socket[Any]) -> None:
        """Make `socket` (before bind) a CURVE server of this swarm."""
        self.server.secure_server(socket)

    def secure_client(self, socket: zmq.Socket[Any]) -> None:
        """Make `socket` (before connect) a CURVE client with this node's own key."""
        socket.curve_secretkey = self.identity.curve.secret
        socket.curve_publickey = self.identity.curve.public
        socket.curve_serverkey = self.server.public

    @classmethod
    def from_root(cls, root: SwarmKeys, name: str) -> NodeKeys:
        """A node holding the root file (today's single-file swarms, `agentjet local`)
        certifies itself as `name`."""
        identity = NodeIdentity.self_issued(root, name)
        return cls(identity, server_keys(root), Membership(identity.certificate.root))


def node_keys(net: NetConfig, name: str) -> NodeKeys | None:
    """This node's keys (`net.keys`: the root file, or a node's own file, whose certificate
    names it whatever `name` says); None only where the user opted out (`net.insecure`)."""
    if net.keys:
        return read_node_keys(net.keys, name)
    if net.insecure:
        log.warning(
            "net.insecure = true: ZMQ traffic is neither encrypted nor authenticated; anyone "
            "who reaches this node's endpoint can submit trajectories and read its weights"
        )
        return None
    raise ConfigError(NO_KEYS)


def write_node_keys(path: str | Path, identity: NodeIdentity, server: SwarmKeys) -> None:
    """Write a node's key file (mode 0600; never overwrites one)."""
    seed = identity.signing.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    certificate = base64.b64encode(encode_certificate(identity.certificate)).decode()
    write_private(
        path,
        f"# agentjet node keys for {identity.name!r}, issued by the swarm's root: its identity in\n"
        "# the swarm. Keep it on that node only (mode 0600); revoke it with "
        f"`agentjet keys revoke {identity.name}`.\n"
        'kind = "node"\n'
        f'name = "{identity.name}"\n'
        f'public = "{identity.curve.public.decode()}"\n'
        f'secret = "{identity.curve.secret.decode()}"\n'
        f'signing_secret = "{seed.hex()}"\n'
        f'certificate = "{certificate}"\n'
        f'server_public = "{server.public.decode()}"\n'
        f'server_secret = "{server.secret.decode()}"\n',
        "a node's keys are its identity",
    )


def read_node_keys(path: str | Path, name: str) -> NodeKeys:
    """The keys in file `path`: a root file (`agentjet keys init`) certifies this node as
    `name` on the spot; a node file (`agentjet keys issue`) must hold the keys its
    certificate names (whether that certificate is current and not revoked is for
    `Membership` to say, as for any peer's)."""
    data = read_key_data(path)
    if data.get("kind") != "node":
        return NodeKeys.from_root(read_keys(path, data), name)
    warn_if_shared(path)
    damaged = ConfigError(
        f"node keys {path} are damaged (issue new ones with `agentjet keys issue --node NAME`)"
    )
    fields = ("public", "secret", "server_public", "server_secret")
    public, secret, server_public, server_secret = (data.get(key) for key in fields)
    if not all(is_z85_key(key) for key in (public, secret, server_public, server_secret)):
        raise damaged
    assert isinstance(public, str) and isinstance(secret, str)
    assert isinstance(server_public, str) and isinstance(server_secret, str)
    try:
        seed = bytes.fromhex(str(data.get("signing_secret")))
        signing = Ed25519PrivateKey.from_private_bytes(seed)
        encoded = base64.b64decode(str(data.get("certificate")), validate=True)
        certificate = _certificate_decoder.decode(encoded)
    except (ValueError, binascii.Error, msgspec.DecodeError, msgspec.ValidationError):
        raise damaged from None
    if (
        zmq.curve_public(secret.encode()) != public.encode()
        or zmq.curve_public(server_secret.encode()) != server_public.encode()
        or certificate.curve_public != public
        or certificate.signing_public != _public_bytes(signing)
        or certificate.name != data.get("name")
    ):
        raise ConfigError(f"node keys {path}: the keys are not the ones its certificate names")
    identity = NodeIdentity(SwarmKeys(public.encode(), secret.encode()), signing, certificate)
    server = SwarmKeys(server_public.encode(), server_secret.encode())
    return NodeKeys(identity, server, Membership(certificate.root))


def signed_by(certificate: Certificate, data: bytes, signature: bytes) -> bool:
    """Whether `signature` over `data` was made with the key `certificate` names."""
    return _verifies(certificate.signing_public, signature, data)


def encode_certificate(certificate: Certificate) -> bytes:
    return msgspec.msgpack.encode(certificate)


def encode_revocation(revocation: Revocation) -> bytes:
    return msgspec.msgpack.encode(revocation)


_certificate_decoder = msgspec.msgpack.Decoder(Certificate)
_revocation_decoder = msgspec.msgpack.Decoder(Revocation)
_binding_decoder = msgspec.msgpack.Decoder(PeerBinding)
_signed_record_decoder = msgspec.msgpack.Decoder(SignedRecord)


class Membership:
    """Who belongs to the swarm: certificates checked against the root and revocations.

    Every channel asks `admit` about the certificate a peer presents; a refusal is counted
    per kind (`refused`) and logged at most once per `REFUSAL_LOG_EVERY_S` per kind, and
    never raises. Revocations are added with `revoke` (checked, idempotent).
    """

    def __init__(self, root_public: bytes) -> None:
        self.root_public = root_public
        # name -> its latest revocation (kept whole: nodes store them again in the swarm)
        self.revocations: dict[str, Revocation] = {}
        self.refused: Counter[Refusal] = Counter()
        self._logged_at: dict[Refusal, float] = {}

    def admit(
        self, presented: bytes | Certificate, *, now: float | None = None
    ) -> Certificate | None:
        """The certificate if it is the root's, current and not revoked; else None, counted."""
        verdict = self.verdict(presented, now=now)
        return verdict if isinstance(verdict, Certificate) else None

    def verdict(
        self, presented: bytes | Certificate, *, now: float | None = None
    ) -> Certificate | Refusal:
        """`admit`, saying the kind of a refusal (counted) instead of None."""
        certificate = self._decode(presented)
        if certificate is None:
            self.refuse("forged", "a certificate that does not decode")
            return "forged"
        refusal = self.refusal(certificate, time.time() if now is None else now)
        if refusal is not None:
            self.refuse(*refusal)
            return refusal[0]
        return certificate

    def refusal(self, certificate: Certificate, now: float) -> tuple[Refusal, str] | None:
        """Why `certificate` is refused at time `now`, or None if it is a member's."""
        name = repr(certificate.name)
        if certificate.root != self.root_public or not _verifies(
            self.root_public, certificate.signature, certificate.signed_part()
        ):
            return "forged", f"a certificate for {name} not signed by this swarm's root"
        if not (
            NAME_PATTERN.fullmatch(certificate.name)
            and is_z85_key(certificate.curve_public)
            and len(certificate.signing_public) == ED25519_KEY_BYTES
        ):
            return "forged", f"a malformed certificate for {name}"
        if not certificate.issued_at - CLOCK_SKEW_S <= now < certificate.expires_at:
            return "expired", f"{name}'s certificate, which is not valid now"
        revocation = self.revocations.get(certificate.name)
        if revocation is not None and certificate.issued_at <= revocation.revoked_at:
            return "revoked", f"{name}, which is revoked"
        return None

    def bound_peer(
        self, presented: bytes, *, now: float | None = None
    ) -> tuple[str, Certificate, float] | None:
        """(peer id, certificate, expiry) of a current `PeerBinding` whose certificate is
        admitted and whose node signed it; None (a refusal counted) for anything else."""
        now = time.time() if now is None else now
        binding = self._signed(presented, _binding_decoder, 2 * MAX_CERTIFICATE_BYTES, now)
        if binding is None:
            return None
        binding, certificate = binding
        if not binding.expires_at > now:
            return None  # an old binding of a node gone: not a refusal
        return binding.peer_id, certificate, binding.expires_at

    def signed_record(
        self, presented: bytes, *, now: float | None = None
    ) -> tuple[Certificate, bytes] | None:
        """(signer's certificate, payload) of a `SignedRecord` whose certificate is admitted
        and whose node signed it; None (a refusal counted) for anything else."""
        now = time.time() if now is None else now
        signed = self._signed(presented, _signed_record_decoder, MAX_SIGNED_RECORD_BYTES, now)
        return None if signed is None else (signed[1], signed[0].payload)

    def _signed(
        self, presented: bytes, decoder: msgspec.msgpack.Decoder[Any], limit: int, now: float
    ) -> tuple[Any, Certificate] | None:
        """A record carrying its writer's `certificate` and `signature` (PeerBinding,
        SignedRecord), decoded, with the certificate, if both check out; else None, counted."""
        what = decoder.type.__name__
        try:
            if not isinstance(presented, bytes) or len(presented) > limit:
                raise msgspec.ValidationError("too long")
            record = decoder.decode(presented)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
            self.refuse("forged", f"a {what} that does not decode")
            return None
        certificate = self.admit(record.certificate, now=now)
        if certificate is None:
            return None
        if not signed_by(certificate, record.signed_part(), record.signature):
            self.refuse("forged", f"a {what} of {certificate.name!r} it did not sign")
            return None
        return record, certificate

    def revoke(self, presented: bytes | Revocation) -> bool:
        """Add a revocation signed by the root; a forged one is refused (False) and counted."""
        revocation = presented
        if isinstance(presented, bytes):
            try:
                if len(presented) > MAX_CERTIFICATE_BYTES:
                    raise msgspec.ValidationError("too long")
                revocation = _revocation_decoder.decode(presented)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.refuse("forged", "a revocation that does not decode")
                return False
        assert isinstance(revocation, Revocation)
        if revocation.root != self.root_public or not _verifies(
            self.root_public, revocation.signature, revocation.signed_part()
        ):
            self.refuse("forged", f"a revocation of {revocation.name!r} not signed by the root")
            return False
        if not math.isfinite(revocation.revoked_at):
            self.refuse("forged", f"a revocation of {revocation.name!r} without a valid time")
            return False
        known = self.revocations.get(revocation.name)
        if known is None or revocation.revoked_at > known.revoked_at:
            if known is None:
                log.warning(
                    "node %r is revoked: refused on every channel from now on", revocation.name
                )
            self.revocations[revocation.name] = revocation
        return True

    @property
    def revoked(self) -> dict[str, float]:
        """Each revoked name, with the time up to which its certificates are refused."""
        return {name: r.revoked_at for name, r in self.revocations.items()}

    def _decode(self, presented: bytes | Certificate) -> Certificate | None:
        if isinstance(presented, Certificate):
            return presented
        if not isinstance(presented, bytes) or len(presented) > MAX_CERTIFICATE_BYTES:
            return None
        try:
            return _certificate_decoder.decode(presented)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def refuse(self, kind: Refusal, why: str) -> None:
        """Count a refusal of `kind`, logged at most once per REFUSAL_LOG_EVERY_S per kind."""
        self.refused[kind] += 1
        now = time.monotonic()
        if now - self._logged_at.get(kind, -math.inf) >= REFUSAL_LOG_EVERY_S:
            self._logged_at[kind] = now
            log.warning(
                "refused %s (%d %s refusals so far; logged at most once a minute)",
                why,
                self.refused[kind],
                kind,
            )
