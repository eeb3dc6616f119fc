"""Who may average with a trainer: the closed swarm's gate over hivemind's averaging handlers.

    trainer ── Directory.declare_member ──▶ DHT <run_id>.agentjet.members
                 (subkey: its peer id; value: identity.PeerBinding, signed by the node)
    a caller of rpc_join_group / rpc_aggregate_part / rpc_download_state
        ──▶ MemberGate.admits(context.remote_id) ── reads bindings + revocations ──▶ bool

The overrides that call the gate (`MembersOnly`) live with hivemind's other overrides in
node/averagers.py; this module holds what they decide by, and the DHT key names the swarm's
directory shares with it. Tests: tests/integration/test_closed_swarm.py (a stranger's peer
refused, a member served), tests/integration/test_fuzz.py (junk calls, junk bindings),
tests/integration/test_keys.py (a revoked trainer), all on real hivemind peers.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from typing import Any

import hivemind
from hivemind.p2p import P2PContext

from agentjet.identity import REFUSAL_LOG_EVERY_S, Membership

log = logging.getLogger(__name__)


def members_key(run_id: str) -> str:
    """Where trainers bind their peer ids to their certificates (subkey: the peer id)."""
    return f"{run_id}.agentjet.members"


def revoked_key(run_id: str) -> str:
    """Where the root's revocations are kept (subkey: the revoked node's name)."""
    return f"{run_id}.agentjet.revoked"


# The gate reads the members' bindings again at most this often (an unknown caller waits
# for the next read), and at least this often anyway, beside a member's call (a revoked
# trainer is shut out within it and one read).
MEMBERS_REREAD_S = 1.0
MEMBERS_MAX_AGE_S = 10.0
# The averaging calls a gate counts refusals of (SwarmOptimizer.counts: refused_<call>).
GATED_CALLS = ("round_joins", "aggregate_parts", "state_downloads")


class MemberGate:
    """Who may call this trainer's averaging handlers (matchmaking, all-reduce parts, state
    download): the peers whose binding to a current, unrevoked certificate is in the DHT
    (`Directory.declare_member`). hivemind 1.1.12 has no authorization hook for these calls
    and its p2pd no private network, so this is checked on every call on the receiving side,
    in the averager's process (`MembersOnly`), which reads the bindings and revocations
    from the DHT itself. A refused call is counted per kind (shared with the trainer's
    process) and logged at most once a minute."""

    def __init__(self, dht: hivemind.DHT, run_id: str, root_public: bytes) -> None:
        self.dht = dht
        self.members_key = members_key(run_id)
        self.revoked_key = revoked_key(run_id)
        self.membership = Membership(root_public)
        self.members: dict[str, tuple[str, float]] = {}  # peer id -> (node name, expiry)
        self.read_at = -MEMBERS_MAX_AGE_S
        # Shared with the trainer's process (made before hivemind forks the averagers).
        self.refused = {call: mp.Value("q", 0) for call in GATED_CALLS}
        self._logged_at: dict[str, float] = {}
        self._reading = asyncio.Lock()  # bound to the averager's loop at first use
        self._refresh: asyncio.Task[None] | None = None  # a read beside members' calls

    async def admits(self, context: P2PContext, call: str) -> bool:
        peer = context.remote_id.to_base58()
        asked = now = time.monotonic()
        if self._bound(peer):
            # A member's call never waits on the DHT (mid all-reduce that wait failed rounds
            # of three on a loaded box): the bindings are read again beside it.
            if now - self.read_at >= MEMBERS_MAX_AGE_S and (
                self._refresh is None or self._refresh.done()
            ):
                self._refresh = asyncio.create_task(self._read_after(asked))
            return True
        # A trainer that just joined stored its binding a moment ago: read again.
        await self._read_after(asked)
        if self._bound(peer):
            return True
        with self.refused[call].get_lock():
            self.refused[call].value += 1
        if now - self._logged_at.get(call, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
            self._logged_at[call] = now
            log.warning(
                "refused %s from %s, no member of this swarm (%d so far; logged once a minute)",
                call.replace("_", " "), peer, self.refused[call].value,
            )  # fmt: skip
        return False

    def _bound(self, peer: str) -> bool:
        member = self.members.get(peer)
        return member is not None and member[1] > time.time()

    async def _read_after(self, asked: float) -> None:
        """Read the bindings unless a read began after `asked` (calls at once share one),
        at most every MEMBERS_REREAD_S (a stranger's calls wait for it, not the DHT)."""
        async with self._reading:
            if self.read_at > asked:
                return
            await asyncio.sleep(max(0.0, self.read_at + MEMBERS_REREAD_S - time.monotonic()))
            await self._read()

    async def _read(self) -> None:
        self.read_at = time.monotonic()
        revoked = await self.dht.get(self.revoked_key, latest=True, return_future=True)
        for data in subkey_values(revoked).values():
            self.membership.revoke(data)
        found = await self.dht.get(self.members_key, latest=True, return_future=True)
        members = {}
        for data in subkey_values(found).values():
            bound = self.membership.bound_peer(data)
            if bound is not None:
                peer, certificate, expires = bound
                members[peer] = (certificate.name, expires)
        self.members = members

    def refusals(self) -> dict[str, int]:
        """Refused calls so far, per kind (GATED_CALLS)."""
        return {call: int(value.value) for call, value in self.refused.items()}

    def counts(self) -> dict[str, int]:
        return {f"refused_{call}": n for call, n in self.refusals().items()}


def subkey_values(found: Any) -> dict[Any, bytes]:
    """The bytes values of a DHT key's subkeys (a hivemind `get(latest=True)` result)."""
    if found is None or not isinstance(found.value, dict):
        return {}
    values = {}
    for subkey, item in found.value.items():
        value = getattr(item, "value", None)
        if isinstance(value, bytes):
            values[subkey] = value
    return values
