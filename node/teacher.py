"""Teachers for on-policy distillation: each environment that names one (`envs[].teacher`)
has every sample scored by it before the group leaves the rollout node.

    engine plays a group ──▶ teachers.score(group): per sample, one prefill of prompt +
                             completion through the teacher (no generation) ──▶ the
                             teacher's logprob of each sampled token (Sample.teacher_logprobs)
                             and, with envs[].teacher_top_k = k, its k likeliest tokens and
                             their logprobs at each (Sample.teacher_top_ids / _logprobs)
                             ──▶ spooled and sent with the group, as the sampler's are

The trainer turns them into a per-token advantage term (agentjet/rl.py,
`distill_advantages`), or with a top k into a cross-entropy to the teacher's top k at each
trained position (`topk_distill_loss`). Where teachers run (`rollout.teachers`):

- "local" (`LocalTeachers`): in the rollout node, loaded once however many environments
  name them, in the engine's dtype on its device (memory: one more model each; prefill
  only, so no KV cache outlives a call). Scoring crosses the one bridge to blocking work
  (agentjet/bridge.py), between the batch that played the group and the next.
- "nodes" (`TeacherNodes`): on `agentjet node --role teacher` nodes (node/teacher_node.py)
  that the swarm's directory lists with the teachers they serve, called over ZMQ (CURVE,
  like every socket): the least loaded node serving the group's teacher first. A group
  waits in the node, held in memory, until a teacher node answers for it (none listed,
  none answering: a warning, and again every RETRY_S); a node that answers malformed
  scores is passed over. The rollout node plays no new batch meanwhile.

A teacher must share the model's tokenizer: the student's token ids are its input, so a
teacher with another vocabulary is refused at start, in one line. Logprobs are of
softmax(logits / temperature), the quantity the sampler's are: for a teacher with the
student's weights they are the sampler's, and the KL is zero.

What the trainer trusts: the teacher logprobs a rollout node sends are checked for shape
and range (agentjet/protocol.py `check_group`); with `trainer.teacher_check_fraction` > 0
the trainer also recomputes them for that share of groups with its own copy of the teacher
(`TeacherCheck`, in the learner's thread before the step) and rejects a group whose
reported logprobs (of the sampled tokens, and of the top-k tokens it names) are off by more
than `trainer.max_logprob_gap`, held against its node as any failed check
(node/verify.py). That checks the top k's values, not that its tokens are the teacher's
likeliest: a node naming other tokens, with their true logprobs, teaches less, not wrong.
Unchecked groups' teacher signal is trusted, as a node's reward for a task it made up would
be. A rollout node trusts the teacher nodes of its swarm (members, by certificate) as far as
the shape and range of their scores, which it checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import Config, EnvConfig, ModelConfig, NetConfig
from agentjet.devices import resolve_dtype
from agentjet.errors import ModelError, ProtocolError
from agentjet.identity import NodeKeys
from agentjet.transport import Client, PeerUnavailable
from node.model import load_causal_lm, resolve_model
from node.verify import picked_for_reward_check

log = logging.getLogger(__name__)

# Sequences per teacher forward: bounds the activations of one prefill.
SCORE_BATCH = 8

# Per sample, a teacher's logprob of each completion token.
Scores = list[np.ndarray[Any, np.dtype[np.float32]]]


@dataclass(frozen=True)
class Score:
    """A teacher's scores of one sample of n completion tokens: its logprob of each
    ([n]), and with a top k its k likeliest tokens and their logprobs at each ([n, k]; None
    without). 0 where the loss mask is 0."""

    logprobs: np.ndarray[Any, np.dtype[np.float32]]
    top_ids: np.ndarray[Any, np.dtype[np.int32]] | None = None
    top_logprobs: np.ndarray[Any, np.dtype[np.float32]] | None = None


def teacher_path(name: str, model: ModelConfig) -> Path:
    """A teacher's folder: a folder with config.json as it is (a model or a checkpoint of
    this project), else the name resolved as the model's is (embedded, HF cache)."""
    local = Path(name).expanduser()
    if (local / "config.json").is_file():
        return local
    return resolve_model(name, model.cache_dir)


class Teacher:
    """One teacher model, scoring sampled tokens (prefill only)."""

    def __init__(self, name: str, path: Path, dtype: str, device: torch.device) -> None:
        self.name = name
        model, self.tokenizer = load_causal_lm(path, dtype)
        torch.nn.Module.to(model, device)  # in place (transformers mistypes `to`)
        self.model = model
        self.device = device
        self._pad_id = int(self.tokenizer.pad_token_id or 0)

    def logprobs(
        self, samples: Sequence[protocol.Sample | protocol.TeacherInput], temperature: float
    ) -> Scores:
        """Per sample, log softmax(teacher logits / temperature) of each completion token
        where its loss mask is 1, 0 elsewhere (float32, one per completion token)."""
        return [score.logprobs for score in self.scores(samples, temperature)]

    @torch.no_grad()
    def scores(
        self,
        samples: Sequence[protocol.Sample | protocol.TeacherInput],
        temperature: float,
        top_k: int = 0,
        at: Sequence[np.ndarray] | None = None,
    ) -> list[Score]:
        """Per sample, `logprobs`, and with `top_k` > 0 the `top_k` likeliest tokens of
        log softmax(teacher logits / temperature) at each completion token where its loss
        mask is 1, with their logprobs (0 elsewhere). `at`, per sample, [n, k] tokens
        instead of the top k: the logprobs of those (the trainer's check of a top k)."""
        out: list[Score] = []
        for i in range(0, len(samples), SCORE_BATCH):
            some = at[i : i + SCORE_BATCH] if at is not None else None
            out += self._batch(samples[i : i + SCORE_BATCH], temperature, top_k, some)
        return out

    def _batch(
        self,
        samples: Sequence[protocol.Sample | protocol.TeacherInput],
        temperature: float,
        top_k: int,
        at: Sequence[np.ndarray] | None,
    ) -> list[Score]:
        seqs = [
            (protocol.unpack_ids(s.prompt_ids), protocol.unpack_ids(s.completion_ids))
            for s in samples
        ]
        width = max(len(p) + len(c) for p, c in seqs)
        ids = torch.full((len(seqs), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, (prompt, completion) in enumerate(seqs):
            n = len(prompt) + len(completion)
            ids[row, :n] = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))
            attention[row, :n] = 1
        hidden = self.model.get_decoder()(
            input_ids=ids.to(self.device), attention_mask=attention.to(self.device)
        ).last_hidden_state
        head = self.model.get_output_embeddings()
        result = []
        for row, ((prompt, completion), sample) in enumerate(zip(seqs, samples, strict=True)):
            mask = protocol.unpack_mask(sample.loss_mask).astype(bool)
            scores = np.zeros(len(completion), dtype=np.float32)
            top_ids: np.ndarray | None = None
            top_logprobs: np.ndarray | None = None
            if at is not None:
                top_ids = at[row].astype(np.int32)
                top_logprobs = np.zeros(top_ids.shape, dtype=np.float32)
            elif top_k:
                top_ids = np.zeros((len(completion), top_k), dtype=np.int32)
                top_logprobs = np.zeros((len(completion), top_k), dtype=np.float32)
            if mask.any():
                # Completion token t is predicted by the hidden state before it.
                where = torch.from_numpy(np.flatnonzero(mask) + len(prompt) - 1)
                logits = head(hidden[row, where.to(self.device)]).float() / temperature
                tokens = torch.from_numpy(completion[mask].astype(np.int64)).to(self.device)
                all_logprobs = torch.log_softmax(logits, dim=-1)
                picked = all_logprobs.gather(1, tokens.unsqueeze(-1))
                scores[mask] = picked.squeeze(-1).cpu().numpy()
                if top_ids is not None and top_logprobs is not None:
                    if at is not None:
                        ids = torch.from_numpy(top_ids[mask].astype(np.int64)).to(self.device)
                        values = all_logprobs.gather(1, ids)
                    else:
                        values, ids = all_logprobs.topk(top_k, dim=-1)
                        top_ids[mask] = ids.cpu().numpy()
                    top_logprobs[mask] = values.cpu().numpy()
            result.append(Score(scores, top_ids, top_logprobs))
        return result


# A group no teacher node answered for is asked for again this often (the directory may
# name a new node meanwhile).
RETRY_S = 2.0


def load_teachers(
    names: Iterable[str],
    model: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
) -> dict[str, Teacher]:
    """Each named teacher, loaded once per folder in the model's dtype on `device`; every
    one must share `tokenizer` (the model's)."""
    dtype = resolve_dtype(model.dtype, device)
    loaded: dict[Path, Teacher] = {}
    by_name: dict[str, Teacher] = {}
    for name in names:
        path = teacher_path(name, model)
        if path not in loaded:
            log.info("teacher %s: loading %s", name, path)
            teacher = Teacher(name, path, dtype, device)
            if teacher.tokenizer.get_vocab() != tokenizer.get_vocab():
                raise ModelError(
                    f"teacher {name!r} has a tokenizer other than the model's: it cannot "
                    "score the model's tokens"
                )
            loaded[path] = teacher
        by_name[name] = loaded[path]
    return by_name


def with_scores(
    group: protocol.TrajectoryGroup, scores: list[Score]
) -> tuple[protocol.TrajectoryGroup, float]:
    """`group` with its samples' teacher scores, and the mean per-token reverse KL to the
    teacher, log mu - log pi_teacher over the model's tokens."""
    samples, kl_sum, tokens = [], 0.0, 0
    for sample, score in zip(group.samples, scores, strict=True):
        mask = protocol.unpack_mask(sample.loss_mask).astype(bool)
        sampler_lp = protocol.unpack_floats(sample.logprobs)
        kl_sum += float((sampler_lp[mask] - score.logprobs[mask]).sum())
        tokens += int(mask.sum())
        top = {}
        if score.top_ids is not None and score.top_logprobs is not None:
            top = {
                "teacher_top_ids": protocol.pack_ids(score.top_ids),
                "teacher_top_logprobs": protocol.pack_floats(score.top_logprobs),
            }
        samples.append(
            protocol.msgspec.structs.replace(
                sample, teacher_logprobs=protocol.pack_floats(score.logprobs), **top
            )
        )
    kl = kl_sum / max(tokens, 1)
    return protocol.msgspec.structs.replace(group, samples=samples), kl


class LocalTeachers:
    """The teachers of a rollout node's environments, in the node (rollout.teachers="local")."""

    def __init__(
        self,
        envs: list[EnvConfig],
        model: ModelConfig,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        temperature: float,
    ) -> None:
        """`tokenizer`: the model's, which every teacher must share."""
        self.temperature = temperature
        named = {env.name: env.teacher for env in envs if env.teacher}
        teachers = load_teachers(named.values(), model, tokenizer, device)
        self.by_env = {env: teachers[name] for env, name in named.items()}
        self.top_k = {env.name: env.teacher_top_k for env in envs if env.teacher}
        self.envs = set(self.by_env)
        self.held = 0  # groups that waited for a teacher: never, here

    def update(self, records: list[protocol.NodeRecord]) -> None:
        """Nothing to learn from the directory."""

    def close(self) -> None:
        """Nothing to close: the teachers go with the process."""

    async def score(
        self, group: protocol.TrajectoryGroup
    ) -> tuple[protocol.TrajectoryGroup, float]:
        """`group` with its samples' teacher logprobs (as it is when its environment has no
        teacher), and the mean per-token reverse KL to the teacher (0.0 without one)."""
        return await blocking(self.score_now, group)

    async def score_all(
        self, groups: list[protocol.TrajectoryGroup]
    ) -> list[tuple[protocol.TrajectoryGroup, float]]:
        """`score` for each group, one after another (they share the box's teachers)."""
        return [await self.score(group) for group in groups]

    def score_now(self, group: protocol.TrajectoryGroup) -> tuple[protocol.TrajectoryGroup, float]:
        """`score`, blocking (across the bridge)."""
        teacher = self.by_env.get(group.env)
        if teacher is None:
            return group, 0.0
        top_k = self.top_k[group.env]
        return with_scores(group, teacher.scores(group.samples, self.temperature, top_k))


class TeacherNodes:
    """The teachers of a rollout node's environments, on the swarm's teacher nodes
    (rollout.teachers="nodes")."""

    def __init__(
        self,
        envs: list[EnvConfig],
        hello: protocol.Hello,
        net: NetConfig,
        keys: NodeKeys | None,
        temperature: float,
        timeout_s: float,
        vocab_size: int,
    ) -> None:
        """`vocab_size`: the model's, which a teacher's top-k tokens must be within."""
        self.by_env = {env.name: env.teacher for env in envs if env.teacher}
        self.top_k = {env.name: env.teacher_top_k for env in envs if env.teacher}
        self.vocab_size = vocab_size
        self.envs = set(self.by_env)
        self.hello, self.net, self.keys = hello, net, keys
        self.temperature, self.timeout_s = temperature, timeout_s
        self.nodes: list[protocol.NodeRecord] = []  # teacher nodes, from the last directory read
        self.clients: dict[str, Client] = {}  # by endpoint
        self.asking: Counter[str] = Counter()  # requests in flight, by endpoint
        self.held = 0  # groups that waited for a teacher node to answer
        self.turn = 0  # rotates equally loaded nodes

    def update(self, records: list[protocol.NodeRecord]) -> None:
        """The teacher nodes of a directory read (clients of those gone are closed, but for
        one asked now: a read can miss a live node's record, and closing a socket cancels
        the request waiting on it)."""
        self.nodes = [r for r in records if r.role == "teacher" and r.endpoint]
        listed = {r.endpoint for r in self.nodes} | {e for e, n in self.asking.items() if n}
        for endpoint in [e for e in self.clients if e not in listed]:
            self.clients.pop(endpoint).close()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()

    async def score_all(
        self, groups: list[protocol.TrajectoryGroup]
    ) -> list[tuple[protocol.TrajectoryGroup, float]]:
        """`score` for each group, all at once: each asks its own least loaded node, so a
        batch's groups are scored on several teacher nodes side by side (one node's client
        takes one request at a time)."""
        return list(await asyncio.gather(*(self.score(group) for group in groups)))

    async def score(
        self, group: protocol.TrajectoryGroup
    ) -> tuple[protocol.TrajectoryGroup, float]:
        """As `LocalTeachers.score`; waits until a teacher node serving the group's teacher
        answers with well-formed scores, however long that takes."""
        name = self.by_env.get(group.env)
        if name is None:
            return group, 0.0
        request = protocol.TeacherScoreRequest(
            node_id=self.hello.node_id,
            teacher=name,
            temperature=self.temperature,
            samples=[
                protocol.TeacherInput(
                    prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, loss_mask=s.loss_mask
                )
                for s in group.samples
            ],
            top_k=self.top_k[group.env],
        )
        waiting_since: float | None = None
        while True:
            nodes = self._serving(name)
            for node in nodes:
                scores = await self._ask(node, request)
                if scores is not None:
                    if waiting_since is not None:
                        log.info(
                            "teacher %s on %s scored group %s, held %.0f s",
                            name,
                            node.node_id,
                            group.group_id,
                            time.monotonic() - waiting_since,
                        )
                    return with_scores(group, scores)
            if waiting_since is None:
                waiting_since = time.monotonic()
                self.held += 1
                log.warning(
                    "no teacher node answers for teacher %s (%d listed): group %s is held "
                    "until one does",
                    name,
                    len(nodes),
                    group.group_id,
                )
            await asyncio.sleep(RETRY_S)  # a retry's pause: the directory is read meanwhile

    def _serving(self, name: str) -> list[protocol.NodeRecord]:
        """The nodes serving teacher `name`, least loaded first (equals in turn): the queue
        their last heartbeat reported plus this node's requests in flight to them since."""
        nodes = [n for n in self.nodes if name in n.teachers]
        self.turn += 1
        return sorted(
            nodes,
            key=lambda n: (n.queue + self.asking[n.endpoint], hash((n.node_id, self.turn))),
        )

    async def _ask(
        self, node: protocol.NodeRecord, request: protocol.TeacherScoreRequest
    ) -> list[Score] | None:
        """The node's scores for `request`, or None (it did not answer, refused, or sent
        scores that are not one logprob per completion token, finite and <= 0, with the top
        k asked for)."""
        client = self.clients.get(node.endpoint)
        if client is None:
            client = self.clients[node.endpoint] = Client(
                node.endpoint,
                protocol.teacher_reply_decoder,
                self.hello,
                self.net.max_message_bytes,
                self.timeout_s,
                self.keys,
            )
        self.asking[node.endpoint] += 1
        try:
            reply = await client.request(request)
        except PeerUnavailable:
            return None
        except ProtocolError as e:  # another protocol version, or not this swarm's member
            log.warning("teacher node %s: %s", node.node_id, e)
            return None
        finally:
            self.asking[node.endpoint] -= 1
        if isinstance(reply, protocol.Error):
            log.warning("teacher node %s refused to score: %s", node.node_id, reply.message)
            return None
        wrong = scores_problem(reply, request, self.vocab_size)
        if wrong is not None:
            log.warning("teacher node %s sent malformed scores: %s", node.node_id, wrong)
            return None
        assert isinstance(reply, protocol.TeacherScores)
        return received_scores(reply, request)


def received_scores(
    reply: protocol.TeacherScores, request: protocol.TeacherScoreRequest
) -> list[Score]:
    """A well-formed reply (`scores_problem`) as each sample's `Score`."""
    scores = []
    for i, (data, sample) in enumerate(zip(reply.logprobs, request.samples, strict=True)):
        logprobs = protocol.unpack_floats(data).copy()
        if not request.top_k:
            scores.append(Score(logprobs))
            continue
        shape = (len(sample.completion_ids) // 4, request.top_k)
        ids = protocol.unpack_ids(reply.top_ids[i]).reshape(shape).copy()
        values = protocol.unpack_floats(reply.top_logprobs[i]).reshape(shape).copy()
        scores.append(Score(logprobs, ids, values))
    return scores


def scores_problem(
    reply: object, request: protocol.TeacherScoreRequest, vocab_size: int
) -> str | None:
    """Why `reply` is not the scores of `request`'s samples (with the top k it asked for,
    within a vocabulary of `vocab_size`), or None."""
    if not isinstance(reply, protocol.TeacherScores):
        return f"a {type(reply).__name__} reply"
    if len(reply.logprobs) != len(request.samples):
        return f"{len(reply.logprobs)} samples scored of {len(request.samples)}"
    tops = len(reply.top_ids), len(reply.top_logprobs)
    if tops != ((len(request.samples),) * 2 if request.top_k else (0, 0)):
        return f"top k of {tops[0]} and {tops[1]} samples for a top {request.top_k} request"
    for i, (data, sample) in enumerate(zip(reply.logprobs, request.samples, strict=True)):
        n = len(sample.completion_ids) // 4
        wrong = protocol.check_logprobs(data, n, "scores")
        if wrong is None and request.top_k:
            ids, values = reply.top_ids[i], reply.top_logprobs[i]
            wrong = protocol.check_top(ids, values, n, vocab_size)
            if wrong is None and protocol.top_k_of(ids, n) != request.top_k:
                wrong = f"a top {protocol.top_k_of(ids, n)} for a top {request.top_k} request"
        if wrong is not None:
            return f"sample {i}: {wrong}"
    return None


def open_teachers(
    config: Config,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    hello: protocol.Hello,
    keys: NodeKeys | None,
    vocab_size: int,
) -> LocalTeachers | TeacherNodes:
    """The teachers of a rollout node, where `rollout.teachers` says they run (`vocab_size`:
    the model's)."""
    temperature = config.rollout.sampling.temperature
    if config.rollout.teachers == "nodes":
        timeout_s = config.rollout.teacher_timeout_s
        return TeacherNodes(
            config.envs, hello, config.net, keys, temperature, timeout_s, vocab_size
        )
    return LocalTeachers(config.envs, config.model, tokenizer, device, temperature)


class TeacherCheck:
    """The trainer's re-scoring of teacher logprobs (`trainer.teacher_check_fraction`): for a
    share of the groups whose environment has a teacher here, the teacher's own logprobs of
    the trained tokens, against those the rollout node reported."""

    def __init__(
        self, by_env: dict[str, Teacher], fraction: float, secret: bytes, temperature: float
    ) -> None:
        self.by_env = by_env
        self.fraction = fraction
        self.secret = secret
        self.temperature = temperature

    def gaps(self, groups: Iterable[protocol.TrajectoryGroup]) -> dict[str, float]:
        """Per checked group, its largest sample's mean |reported - recomputed| teacher
        logprob over the trained tokens (a group that should carry teacher logprobs and
        does not: infinite). Blocking: the learner's thread."""
        gaps: dict[str, float] = {}
        for group in groups:
            teacher = self.by_env.get(group.env)
            if teacher is None or not picked_for_reward_check(
                group.group_id, self.fraction, self.secret
            ):
                continue
            if not all(s.teacher_logprobs for s in group.samples):
                gaps[group.group_id] = float("inf")
                continue
            gaps[group.group_id] = self._gap(teacher, group.samples)
        return gaps

    def _gap(self, teacher: Teacher, samples: list[protocol.Sample]) -> float:
        """The largest sample's mean |reported - recomputed| teacher logprob, of its
        sampled tokens and of the top-k tokens it names (every sample names a top k or
        none: otherwise the reported top k is malformed, and the gap infinite)."""
        tops = [protocol.top_k_of(s.teacher_top_ids, len(s.loss_mask)) for s in samples]
        if any(tops) and not all(tops):
            return float("inf")
        at = None
        if all(tops):
            at = [
                protocol.unpack_ids(s.teacher_top_ids).reshape(len(s.loss_mask), k)
                for s, k in zip(samples, tops, strict=True)
            ]
            if max(int(ids.max()) for ids in at) >= teacher.model.config.vocab_size:
                return float("inf")  # within the student's vocabulary, not this teacher's
        gap = 0.0
        recomputed = teacher.scores(samples, self.temperature, at=at)
        for sample, mine in zip(samples, recomputed, strict=True):
            mask = protocol.unpack_mask(sample.loss_mask).astype(bool)
            if not mask.any():
                continue
            theirs = protocol.unpack_floats(sample.teacher_logprobs)
            gap = max(gap, float(np.abs(theirs[mask] - mine.logprobs[mask]).mean()))
            if mine.top_logprobs is not None:
                k = mine.top_logprobs.shape[1]
                top = protocol.unpack_floats(sample.teacher_top_logprobs).reshape(-1, k)
                gap = max(gap, float(np.abs(top[mask] - mine.top_logprobs[mask]).mean()))
        return gap


def open_teacher_check(
    config: Config,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    secret: bytes,
) -> TeacherCheck | None:
    """The trainer's teacher check, with the teachers loaded on `device`, or None when it
    is off (or no environment names a teacher)."""
    fraction = config.trainer.teacher_check_fraction
    named = {env.name: env.teacher for env in config.envs if env.teacher}
    if not fraction or not named:
        return None
    teachers = load_teachers(named.values(), config.model, tokenizer, device)
    by_env = {env: teachers[name] for env, name in named.items()}
    return TeacherCheck(by_env, fraction, secret, config.rollout.sampling.temperature)
