"""Teachers for on-policy distillation: each environment that names one (`envs[].teacher`)
has every sample scored by it before the group leaves the rollout node.

    engine plays a group ──▶ Teachers.score(group): per sample, one prefill of prompt +
                             completion through the teacher (no generation) ──▶ the
                             teacher's logprob of each sampled token (Sample.teacher_logprobs)
                             ──▶ spooled and sent with the group, as the sampler's are

The trainer turns them into a per-token advantage term (agentjet/rl.py,
`distill_advantages`). A teacher is loaded once however many environments name it, in the
engine's dtype on its device, next to the engine (memory: one more model; it serves prefill
only, so no KV cache outlives a call). It must share the model's tokenizer: the student's
token ids are its input, so a teacher with another vocabulary is refused at start, in one
line. Logprobs are of softmax(logits / temperature), the quantity the sampler's are: for a
teacher with the student's weights they are the sampler's, and the KL is zero.

What the trainer trusts: the teacher logprobs a rollout node sends are checked for shape
and range (agentjet/protocol.py `check_group`), not recomputed — as a node could send any
reward for a task it made up, it could send any teacher signal; quarantine (node/verify.py)
still catches a node whose sampler logprobs or rewards are wrong.

Scoring runs across the one bridge to blocking work (agentjet/bridge.py), between the
batch that played the group and the next; a node with a teacher spends its prefill time
there (bench/LOG.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from agentjet import protocol
from agentjet.config import EnvConfig, ModelConfig
from agentjet.devices import resolve_dtype
from agentjet.errors import ModelError
from node.model import load_causal_lm, resolve_model

log = logging.getLogger(__name__)

# Sequences per teacher forward: bounds the activations of one prefill.
SCORE_BATCH = 8


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
        self, samples: list[protocol.Sample], temperature: float
    ) -> list[np.ndarray[Any, np.dtype[np.float32]]]:
        """Per sample, log softmax(teacher logits / temperature) of each completion token
        where its loss mask is 1, 0 elsewhere (float32, one per completion token)."""
        out: list[np.ndarray[Any, np.dtype[np.float32]]] = []
        for i in range(0, len(samples), SCORE_BATCH):
            out += self._batch(samples[i : i + SCORE_BATCH], temperature)
        return out

    def _batch(
        self, samples: list[protocol.Sample], temperature: float
    ) -> list[np.ndarray[Any, np.dtype[np.float32]]]:
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


class Teachers:
    """The teachers of a rollout node's environments, each loaded once."""

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
        dtype = resolve_dtype(model.dtype, device)
        loaded: dict[Path, Teacher] = {}
        self.by_env: dict[str, Teacher] = {}
        for env in (e for e in envs if e.teacher):
            path = teacher_path(env.teacher, model)
            if path not in loaded:
                log.info("teacher %s for %s: loading %s", env.teacher, env.name, path)
                teacher = Teacher(env.teacher, path, dtype, device)
                if teacher.tokenizer.get_vocab() != tokenizer.get_vocab():
                    raise ModelError(
                        f"envs teacher {env.teacher!r} (of {env.name}) has a tokenizer other "
                        "than the model's: it cannot score the model's tokens"
                    )
                loaded[path] = teacher
            self.by_env[env.name] = loaded[path]

    def score(self, group: protocol.TrajectoryGroup) -> tuple[protocol.TrajectoryGroup, float]:
        """`group` with its samples' teacher logprobs (as it is when its environment has no
        teacher), and the mean per-token reverse KL to the teacher, log mu - log pi_teacher
        over the model's tokens (0.0 without a teacher). Blocking: across the bridge."""
        teacher = self.by_env.get(group.env)
        if teacher is None:
            return group, 0.0
        scores = teacher.logprobs(group.samples, self.temperature)
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
