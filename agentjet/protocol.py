"""Every wire message, in one place: msgspec Structs, msgpack on the wire.

Two sockets, each with its own tagged union and decoder:

    coordinator (ROUTER) ◀── CoordinatorRequest ── rollout node / any node (DEALER)
                          ── CoordinatorReply   ──▶
    trainer     (ROUTER) ◀── TrainerRequest     ── rollout node (DEALER)
                          ── TrainerReply       ──▶

Both answer `MetricsRequest` (the dashboard's live mode) from the rows their metrics
writer keeps in memory (agentjet/metrics.py `RecentRows`).

Handshake: a node's first message on a socket is `Hello`; the server answers `Welcome`
or `Error(code="version")` when `protocol_version` differs. Token arrays travel as
packed little-endian bytes (int32 ids, float32 logprobs, uint8 masks), not lists.
Schema evolution: add fields at the end, with defaults.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgspec
import numpy as np

# 2: Task.setup/check (sandboxed environments), Sample.faults and Sample.episode.
# 3: groups are held until trained (GroupStatusQuery); NodeRecord in the swarm's DHT.
# 4: policy lineages (Lineage in PolicyInfo and NodeRecord, TrajectoryGroup.lineage).
# 5: NodeRecord.gpus (a v4 peer refuses the unknown field, so it would skip every record).
# 6: Task rows carry anything: chat-message prompts, any JSON answer, Task.fields.
# 7: MetricsRequest / MetricsRows on both sockets (a role's recent metrics rows);
#    GroupStatus.node_id and SubmitGroup.trainer_id.
# 8: GroupAck status "zero_variance" (dynamic sampling: a group that teaches nothing).
# 9: SchedulerRow.keep (an environment's EnvSched keep rate); Hello.certificate (the
#    sender's node certificate, agentjet/identity.py) and Error code "denied"; directory
#    records signed by their node (identity.SignedRecord) and NodeRecord.refused.
# 10: policy versions with a manifest (PolicyInfo.chunk_hashes; sha256 is the manifest's),
#    sealed chunks and their endpoint without CURVE (PolicyInfo.key, .ticket,
#    .sealed_endpoint; WeightChunkRequest.ticket).
# 11: relays (node/relay.py): a rollout node's NodeRecord.endpoint is its relay, which
#    answers chunk requests, or Error code "absent"; PolicyQuery.manifest.
# 12: PolicyInfo.local (a node on its trainer's host maps the trainer's copy);
#    Sample.teacher_logprobs (on-policy distillation, node/teacher.py).
# 13: teacher nodes (node/teacher_node.py): TeacherScoreRequest / TeacherScores, a
#    NodeRecord of role "teacher" naming the teachers it serves.
# 14: several policies (issue 26): WorkGrant.policy, TrajectoryGroup.policy,
#    NodeRecord.policy (a trainer's) and NodeRecord.policy_versions (a rollout node's),
#    WorkRequest.policies.
# 15: a teacher's top k (envs[].teacher_top_k): Sample.teacher_top_ids / teacher_top_logprobs,
#    TeacherScoreRequest.top_k, TeacherScores.top_ids / top_logprobs.
# 16: NodeRecord.rounds: why a trainer's gradient rounds keep failing (node/rounds.py).
# 17: delta versions: PolicyInfo.deltas, WeightChunkRequest.base, WeightChunk.base
#    (node/delta.py).
PROTOCOL_VERSION = 17

# Most teacher tokens a position may carry (envs[].teacher_top_k's bound).
MAX_TOP_K = 64

# Earlier lineages a Lineage remembers (one per trainer restart from a checkpoint).
MAX_ANCESTORS = 16
LINEAGE_ID_CHARS = 12


class _Msg(msgspec.Struct, kw_only=True, tag_field="t", forbid_unknown_fields=True):
    pass


MESSAGE_ROLES = ("system", "user", "assistant")


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chat message of a task's prompt."""

    role: Literal["system", "user", "assistant"]
    content: str


class Task(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One task of one environment: a row of a task file, or a generated one.

    `prompt` is the user's text, or a conversation (system, user and earlier turns; the
    last message the user's). `answer` is any JSON value (arithmetic environments check an
    integer). Sandboxed environments write `setup`, (path, text) pairs, into the episode's
    work dir before the first turn and score by running `check`, a Python program, in the
    same sandbox after the last: exit code 0 is success. `fields` holds the row's other
    columns, untouched, for reward functions and agents. Neither `answer`, `check` nor
    `fields` is shown to the model by the built-in environments.
    """

    id: str
    env: str
    prompt: str | tuple[Message, ...]
    answer: Any = None
    op: str = ""
    difficulty: int = 0
    setup: tuple[tuple[str, str], ...] = ()
    check: str = ""
    fields: dict[str, Any] = msgspec.field(default_factory=dict)

    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages (a string prompt is one user message)."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [{"role": m.role, "content": m.content} for m in self.prompt]

    def prompt_json(self) -> str | list[dict[str, str]]:
        """The prompt as it appears in a task file."""
        return self.prompt if isinstance(self.prompt, str) else self.messages()


# ── handshake and errors (both sockets) ───────────────────────────────────────────


class Hello(_Msg, tag="hello"):
    node_id: str
    role: Literal["rollout", "trainer", "coordinator", "client", "teacher"]
    protocol_version: int = PROTOCOL_VERSION
    # The sender's node certificate (agentjet/identity.py, msgpack), naming node_id and the
    # CURVE key the connection uses; b"" without keys (net.insecure).
    certificate: bytes = b""


class Welcome(_Msg, tag="welcome"):
    protocol_version: int = PROTOCOL_VERSION
    run_id: str = ""
    policy_version: int = 0


class Error(_Msg, tag="error"):
    # busy: the trainer's queue is full, offer the group again later. gone: the trainer a
    # request named is not the one at that endpoint (SubmitGroup.trainer_id). denied: the
    # sender is no member of the swarm (agentjet/transport.py: its certificate was refused,
    # it presented none, or the message names another node). absent: a relay (node/relay.py)
    # holds the version, not that chunk yet (a relay says "gone" of a version it holds not).
    code: Literal["decode", "version", "invalid", "unknown", "busy", "gone", "denied", "absent"]
    message: str


class Ok(_Msg, tag="ok"):
    pass


class MetricsRequest(_Msg, tag="metrics_request"):
    """The role's recent metrics rows from row number `since` on (rows are numbered from 0
    in the order the role wrote them; ask again from `MetricsRows.next`)."""

    since: int


class MetricsRows(_Msg, tag="metrics_rows"):
    """Rows `next - len(rows)` to `next - 1`, each the JSON text of one line of the role's
    metrics/<role>.jsonl. A role keeps only its newest rows: `dropped` counts those after
    `since` that it no longer holds; `written` is how many rows it has written."""

    rows: list[str]
    next: int
    written: int = 0
    dropped: int = 0


# ── coordinator ───────────────────────────────────────────────────────────────────


class WorkRequest(_Msg, tag="work_request"):
    node_id: str
    max_groups: int
    policy_version: int = 0
    # With [[policies]]: the policies the node has room for (its groups of the others wait
    # for their trainers); [] = any.
    policies: list[str] = msgspec.field(default_factory=list)


class WorkGrant(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    grant_id: str
    task: Task
    group_size: int
    lease_s: float
    # The policy that plays it ([[policies]] name; "" = the swarm's one policy).
    policy: str = ""


class WorkGrants(_Msg, tag="work_grants"):
    grants: list[WorkGrant]


class GroupReport(_Msg, tag="group_report"):
    """A rollout node's outcome for one grant: the scheduler learns from it."""

    node_id: str
    grant_id: str
    rewards: list[float]
    completion_tokens: int = 0
    turns: float = 0.0
    wall_s: float = 0.0
    failed: bool = False
    error: str = ""


class Heartbeat(_Msg, tag="heartbeat"):
    """Keeps a node's leases alive while it works on long episodes."""

    node_id: str
    role: str
    policy_version: int = 0


class StatusRequest(_Msg, tag="status_request"):
    pass


class SchedulerRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One line of the scheduler's table: an environment, a cell (env, op, difficulty) or a task.

    Environment rows carry what was observed, cell and task rows what the scheduler predicts;
    rewards, variances and rates are decayed with age like the scheduler's statistics.
    """

    level: Literal["env", "cell", "task"]
    name: str
    visits: int  # groups reported, ever
    mean_reward: float | None = None
    variance: float | None = None  # reward variance inside one group
    mixed: float | None = None  # P(a group's rewards are not all equal)
    grant_share: float = 0.0  # share of the recent grants (CoordinatorStatus.recent_grants)
    score: float | None = None  # cells: the sampling weight of an unseen task of the cell
    target_share: float | None = None  # envs: ratio target x health, normalised
    failure_rate: float | None = None  # envs: share of groups reported as failed
    keep: float | None = None  # envs: EnvSched's keep rate for predicted zero-variance work


class CoordinatorStatus(_Msg, tag="coordinator_status"):
    grants_issued: int
    grants_completed: int
    grants_expired: int
    leases_open: int
    nodes: dict[str, float]  # node id -> seconds since last seen
    rejected_messages: int
    scheduler: str = ""  # coordinator.scheduler; "" from a coordinator that predates it
    regrants_queued: int = 0
    recent_grants: int = 0  # how many of the newest grants `grant_share` counts over
    table: list[SchedulerRow] = msgspec.field(default_factory=list)
    denied_handshakes: int = 0  # connection attempts without the swarm's keys (transport.py)
    # Requests refused as no member's, by kind: forged, expired, revoked, impersonation,
    # anonymous (agentjet/identity.py).
    refused: dict[str, int] = msgspec.field(default_factory=dict)


CoordinatorRequest = Hello | WorkRequest | GroupReport | Heartbeat | StatusRequest | MetricsRequest
CoordinatorReply = Welcome | WorkGrants | Ok | CoordinatorStatus | MetricsRows | Error


# ── trainer ───────────────────────────────────────────────────────────────────────


class Sample(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One sequence to train on: prompt then completion, token-in/token-out.

    `completion_ids`, `logprobs` and `loss_mask` have one entry per completion token.
    In multi-turn episodes the completion holds the model's turns *and* the tool output
    fed back between them; `loss_mask` is 1 on the model's own tokens only, and
    `logprobs` is the sampler's logprob there (0 elsewhere). `teacher_logprobs`, in
    environments with a teacher (on-policy distillation), the teacher's logprob of the same
    tokens (0 where the mask is 0); empty otherwise. `teacher_top_ids` and
    `teacher_top_logprobs`, with a teacher's top k (envs[].teacher_top_k): at each
    completion token, the teacher's k likeliest tokens there and their logprobs, row-major
    [completion tokens, k] (0 where the mask is 0); empty otherwise.
    """

    prompt_ids: bytes  # int32
    completion_ids: bytes  # int32
    logprobs: bytes  # float32
    loss_mask: bytes  # uint8
    reward: float
    advantage: float
    policy_version: int
    turns: int = 1
    finish_reason: str = ""
    error: str = ""
    # What went wrong in the sandbox, one entry per fault (sandboxes.base.FAULTS).
    faults: list[str] = msgspec.field(default_factory=list)
    # The episode (index in its group) this sequence belongs to, when an episode's model
    # calls forked into several sequences (agentjet.timeline); -1: the sample is a whole
    # episode. Advantages are per episode.
    episode: int = -1
    teacher_logprobs: bytes = b""  # float32
    teacher_top_ids: bytes = b""  # int32
    teacher_top_logprobs: bytes = b""  # float32


class TrajectoryGroup(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    group_id: str
    grant_id: str
    node_id: str
    task_id: str
    env: str
    samples: list[Sample]
    created_at: float
    wall_s: float = 0.0
    # The lineage of the policy that sampled it (its versions are the samples'); "" = the
    # base weights, before any trainer's step.
    lineage: str = ""
    # The policy that sampled it (its grant's); only that policy's trainers take it.
    policy: str = ""


class Lineage(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Which history of weights a policy version number belongs to.

    Version numbers alone repeat: a trainer resumed from a checkpoint older than the
    versions it had published numbers its next steps as those were numbered. So a start
    from anything but the swarm's live weights opens a lineage: the run's first history is
    the root lineage "" (whose version 0 is the base weights, in every lineage's history),
    a resume from a checkpoint forks the checkpoint's lineage there. `ancestors` names the
    lineages this one grew from, each with the last of its versions in this one's history.
    Fork ids are derived from the parent, the version and a counter (`fork_id`), so
    trainers that resume from the same version of the swarm (same weights) open the same
    lineage; a counter skips ids already used (`open_lineage`)."""

    id: str = ""
    ancestors: dict[str, int] = msgspec.field(default_factory=dict)

    def holds(self, lineage_id: str, version: int, newest: int) -> bool:
        """Whether the weights `version` of lineage `lineage_id` are in this lineage's
        history, whose newest version is `newest`."""
        if lineage_id == self.id:
            return version <= newest
        base = 0 if lineage_id == "" else -1
        return version <= self.ancestors.get(lineage_id, base)

    def trains(self, lineage_id: str, version: int) -> bool:
        """Whether samples of the policy `version` of `lineage_id` can be trained on weights
        of this lineage (importance ratios against them mean something): any version of
        this lineage (peers may be ahead), an ancestor's up to the fork."""
        return lineage_id == self.id or self.holds(lineage_id, version, newest=-1)

    def supersedes(
        self, version: int, current: Lineage, current_version: int, live: Iterable[Lineage]
    ) -> bool:
        """Whether a rollout node holding `current_version` of `current` should load this
        lineage's `version`: a newer version of the same lineage, or any version of
        another lineage unless `current` grew from it (a node never goes back) while a
        trainer in `live` (the live trainers' lineages) still trains `current` or a lineage
        grown from it. A lineage none of them continues is abandoned (seen: a trainer
        resumed from its checkpoint, served that fork for 2 s, then took the swarm's
        weights of the lineage the fork grew from): the node follows the live ones."""
        if self.id == current.id:
            return version > current_version
        if self.id not in current.ancestors:
            return True
        return not any(t.id == current.id or current.id in t.ancestors for t in live)

    def fork(self, version: int, counter: int = 0) -> Lineage:
        """The lineage that starts from this one's weights `version` (`counter`: the how
        many-th fork from that point)."""
        ancestors = {**self.ancestors, self.id: version}
        return Lineage(
            id=fork_id(self.id, version, counter),
            ancestors=dict(list(ancestors.items())[-MAX_ANCESTORS:]),
        )


def fork_id(parent: str, version: int, counter: int) -> str:
    digest = hashlib.sha256(f"{parent}@{version}#{counter}".encode()).hexdigest()
    return digest[:LINEAGE_ID_CHARS]


def open_lineage(parent: Lineage, version: int, taken: Callable[[str], bool]) -> Lineage:
    """The lineage a trainer opens when it starts from version `version` of `parent` (its
    checkpoint's; the root for a fresh start from the base weights): the root itself for
    the run's first start, else the first fork not `taken` (used by this trainer before, or
    listed in the swarm's directory past `version`: another life already published there)."""
    if parent.id == "" and version == 0 and not taken(""):
        return parent
    counter = 0
    while taken(fork_id(parent.id, version, counter)):
        counter += 1
    return parent.fork(version, counter)


class SubmitGroup(_Msg, tag="submit_group"):
    """A group for the trainer `trainer_id` ("": whichever answers). A trainer with another
    node id answers Error(code="gone"): the one the sender meant died and this one was
    restarted on its endpoint (a ZMQ client reconnects to it by itself); queued here, the
    group would also be sent on when the sender settles the dead trainer's groups."""

    group: TrajectoryGroup
    trainer_id: str = ""


class GroupAck(_Msg, tag="group_ack"):
    """A trainer's answer to SubmitGroup.

    "accepted" (queued) and "duplicate" (already queued or trained here) mean the trainer
    holds the group: the rollout node keeps its copy until GroupStatus says "trained", so
    a trainer that dies with groups in its queue loses nothing. "stale", "rejected" and
    "zero_variance" (dynamic sampling: the group's rewards all agree, so it would add no
    gradient; left out, never trained) are final.
    """

    group_id: str
    status: Literal["accepted", "duplicate", "stale", "rejected", "zero_variance"]
    policy_version: int
    reason: str = ""


# Most group ids one GroupStatusQuery may ask about.
MAX_STATUS_IDS = 4096


class GroupStatusQuery(_Msg, tag="group_status_query"):
    group_ids: list[str]


class GroupStatus(_Msg, tag="group_status"):
    """Per asked id: "trained" (in the swarm's weights), "dropped" (stale or rejected:
    final), "queued" (held, not yet trained), "unknown" (never seen here, or the trainer
    restarted: send it again)."""

    statuses: dict[str, Literal["trained", "dropped", "queued", "unknown"]]
    policy_version: int
    # The lineage of the answering trainer's weights (its policy_version is of that lineage).
    lineage: Lineage = msgspec.field(default_factory=Lineage)
    # The answering trainer's node id: a trainer restarted on the same endpoint is another.
    node_id: str = ""


class PolicyQuery(_Msg, tag="policy_query"):
    # False: the answer leaves out the manifest, key and ticket (a rollout node's poll for a
    # newer version: a manifest is 32 bytes per chunk, 2 KB for SmolLM2-135M in 8 MiB chunks).
    manifest: bool = True


class LocalCopy(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where a policy version lies in its trainer's memory, for a node on the same host
    (the same `host`: the kernel's boot id) to map instead of fetching: the trainer's
    process and the file descriptor of its frozen memory file (node/weights.py)."""

    host: str
    pid: int
    fd: int


class DeltaManifest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Version `version` as the changes from version `base` (node/delta.py): chunks of its
    own (`chunk_hashes`, `sha256`, `nbytes`, `chunk_bytes`), sealed under that version's
    `key` and asked for with its `ticket` and `WeightChunkRequest.base`; only a node
    holding the version whose checksum is `base_sha256` can use it. What a node makes of a
    chain of them is checked against the newest version's own manifest."""

    version: int  # the version it makes
    base: int  # the version it changes
    base_sha256: str
    nbytes: int
    chunk_bytes: int  # its chunks' size (smaller than a version's: relays pass them sooner)
    chunk_hashes: list[bytes]
    sha256: str  # of its chunk hashes (node/weights.py `manifest_digest`)
    key: bytes = b""  # its version's (PolicyInfo.key of that version)
    ticket: bytes = b""


class PolicyInfo(_Msg, tag="policy_info"):
    """The newest complete policy version a trainer serves (version 0 = base weights), with
    its manifest: the blake3 hash of each chunk (node/weights.py). With the swarm's keys its
    chunks are sealed under `key` (AES-256-GCM), which travels only over CURVE, and
    `sealed_endpoint` serves them without CURVE to requests carrying `ticket`. `local`:
    where a node on the trainer's host can map it (whatever it maps is checked against the
    manifest as fetched chunks are)."""

    version: int
    nbytes: int
    sha256: str  # of the manifest (node/weights.py `manifest_digest`)
    num_chunks: int
    lineage: Lineage = msgspec.field(default_factory=Lineage)
    chunk_bytes: int = 0
    chunk_hashes: list[bytes] = msgspec.field(default_factory=list)
    key: bytes = b""
    ticket: bytes = b""
    sealed_endpoint: str = ""
    local: LocalCopy | None = None
    # This version from versions before: a chain of deltas, oldest first, each from the
    # version the one before it makes (the last makes this version).
    deltas: list[DeltaManifest] = msgspec.field(default_factory=list)


class WeightChunkRequest(_Msg, tag="weight_chunk_request"):
    version: int
    index: int
    ticket: bytes = b""  # PolicyInfo.ticket: asked on the sealed endpoint only
    base: int = -1  # -1: a chunk of the version; else of its delta from version `base`


class WeightChunk(_Msg, tag="weight_chunk"):
    version: int
    index: int
    data: memoryview  # decoded as a view of the received message, not a copy
    base: int = -1  # as asked (WeightChunkRequest.base)


TrainerRequest = (
    Hello | SubmitGroup | GroupStatusQuery | PolicyQuery | WeightChunkRequest | MetricsRequest
)
TrainerReply = Welcome | GroupAck | GroupStatus | PolicyInfo | WeightChunk | MetricsRows | Error


# ── discovery (values in the swarm's DHT, not on a socket) ────────────────────────


class GpuStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One GPU a node uses, as NVML saw it at its last heartbeat (node/gpu_monitor.py).

    `index` is the CUDA index as the node's role sees it (after CUDA_VISIBLE_DEVICES);
    memory is in MiB (2**20 bytes, as nvidia-smi counts). `power_w` and `temp_c` are None
    where the board does not report them.
    """

    index: int
    name: str
    util_pct: float
    mem_used_mb: float
    mem_total_mb: float
    power_w: float | None = None
    temp_c: float | None = None


class NodeRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a node says about itself in the swarm's DHT, refreshed every heartbeat.

    `endpoint` is the ZMQ endpoint others connect to: a coordinator's, trainer's or teacher
    node's socket, a rollout node's relay (node/relay.py; "" when it serves none). `queue`
    is a trainer's queued groups, a rollout node's unacknowledged ones or a teacher node's
    requests waiting; `capacity` the most it holds (trainer.max_queued_groups,
    rollout.max_unacked_groups, node/teacher_node.py MAX_WAITING).
    """

    node_id: str
    role: Literal["coordinator", "trainer", "rollout", "teacher"]
    endpoint: str = ""
    maddrs: list[str] = msgspec.field(default_factory=list)
    policy_version: int = 0
    queue: int = 0
    capacity: int = 0
    samples_per_s: float = 0.0
    time: float = 0.0  # wall clock of the heartbeat, seconds since the epoch
    protocol_version: int = PROTOCOL_VERSION
    # A trainer's quarantined nodes (node/verify.py): their groups kept failing its checks.
    quarantined: list[str] = msgspec.field(default_factory=list)
    # A trainer's policy lineage (its `policy_version` is of that lineage).
    lineage: Lineage = msgspec.field(default_factory=Lineage)
    # NVML, per GPU the node uses (node/gpu_monitor.py); empty on CPU nodes.
    gpus: list[GpuStats] = msgspec.field(default_factory=list)
    # What a trainer refused since it started, by kind (non-zero only): certificates and
    # requests on its socket (forged, expired, revoked, impersonation, anonymous), handshakes
    # without the swarm's keys (handshakes), and non-members' averaging calls (round_joins,
    # aggregate_parts, state_downloads).
    refused: dict[str, int] = msgspec.field(default_factory=dict)
    # A teacher node's teachers (the names environments give them: envs[].teacher).
    teachers: list[str] = msgspec.field(default_factory=list)
    # The policy a trainer trains ("" = the swarm's one policy); a rollout node's version
    # of each policy it holds (with [[policies]]).
    policy: str = ""
    policy_versions: dict[str, int] = msgspec.field(default_factory=dict)
    # Why a trainer's gradient rounds keep failing, with the setting to change ("" = they
    # work): node/rounds.py.
    rounds: str = ""


# ── teacher nodes ─────────────────────────────────────────────────────────────────


class TeacherInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One sample to score: its tokens and which completion tokens are the model's."""

    prompt_ids: bytes  # int32
    completion_ids: bytes  # int32
    loss_mask: bytes  # uint8


class TeacherScoreRequest(_Msg, tag="teacher_score_request"):
    """Score these samples with the teacher named `teacher` (as the environments' config
    names it), at the sampler's temperature (node/teacher_node.py), with its `top_k`
    likeliest tokens at each of the model's tokens when top_k > 0."""

    node_id: str
    teacher: str
    temperature: float
    samples: list[TeacherInput]
    top_k: int = 0


class TeacherScores(_Msg, tag="teacher_scores"):
    """Per sample, the teacher's logprob of each completion token (float32; 0 where the
    loss mask is 0), and when the request asked for a top k, its top k there (as
    Sample.teacher_top_ids / teacher_top_logprobs)."""

    logprobs: list[bytes]
    top_ids: list[bytes] = msgspec.field(default_factory=list)
    top_logprobs: list[bytes] = msgspec.field(default_factory=list)


TeacherRequest = Hello | TeacherScoreRequest
TeacherReply = Welcome | TeacherScores | Error


# ── codecs ────────────────────────────────────────────────────────────────────────

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


coordinator_request_decoder = msgspec.msgpack.Decoder(CoordinatorRequest)
coordinator_reply_decoder = msgspec.msgpack.Decoder(CoordinatorReply)
trainer_request_decoder = msgspec.msgpack.Decoder(TrainerRequest)
trainer_reply_decoder = msgspec.msgpack.Decoder(TrainerReply)
node_record_decoder = msgspec.msgpack.Decoder(NodeRecord)
teacher_request_decoder = msgspec.msgpack.Decoder(TeacherRequest)
teacher_reply_decoder = msgspec.msgpack.Decoder(TeacherReply)


def pack_ids(ids: list[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4")


def pack_floats(values: list[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4")


def pack_mask(values: list[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=np.uint8).tobytes()


def unpack_mask(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


# Longest node id a group may name (a hostname is at most 64; trainers list ids in the DHT).
MAX_NODE_ID_CHARS = 256


def check_tokens(s: Sample | TeacherInput, vocab_size: int, max_tokens: int) -> str | None:
    """Why a sample's tokens and loss mask are malformed, or None."""
    if len(s.prompt_ids) % 4 or len(s.completion_ids) % 4:
        return "token arrays are not whole int32 values"
    n_prompt, n = len(s.prompt_ids) // 4, len(s.completion_ids) // 4
    if n_prompt == 0 or n == 0:
        return "empty prompt or completion"
    if n_prompt + n > max_tokens:
        return f"{n_prompt + n} tokens (at most {max_tokens})"
    if len(s.loss_mask) != n:
        return f"loss_mask length differs from completion length {n}"
    for arr in (unpack_ids(s.prompt_ids), unpack_ids(s.completion_ids)):
        if arr.min() < 0 or arr.max() >= vocab_size:
            return f"token id outside the vocabulary (size {vocab_size})"
    return None


def check_logprobs(data: bytes, n: int, what: str) -> str | None:
    """Why `data` is not n logprobs (float32, finite, <= 0), or None."""
    if len(data) != 4 * n:
        return f"{what} length differs from completion length {n}"
    values = unpack_floats(data)
    if not np.isfinite(values).all() or (values > 1e-3).any():
        return f"{what} must be finite and <= 0"
    return None


def top_k_of(ids: bytes, n: int) -> int:
    """The k of a top-k array of `ids` for n completion tokens (0 when it is not k x n
    whole int32 values for a k in 1..MAX_TOP_K)."""
    k, rest = divmod(len(ids), 4 * n) if n else (0, 1)
    return k if not rest and 1 <= k <= MAX_TOP_K else 0


def check_top(ids: bytes, logprobs: bytes, n: int, vocab_size: int) -> str | None:
    """Why `ids` and `logprobs` are not a teacher's top k at each of n completion tokens
    (k in 1..MAX_TOP_K token ids of the vocabulary, k logprobs finite and <= 0 each), or
    None."""
    k = top_k_of(ids, n)
    if not k:
        return f"teacher top ids are not k x {n} token ids for a k in 1..{MAX_TOP_K}"
    if len(logprobs) != len(ids):
        return "teacher top logprobs and ids differ in length"
    values = unpack_ids(ids)
    if values.min() < 0 or values.max() >= vocab_size:
        return f"teacher top id outside the vocabulary (size {vocab_size})"
    return check_logprobs(logprobs, k * n, "teacher top logprobs")


def check_group(group: TrajectoryGroup, vocab_size: int, max_tokens: int) -> str | None:
    """Why a decoded group cannot be trained, or None when it is well formed."""
    if not group.samples:
        return "group has no samples"
    if len(group.node_id) > MAX_NODE_ID_CHARS:
        return f"node id of {len(group.node_id)} characters (at most {MAX_NODE_ID_CHARS})"
    if len(group.samples) > 1024:
        return f"group has {len(group.samples)} samples (at most 1024)"
    for i, s in enumerate(group.samples):
        wrong = check_tokens(s, vocab_size, max_tokens)
        if wrong is not None:
            return f"sample {i}: {wrong}"
        n = len(s.completion_ids) // 4
        wrong = check_logprobs(s.logprobs, n, "logprobs")
        if wrong is None and s.teacher_logprobs:
            wrong = check_logprobs(s.teacher_logprobs, n, "teacher logprobs")
        if wrong is None and (s.teacher_top_ids or s.teacher_top_logprobs):
            wrong = check_top(s.teacher_top_ids, s.teacher_top_logprobs, n, vocab_size)
        if wrong is not None:
            return f"sample {i}: {wrong}"
        if not (np.isfinite(s.reward) and np.isfinite(s.advantage)):
            return f"sample {i}: reward and advantage must be finite"
        if s.policy_version < 0:
            return f"sample {i}: negative policy version"
    episodes = [s.episode for s in group.samples]
    if any(e < 0 for e in episodes) and any(e >= 0 for e in episodes):
        return "samples must all name their episode, or none"
    rewards: dict[int, float] = {}
    for i, s in enumerate(group.samples):
        if s.episode >= 0 and rewards.setdefault(s.episode, s.reward) != s.reward:
            return f"sample {i}: episode {s.episode} has samples with different rewards"
    return None


def claimed_node_id(msg: msgspec.Struct) -> str | None:
    """The node a request says it comes from (or whose trajectories it carries), if any:
    with keys, it must be the sender's certificate's name (agentjet/transport.py)."""
    match msg:
        case (
            Hello(node_id=node_id)
            | WorkRequest(node_id=node_id)
            | GroupReport(node_id=node_id)
            | Heartbeat(node_id=node_id)
            | TeacherScoreRequest(node_id=node_id)
        ):
            return node_id
        case SubmitGroup(group=group):
            return group.node_id
    return None


def answer_hello(hello: Hello, run_id: str, policy_version: int = 0) -> Welcome | Error:
    """The server side of the handshake: refuse peers that speak another protocol version."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return Error(
            code="version",
            message=f"protocol version {hello.protocol_version} is not supported "
            f"(this peer speaks {PROTOCOL_VERSION}); upgrade agentjet on both ends",
        )
    return Welcome(run_id=run_id, policy_version=policy_version)
