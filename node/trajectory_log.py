"""A bounded sample of a rollout node's recent groups, decoded for the trajectory viewer.

    Producer._hold ──▶ maybe_record(group, tokenizer): picked by a seeded hash of its id?
                          │ yes: decode each token alone, one JSON line
                          ▼
                       <run dir>/trajectories.jsonl ──▶ read_trajectories, find_trajectory
                          (past the cap: the newest half kept,      (the dashboard; newest
                           written beside it and renamed over it)    first, torn lines skipped)

One line per recorded group:

    {"time", "group_id", "env", "task_id", "node_id", "policy_version" (max over samples),
     "samples": [{"reward", "advantage", "episode", "policy_version", "turns", "finish_reason",
                  "error", "prompt": [[text, 0], ...],
                  "completion": [[text, loss_mask, sampler_logprob], ...]}]}

Each token's text is `tokenizer.decode([id])` with special tokens kept, so the texts of a
sample concatenate to its conversation as the policy saw it (the chat template's turns
included); in a merged timeline a model call starts wherever the mask goes from 0 to 1.

The file never holds more than `cap_bytes`: a line that would take it past the cap first
rewrites it with the newest half of its lines, within half the cap (a temp file renamed
over it, so a reader sees the old file or the new one; only an append can be torn, and
readers skip a line that does not decode). A group whose line alone is over half the cap is
skipped and counted. The log is a convenience and never stops the node: the first OSError
(disk full, run dir gone) costs one warning and ends recording for the rest of the run, not
retried, since a full disk would cost a failed write per group.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from agentjet import protocol

log = logging.getLogger(__name__)

FILE_NAME = "trajectories.jsonl"
# Digits kept of each sampler logprob: enough to read, a third of float32's text.
LOGPROB_DECIMALS = 4


class TrajectoryLog:
    """Records a share of the groups it is shown in `<run_dir>/trajectories.jsonl`.

    Which groups is a pure function of (`seed`, group id), so a restarted node picks the
    same ones and two nodes with different seeds pick different ones."""

    def __init__(self, run_dir: str | Path, share: float, cap_bytes: int, seed: int) -> None:
        self.path = Path(run_dir) / FILE_NAME
        self.share = share
        self.cap_bytes = cap_bytes
        self.seed = seed
        self.recorded = 0
        self.too_large = 0  # groups skipped: their line alone is over half the cap
        self.failed = False  # an OSError ended recording
        self._size: int | None = None  # the file's size once opened
        self._texts: TokenTexts | None = None

    def picks(self, group_id: str) -> bool:
        """Whether `group_id` is in the recorded share: its seeded 64-bit hash is below
        `share` of 2**64 (compared as integers, so share 1 picks every group)."""
        digest = hashlib.blake2b(f"{self.seed}\0{group_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") < self.share * 2**64

    def maybe_record(self, group: protocol.TrajectoryGroup, tokenizer: Any) -> bool:
        """Append `group` when it is in the share; True when it was written. Only recorded
        groups are decoded. Never raises OSError: the first one ends recording."""
        if self.failed or not self.picks(group.group_id):
            return False
        if self._texts is None or self._texts.tokenizer is not tokenizer:
            self._texts = TokenTexts(tokenizer)
        line = msgspec.json.encode(trajectory_record(group, self._texts)) + b"\n"
        if len(line) > self.cap_bytes // 2:
            if not self.too_large:
                log.warning(
                    "trajectory log: group %s is %d bytes, over half of the %d byte cap; "
                    "groups this large are not recorded (raise rollout.trajectory_log_mb)",
                    group.group_id,
                    len(line),
                    self.cap_bytes,
                )
            self.too_large += 1
            return False
        try:
            self._append(line)
        except OSError as e:
            self.failed = True
            log.warning("trajectory log %s: %s; no more trajectories are recorded", self.path, e)
            return False
        self.recorded += 1
        return True

    def _append(self, line: bytes) -> None:
        if self._size is None:
            self._size = self._open()
        if self._size + len(line) > self.cap_bytes:
            self._size = self._keep_newest()
        with self.path.open("ab") as f:
            f.write(line)
        self._size += len(line)

    def _open(self) -> int:
        """The size of the file left by an earlier run, cut back to its last whole line (a
        torn append would otherwise glue onto the next line)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            os.truncate(self.path, whole)
        return whole

    def _keep_newest(self) -> int:
        """Rewrite the file with the newest half of its lines, within half the cap, so that
        one more line of up to half the cap fits; the new size."""
        lines = self.path.read_bytes().splitlines(keepends=True)
        kept: list[bytes] = []
        size = 0
        for line in reversed(lines[len(lines) // 2 :]):
            if size + len(line) > self.cap_bytes // 2:
                break
            kept.append(line)
            size += len(line)
        fd, tmp = tempfile.mkstemp(prefix=FILE_NAME, suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.writelines(reversed(kept))
            os.chmod(tmp, self.path.stat().st_mode)  # mkstemp's 0600 would lock readers out
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size


class TokenTexts:
    """Each token's own text, as `tokenizer.decode([id])` gives it (special tokens kept, no
    clean-up of spaces: it would edit a token out of context), remembered: decoding is the
    costly part of a record, and a vocabulary's worth of texts is the most it holds."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def learn(self, arrays: list[np.ndarray]) -> None:
        """Decode, in one batched call, the tokens of `arrays` not seen yet."""
        missing = sorted({i for ids in arrays for i in ids.tolist()} - self.texts.keys())
        if missing:
            decoded = self.tokenizer.batch_decode(
                [[i] for i in missing],
                skip_special_tokens=False,
                clean_up_tokenization_spaces=False,
            )
            self.texts.update(zip(missing, decoded, strict=True))

    def __call__(self, ids: np.ndarray) -> list[str]:
        return [self.texts[i] for i in ids.tolist()]


def trajectory_record(group: protocol.TrajectoryGroup, texts: TokenTexts) -> dict[str, Any]:
    """One line of the log: `group` with every sample's tokens decoded one by one."""
    texts.learn(
        [
            protocol.unpack_ids(ids)
            for s in group.samples
            for ids in (s.prompt_ids, s.completion_ids)
        ]
    )
    return {
        "time": group.created_at,
        "group_id": group.group_id,
        "env": group.env,
        "task_id": group.task_id,
        "node_id": group.node_id,
        "policy_version": max((s.policy_version for s in group.samples), default=0),
        "samples": [_sample_record(s, texts) for s in group.samples],
    }


def _sample_record(sample: protocol.Sample, texts: TokenTexts) -> dict[str, Any]:
    prompt = texts(protocol.unpack_ids(sample.prompt_ids))
    completion = texts(protocol.unpack_ids(sample.completion_ids))
    mask = protocol.unpack_mask(sample.loss_mask).tolist()
    logprobs = np.round(
        protocol.unpack_floats(sample.logprobs).astype(np.float64), LOGPROB_DECIMALS
    )
    return {
        "reward": sample.reward,
        "advantage": sample.advantage,
        "episode": sample.episode,
        "policy_version": sample.policy_version,
        "turns": sample.turns,
        "finish_reason": sample.finish_reason,
        "error": sample.error,
        "prompt": [[text, 0] for text in prompt],
        "completion": [list(t) for t in zip(completion, mask, logprobs.tolist(), strict=True)],
    }


def read_trajectories(
    path: str | Path, env: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    """The newest `limit` groups of the log at `path` (of environment `env`, when given),
    newest first; lines that do not decode (a torn append) are skipped, a missing file is
    no groups."""
    found: list[dict[str, Any]] = []
    for record in _newest_first(path):
        if env is None or record.get("env") == env:
            found.append(record)
            if len(found) >= limit:
                break
    return found


def find_trajectory(path: str | Path, group_id: str) -> dict[str, Any] | None:
    """The newest record of `group_id` in the log at `path`, or None."""
    needle = msgspec.json.encode(group_id)
    for record in _newest_first(path, needle):
        if record.get("group_id") == group_id:
            return record
    return None


def _newest_first(path: str | Path, needle: bytes = b"") -> Iterator[dict[str, Any]]:
    """The log's records newest first, decoding only lines that contain `needle` and only
    as far as the caller reads."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        return
    for line in reversed(lines):
        if needle not in line:
            continue
        try:
            record = msgspec.json.decode(line)
        except msgspec.DecodeError:
            continue
        if isinstance(record, dict):
            yield record
