"""One identity per node: certificates from the swarm's root, revocations, node key files.

Real Ed25519 signatures throughout (nothing mocked): a certificate the root signed is
admitted; one changed after signing, signed by another swarm's root, expired, or revoked
is refused and counted by kind; a revocation only the root can make; today's single key
file is the root, so old swarms keep working.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentjet.errors import ConfigError
from agentjet.identity import (
    CLOCK_SKEW_S,
    MAX_CERTIFICATE_BYTES,
    Membership,
    NodeIdentity,
    RootKey,
    encode_certificate,
    encode_revocation,
    read_node_keys,
    server_keys,
    signed_by,
    write_node_keys,
)
from agentjet.keys import new_keys, read_keys, write_keys
from agentjet_app.cli import main

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0
DAY_S = 86400.0


@pytest.fixture
def root() -> RootKey:
    return RootKey.from_swarm_keys(new_keys())


def test_a_certificate_the_root_signed_is_admitted(root: RootKey):
    node = NodeIdentity.new(root, "gpu-box-1", days=2, now=NOW)
    members = Membership(root.public)
    admitted = members.admit(encode_certificate(node.certificate), now=NOW + DAY_S)
    assert admitted == node.certificate and admitted.name == "gpu-box-1"
    assert admitted.curve_public == node.curve.public.decode()
    assert sum(members.refused.values()) == 0


def test_the_root_is_the_swarm_key_file(tmp_path: Path):
    """Today's single key file is the root: the same file gives the same root everywhere,
    another file another root, whose certificates this swarm refuses as forged."""
    path = tmp_path / "swarm.keys"
    keys = write_keys(path)
    root = RootKey.from_swarm_keys(read_keys(path))
    assert root.public == RootKey.from_swarm_keys(keys).public
    stranger = RootKey.from_swarm_keys(new_keys())
    assert stranger.public != root.public
    members = Membership(root.public)
    assert members.admit(NodeIdentity.new(stranger, "mallory").certificate) is None
    assert members.refused == {"forged": 1}


def test_a_certificate_changed_after_signing_is_forged(root: RootKey):
    """Renaming oneself (out of quarantine, or into another node's name), swapping in one's
    own keys, or stretching the validity breaks the root's signature."""
    honest = NodeIdentity.new(root, "rollout-a", now=NOW).certificate
    other = NodeIdentity.new(root, "rollout-b", now=NOW)
    members = Membership(root.public)
    for changed in (
        msgspec.structs.replace(honest, name="trainer-1"),
        msgspec.structs.replace(honest, signing_public=other.certificate.signing_public),
        msgspec.structs.replace(honest, curve_public=other.certificate.curve_public),
        msgspec.structs.replace(honest, expires_at=honest.expires_at + 365 * DAY_S),
        msgspec.structs.replace(honest, signature=bytes(64)),
    ):
        assert members.admit(changed, now=NOW) is None
    assert members.refused == {"forged": 5}


def test_a_certificate_outside_its_validity_is_refused(root: RootKey):
    certificate = NodeIdentity.new(root, "old-node", days=1, now=NOW).certificate
    members = Membership(root.public)
    assert members.admit(certificate, now=NOW + DAY_S) is None  # expired
    assert members.admit(certificate, now=NOW - 2 * CLOCK_SKEW_S) is None  # not yet valid
    assert members.admit(certificate, now=NOW - CLOCK_SKEW_S / 2) == certificate  # clock skew
    assert members.refused == {"expired": 2}


def test_a_revoked_node_is_refused_and_a_later_certificate_readmits_it(root: RootKey):
    old = NodeIdentity.new(root, "rollout-a", now=NOW).certificate
    bystander = NodeIdentity.new(root, "rollout-b", now=NOW).certificate
    members = Membership(root.public)
    assert members.revoke(encode_revocation(root.revoke("rollout-a", now=NOW + 10)))
    assert members.admit(old, now=NOW + 20) is None
    assert members.admit(bystander, now=NOW + 20) == bystander  # no one else re-keyed
    reissued = NodeIdentity.new(root, "rollout-a", now=NOW + 30).certificate
    assert members.admit(reissued, now=NOW + 40) == reissued
    # An older revocation arriving late (another path through the swarm) changes nothing.
    assert members.revoke(root.revoke("rollout-a", now=NOW + 5))
    assert members.revoked == {"rollout-a": NOW + 10}
    assert members.refused == {"revoked": 1}
    with pytest.raises(ConfigError):
        root.revoke("not a name")


def test_only_the_root_revokes(root: RootKey):
    members = Membership(root.public)
    stranger = RootKey.from_swarm_keys(new_keys())
    forged = stranger.revoke("rollout-a", now=NOW)
    assert not members.revoke(forged)
    assert not members.revoke(msgspec.structs.replace(forged, root=root.public))
    assert not members.revoke(b"\x93not a revocation")
    assert not members.revoke(b"\x00" * (MAX_CERTIFICATE_BYTES + 1))
    assert members.revoked == {} and members.refused == {"forged": 4}


def test_records_are_bound_to_the_node_that_signed_them(root: RootKey):
    a, b = NodeIdentity.new(root, "rollout-a"), NodeIdentity.new(root, "rollout-b")
    record = b'{"node_id": "rollout-a", "queue": 3}'
    assert signed_by(a.certificate, record, a.sign(record))
    assert not signed_by(b.certificate, record, a.sign(record))  # signed by the wrong node
    assert not signed_by(a.certificate, record + b" ", a.sign(record))
    assert not signed_by(a.certificate, record, b"short")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2 * MAX_CERTIFICATE_BYTES))
def test_any_bytes_presented_as_a_certificate_are_refused_without_raising(data: bytes):
    members = Membership(RootKey.from_swarm_keys(new_keys()).public)
    assert members.admit(data) is None
    assert members.refused == {"forged": 1}


def test_refusals_are_logged_at_most_once_a_minute_per_kind(
    root: RootKey, caplog: pytest.LogCaptureFixture
):
    members = Membership(root.public)
    with caplog.at_level(logging.WARNING, logger="agentjet.identity"):
        for _ in range(50):
            members.admit(b"garbage")
        members.admit(NodeIdentity.new(root, "late", days=1, now=NOW).certificate, now=NOW + DAY_S)
    assert members.refused == {"forged": 50, "expired": 1}
    assert len(caplog.records) == 2


def test_node_key_files_issue_and_read_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    root_file = tmp_path / "swarm.keys"
    write_keys(root_file)
    out = tmp_path / "box-7.keys"
    args = ["keys", "issue", "--keys", str(root_file), "--node", "box-7", "--out", str(out)]
    assert main(args) == 0
    assert f"--keys {out}" in capsys.readouterr().out
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    node = read_node_keys(out, name="ignored: the file names the node")
    assert node.name == "box-7" and node.server == server_keys(read_keys(root_file))
    root = RootKey.from_swarm_keys(read_keys(root_file))
    assert node.membership.root_public == root.public
    assert Membership(root.public).admit(node.identity.certificate) == node.identity.certificate
    assert main(args) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err
    # A node file is not the root: it cannot issue.
    other = ["keys", "issue", "--keys", str(out), "--node", "x", "--out", str(tmp_path / "x")]
    assert main(other) == 2
    assert "holds one node's keys" in capsys.readouterr().err


def test_a_node_holding_the_root_certifies_itself(tmp_path: Path):
    root_file = tmp_path / "swarm.keys"
    write_keys(root_file)
    node = read_node_keys(root_file, name="trainer-host-12")
    assert node.name == "trainer-host-12"
    root = RootKey.from_swarm_keys(read_keys(root_file))
    assert node.membership.root_public == root.public
    assert node.membership.admit(node.identity.certificate) == node.identity.certificate


@pytest.mark.parametrize("bad_name", ["", "has space", "-leading-dash", "x" * 129, "naïve"])
def test_bad_node_names_are_one_clear_error(root: RootKey, bad_name: str):
    with pytest.raises(ConfigError, match="node name"):
        NodeIdentity.new(root, bad_name)


def test_a_node_key_file_with_someone_elses_keys_is_refused(tmp_path: Path, root: RootKey):
    mine, theirs = NodeIdentity.new(root, "box-1"), NodeIdentity.new(root, "box-2")
    path = tmp_path / "box-1.keys"
    write_node_keys(path, mine, server_keys(new_keys()))
    text = path.read_text().replace(mine.curve.secret.decode(), theirs.curve.secret.decode())
    text = text.replace(mine.curve.public.decode(), theirs.curve.public.decode())
    path.write_text(text)
    with pytest.raises(ConfigError, match="not the ones its certificate names"):
        read_node_keys(path, name="box-1")
    path.write_text(text.replace("certificate = ", 'certificate = "AA" #'))
    with pytest.raises(ConfigError, match="damaged"):
        read_node_keys(path, name="box-1")


def test_peer_bindings_tie_a_peer_id_to_the_node_that_signed_them(root: RootKey):
    """What a trainer's averagers admit callers by (node/members.py `MemberGate`)."""
    node, other = NodeIdentity.new(root, "trainer-a"), NodeIdentity.new(root, "trainer-b")
    members = Membership(root.public)
    binding = node.bind_peer("12D3KooWpeer", expires_at=NOW + 60)
    peer, certificate, expires = members.bound_peer(binding, now=NOW) or ("", None, 0.0)
    assert (peer, certificate, expires) == ("12D3KooWpeer", node.certificate, NOW + 60)
    # another node's signature on this certificate's binding: forged
    decoded = msgspec.msgpack.decode(binding)
    decoded["signature"] = other.sign(b"anything")
    assert members.bound_peer(msgspec.msgpack.encode(decoded), now=NOW) is None
    # a binding past its expiry is a node gone, not a refusal
    assert members.bound_peer(binding, now=NOW + 61) is None
    assert members.bound_peer(b"\x00junk", now=NOW) is None
    assert members.refused == {"forged": 2}
    members.revoke(root.revoke("trainer-a", now=NOW + 1))
    assert members.bound_peer(binding, now=NOW + 2) is None
    assert members.refused == {"forged": 2, "revoked": 1}


def test_signed_records_name_the_node_that_signed_them(root: RootKey):
    """What a directory record is read by (node/directory.py `Directory.records`)."""
    node, other = NodeIdentity.new(root, "rollout-a"), NodeIdentity.new(root, "rollout-b")
    members = Membership(root.public)
    signed = node.sign_record(b"payload")
    assert members.signed_record(signed, now=NOW) == (node.certificate, b"payload")
    # the payload changed after signing, or signed by another node: forged
    decoded = msgspec.msgpack.decode(signed)
    decoded["payload"] = b"changed"
    assert members.signed_record(msgspec.msgpack.encode(decoded), now=NOW) is None
    decoded = msgspec.msgpack.decode(signed)
    decoded["signature"] = other.sign(msgspec.msgpack.decode(signed)["payload"])
    assert members.signed_record(msgspec.msgpack.encode(decoded), now=NOW) is None
    # junk, a bare payload, an oversized one: refused without raising
    for junk in (b"", b"\x00junk", b"payload", node.sign_record(b"x" * 70_000)):
        assert members.signed_record(junk, now=NOW) is None
    assert members.refused == {"forged": 6}
    # another swarm's node, a node past its certificate, a revoked node
    stranger = NodeIdentity.new(RootKey.from_swarm_keys(new_keys()), "rollout-a")
    assert members.signed_record(stranger.sign_record(b"p"), now=NOW) is None
    assert members.signed_record(signed, now=NOW + 400 * DAY_S) is None
    members.revoke(root.revoke("rollout-a"))
    assert members.signed_record(signed) is None
    assert members.refused == {"forged": 7, "expired": 1, "revoked": 1}
