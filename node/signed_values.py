"""What nodes store in the DHT, signed by the node that writes it, and checked when read
(node/directory.py: node records, trained marks, batch intents, checkpoint records).

    writer ──sign_record(payload) / sign_value(key, value)──▶ DHT (any peer can store anything)
    reader ◀──verified_record(subkey, ...) / read_value(key, ...)── the value, or None (refused)

With keys (every swarm but a net.insecure one) a value is read only if a member signed it:
a node's record under its own name (`node_of`: a trainer serving several policies signs
NODE/POLICY as NODE), and any other value for the key (and subkey) it is found under, so
a signed mark is not replayed under another group's key. A refusal is counted by the
reader's `Membership` (impersonation, forged, ...). A member is trusted with what it
signs: certificates carry no role, so a rollout node's signed mark would count (named by
its signature, revocable). Without keys values are stored and read bare.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentjet.identity import Membership, NodeKeys
from node.dht import node_of


def sign_record(keys: NodeKeys | None, payload: bytes) -> bytes:
    """A node record's `payload` as it is stored: with keys, an identity.SignedRecord."""
    return payload if keys is None else keys.identity.sign_record(payload)


def verified_record(membership: Membership, subkey: object, value: object) -> bytes | None:
    """The record `value` stored under `subkey` (a node id) if the member that subkey
    names signed it; else None, the refusal counted by `membership`."""
    signed = membership.signed_record(value)  # type: ignore[arg-type]
    if signed is None:
        return None
    certificate, payload = signed
    if node_of(str(subkey)) != certificate.name:
        membership.refuse(
            "impersonation",
            f"a directory record for {subkey!r} signed by {certificate.name!r}",
        )
        return None
    return payload


def sign_value(keys: NodeKeys | None, key: str, value: Any) -> Any:
    """`value` as it is stored under `key`: with keys, an identity.SignedRecord whose
    payload is `[key, value]`."""
    if keys is None:
        return value
    return keys.identity.sign_record(msgspec.msgpack.encode([key, value]))


def read_value(keys: NodeKeys | None, key: str, found: Any) -> Any:
    """The value a member stored under `key` (`found`: what the DHT returned, or the
    value itself); None when absent, or refused (counted by `keys.membership`)."""
    value = getattr(found, "value", found)
    if keys is None or value is None:
        return value
    signed = keys.membership.signed_record(value)
    if signed is None:
        return None
    certificate, payload = signed
    try:
        stored_for, inner = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError):
        stored_for, inner = None, None
    if stored_for != key:
        keys.membership.refuse(
            "forged", f"a value {certificate.name!r} signed for another key, under {key!r}"
        )
        return None
    return inner
