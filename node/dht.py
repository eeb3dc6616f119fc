"""The swarm's DHT: started and joined (`start_dht`, retried with backoff), closed to
peers without a current certificate when the swarm has keys, and hivemind's own logs kept
quiet.

With keys every DHT request and reply is signed and checked (`SwarmAuthorizer`: a node's
certificate is its access token), so a peer without a current, unrevoked certificate cannot
join the DHT, read the directory or store in it; revocations travel through the DHT itself
(node/directory.py `Directory.sync_revocations`). hivemind's averaging and state-download
calls are not covered by its authorizer: the averagers answer only members whose peer id
is bound to their certificate in the DHT (node/members.py `MemberGate`, node/averagers.py
`MembersOnly`).

Lessons from DESIGN.md §8 live here and in node/optimizer.py: explicit ordered shutdown
(optimizer, then DHT) so no `p2pd` is orphaned, and hivemind's own logging kept quiet
(`ExpectedSwarmErrors`). Checked against hivemind 1.1.12.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import logging
import signal
import threading
import time
import traceback
from datetime import UTC, datetime, timedelta

import hivemind
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.logging import use_hivemind_log_handler

from agentjet.config import SwarmConfig
from agentjet.errors import AgentjetError
from agentjet.identity import (
    Membership,
    NodeKeys,
    encode_certificate,
    signed_by,
)
from agentjet.logs import RepeatedLog

log = logging.getLogger(__name__)

# Seconds between attempts to start the DHT (doubled each time).
STARTUP_BACKOFF_S = 2.0
# A peer's DHT access token lasts this long and is renewed this long before it expires
# (a token only binds the peer's signing key to the swarm; it costs nothing to renew).
TOKEN_LIFETIME = timedelta(hours=24)
TOKEN_RENEW_BEFORE = timedelta(hours=1)


class SwarmAuthorizer(TokenAuthorizerBase):  # type: ignore[misc]
    """hivemind's DHT authorization (hivemind 1.1.12's `TokenAuthorizerBase`), with node
    certificates as the access tokens.

    hivemind signs each DHT request and reply with the peer's RSA key and sends an access
    token that vouches for that key; a peer answers (and accepts answers) only when the
    token is valid. Here a node's token is its certificate (agentjet/identity.py, base64
    in the token's `username`), its RSA public key and an expiry, signed with the node's
    own Ed25519 key. It is valid while the root signed the certificate, the certificate is
    current and not revoked (`membership`, in the DHT's process: `Directory.sync_revocations`
    hands it each revocation the node learns), and the node's key made the signature. So
    only a node with a current certificate reaches the DHT, and a revoked node loses it at
    the next heartbeat of each peer it talks to. hivemind also rejects requests more than a
    minute old by the wall clock, so the peers' clocks must agree to within a minute.

    hivemind's DHT is a forked process: the authorizer, with the node's keys, is inherited,
    never pickled.
    """

    def __init__(self, keys: NodeKeys) -> None:
        super().__init__()
        self.identity = keys.identity
        self.membership = Membership(keys.membership.root_public)
        for revocation in keys.membership.revocations.values():
            self.membership.revoke(revocation)
        self._certificate = base64.b64encode(encode_certificate(keys.identity.certificate))

    @staticmethod
    def _signed(token: AccessToken) -> bytes:
        return b"\0".join(
            [token.username.encode(), token.public_key, token.expiration_time.encode()]
        )

    async def get_token(self) -> AccessToken:
        expires = min(
            datetime.now(UTC) + TOKEN_LIFETIME,
            datetime.fromtimestamp(self.identity.certificate.expires_at, UTC),
        )
        token = AccessToken(
            username=self._certificate.decode(),
            public_key=self.local_public_key.to_bytes(),
            expiration_time=expires.isoformat(),
        )
        token.signature = self.identity.sign(self._signed(token))
        return token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        expires = _expiry(access_token)
        if expires is None or expires <= datetime.now(UTC):
            return False
        try:
            presented = base64.b64decode(access_token.username, validate=True)
        except (ValueError, binascii.Error):
            presented = b""
        certificate = self.membership.admit(presented)
        return certificate is not None and signed_by(
            certificate, self._signed(access_token), access_token.signature
        )

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        expires = _expiry(access_token)
        return expires is None or expires < datetime.now(UTC) + TOKEN_RENEW_BEFORE


def _expiry(token: AccessToken) -> datetime | None:
    try:
        expires = datetime.fromisoformat(token.expiration_time)
    except ValueError:
        return None
    return expires if expires.tzinfo is not None else None


# hivemind's ERROR logs (with tracebacks) of conditions a swarm expects: a peer gone, a
# record that outlived its node. Checked against hivemind 1.1.12's messages.
EXPECTED_SWARM_ERRORS = (
    "Failed to download state from",  # averaging/averager.py: a dead peer's record
    "Failed to load state from peer",  # optim/optimizer.py, state_averager.py
    "could not find a group",  # averaging/averager.py: no peer to average with (gone, busy)
    "Unable to run All-Reduce",  # averaging/averager.py: a round broke (RoundFailed says so)
    "dial to self attempted",
    "failed to dial",
    "connection refused",
)


# How hivemind's own waits end when a round or a download is given up or times out. asyncio
# reports each such task nobody retrieved at ERROR, with a traceback ("Task exception was
# never retrieved"): 114 per trainer in a loaded run (issue 47), burying the real messages.
EXPECTED_TASK_ENDS = (asyncio.CancelledError, TimeoutError, concurrent.futures.InvalidStateError)
_task_ends = RepeatedLog(
    log,
    "a hivemind task ended with {detail} (its own wait timed out or was given up; "
    "such ends are counted from now on)",
    "{count} more hivemind tasks ended with a timeout or cancellation in the last "
    "{seconds:.0f} s; the last: {detail}",
)
_task_ends_lock = threading.Lock()  # (records come from hivemind's threads)


def _hivemind_task_end(record: logging.LogRecord) -> BaseException | None:
    """The error of an asyncio record about a hivemind task that ended the expected way,
    else None: a timeout or cancellation, raised in hivemind's code, or of a task named for
    hivemind or of a bare `asyncio.wait_for` (its progress tracker stores its progress in
    such tasks and never awaits them; this project's code awaits every one it makes)."""
    error = record.exc_info[1] if record.exc_info else None
    if record.name != "asyncio" or not isinstance(error, EXPECTED_TASK_ENDS):
        return None
    message = record.getMessage()
    if "/hivemind/" in message or "coro=<wait_for()" in message:
        return error
    cause: BaseException | None = error
    while cause is not None:
        frames = traceback.extract_tb(cause.__traceback__)
        if any("/hivemind/" in frame.filename for frame in frames):
            return error
        cause = cause.__cause__ or cause.__context__
    return None


class ExpectedSwarmErrors(logging.Filter):
    """Turns hivemind's ERROR records of expected swarm conditions into one WARNING line,
    without the traceback; hivemind's tasks that ended in an expected timeout or
    cancellation are counted and logged once per interval (`_task_ends`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ended = _hivemind_task_end(record)
        if ended is not None:
            # Counted once, though each of the root logger's handlers has this filter.
            if not getattr(record, "task_end_counted", False):
                record.task_end_counted = True
                with _task_ends_lock:
                    _task_ends.note(repr(ended))
            return False
        if record.levelno < logging.ERROR or not record.name.startswith("hivemind"):
            return True
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({record.exc_info[1]!r})"
        if any(pattern in text for pattern in EXPECTED_SWARM_ERRORS):
            record.msg, record.args = text.splitlines()[0][:300], None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def quiet_hivemind() -> None:
    """Route hivemind's logs through ours at WARNING so users see progress, not its noise;
    expected conditions of a swarm come as one WARNING line (`ExpectedSwarmErrors`)."""
    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    # On the handlers: a logger's own filters never see its children's records.
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ExpectedSwarmErrors) for f in handler.filters):
            handler.addFilter(ExpectedSwarmErrors())


def start_dht(
    config: SwarmConfig, keys: NodeKeys | None, *, client_mode: bool = False
) -> hivemind.DHT:
    """Start this node's DHT peer, joining `config.initial_peers`; retried with backoff.

    With `keys` it talks only to peers that hold them (`SwarmAuthorizer`); None only for
    in-process tests and `net.insecure`.

    hivemind's DHT process and p2pd inherit SIGINT ignored: a Ctrl-C in a terminal (sent
    to the whole process group) then reaches only this process, which shuts them down in
    order instead of racing their deaths.
    """
    quiet_hivemind()
    delay = STARTUP_BACKOFF_S
    for attempt in range(1, config.startup_attempts + 1):
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return hivemind.DHT(
                initial_peers=config.initial_peers,
                host_maddrs=config.host_maddrs,
                announce_maddrs=config.announce_maddrs or None,
                identity_path=config.identity_path or None,
                client_mode=client_mode,
                start=True,
                startup_timeout=config.startup_timeout_s,
                authorizer=SwarmAuthorizer(keys) if keys is not None else None,
            )
        except Exception as e:  # hivemind raises several types for "could not start or join"
            where = ", ".join(config.initial_peers) or "a new swarm"
            if attempt == config.startup_attempts:
                raise AgentjetError(
                    f"could not start the swarm's DHT ({where}) after {attempt} attempts: {e}"
                ) from None
            log.warning("DHT start (%s) failed: %s; retrying in %.0f s", where, e, delay)
        finally:
            signal.signal(signal.SIGINT, previous)
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def node_of(node_id: str) -> str:
    """The node whose keys sign `node_id`'s record: `node_id` itself, or NODE for the
    NODE/POLICY of a trainer process serving several policies (node/trainer_host.py)."""
    return node_id.partition("/")[0]
