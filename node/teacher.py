"""Teachers for on-policy distillation: each environment that names one (`envs[].teacher`)
has every sample scored by it before the group leaves the rollout node.

    engine plays a group ──▶ teachers.score(group): per sample, one prefill of prompt +
                             completion through the teacher (no generation) ──▶ the
                             teacher's logprob of each sampled token (Sample.teacher_logprobs)
                             ──▶ spooled and sent with the group, as the sampler's are

The trainer turns them into a per-token advantage term (agentjet/rl.py,
`distill_advantages`). Where teachers run (`rollout.teachers`):

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
reported logprobs are off by more than `trainer.max_logprob_gap`, held against its node as
any failed check (node/verify.py). Unchecked groups' teacher signal is trusted, as a
node's reward for a task it made up would be. A rollout node trusts the teacher nodes of
its swarm (members, by certificate) as far as the shape and range of their scores, which
it checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
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

    @torch.no_grad()
    def logprobs(
        self, samples: Sequence[protocol.Sample | protocol.TeacherInput], temperature: float
    ) -> Scores:
        """Per sample, log softmax(teacher logits / temperature) of each completion token
        where its loss mask is 1, 0 elsewhere (float32, one per completion token)."""
        out: Scores = []
        for i in range(0, len(samples), SCORE_BATCH):
            out += self._batch(samples[i : i + SCORE_BATCH], temperature)
        return out

    def _batch(
        self, samples: Sequence[protocol.Sample | protocol.TeacherInput], temperature: float
    ) -> Scores:
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
            if mask.any():
                # Completion token t is predicted by the hidden state before it.
                at = torch.from_numpy(np.flatnonzero(mask) + len(prompt) - 1).to(self.device)
                logits = head(hidden[row, at]).float() / temperature
                tokens = torch.from_numpy(completion[mask].astype(np.int64)).to(self.device)
                picked = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(-1))
                scores[mask] = picked.squeeze(-1).cpu().numpy()
            result.append(scores)
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
    group: protocol.TrajectoryGroup, scores: Scores
) -> tuple[protocol.TrajectoryGroup, float]:
    """`group` with its samples' teacher logprobs, and the mean per-token reverse KL to the
    teacher, log mu - log pi_teacher over the model's tokens."""
    samples, kl_sum, tokens = [], 0.0, 0
    for sample, teacher_lp in zip(group.samples, scores, strict=True):
        mask = protocol.unpack_mask(sample.loss_mask).astype(bool)
        sampler_lp = protocol.unpack_floats(sample.logprobs)
        kl_sum += float((sampler_lp[mask] - teacher_lp[mask]).sum())
        tokens += int(mask.sum())
        samples.append(
            protocol.msgspec.structs.replace(
                sample, teacher_logprobs=protocol.pack_floats(teacher_lp.tolist())
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
        return with_scores(group, teacher.logprobs(group.samples, self.temperature))


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
    ) -> None:
        self.by_env = {env.name: env.teacher for env in envs if env.teacher}
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
    ) -> Scores | None:
        """The node's scores for `request`, or None (it did not answer, refused, or sent
        scores that are not one logprob per completion token, finite and <= 0)."""
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
        wrong = scores_problem(reply, request)
        if wrong is not None:
            log.warning("teacher node %s sent malformed scores: %s", node.node_id, wrong)
            return None
        assert isinstance(reply, protocol.TeacherScores)
        return [protocol.unpack_floats(lp).copy() for lp in reply.logprobs]


def scores_problem(reply: object, request: protocol.TeacherScoreRequest) -> str | None:
    """Why `reply` is not the scores of `request`'s samples, or None."""
    if not isinstance(reply, protocol.TeacherScores):
        return f"a {type(reply).__name__} reply"
    if len(reply.logprobs) != len(request.samples):
        return f"{len(reply.logprobs)} samples scored of {len(request.samples)}"
    for i, (data, sample) in enumerate(zip(reply.logprobs, request.samples, strict=True)):
        wrong = protocol.check_logprobs(data, len(sample.completion_ids) // 4, "scores")
        if wrong is not None:
            return f"sample {i}: {wrong}"
    return None


def open_teachers(
    config: Config,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    hello: protocol.Hello,
    keys: NodeKeys | None,
) -> LocalTeachers | TeacherNodes:
    """The teachers of a rollout node, where `rollout.teachers` says they run."""
    temperature = config.rollout.sampling.temperature
    if config.rollout.teachers == "nodes":
        timeout_s = config.rollout.teacher_timeout_s
        return TeacherNodes(config.envs, hello, config.net, keys, temperature, timeout_s)
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
            recomputed = teacher.logprobs(group.samples, self.temperature)
            gap = 0.0
            for sample, mine in zip(group.samples, recomputed, strict=True):
                mask = protocol.unpack_mask(sample.loss_mask).astype(bool)
                if mask.any():
                    theirs = protocol.unpack_floats(sample.teacher_logprobs)
                    gap = max(gap, float(np.abs(theirs[mask] - mine[mask]).mean()))
            gaps[group.group_id] = gap
        return gaps


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
