"""One policy-gradient step over a batch of trajectory groups.

    groups ──advantages (recomputed from rewards)──▶ samples with A != 0
           ──micro-batches──▶ forward: log pi_theta(completion tokens) ──▶ rl.policy_loss
           ──backward (grads accumulate)──▶ clip ──▶ optimizer.step_outcome ──▶ new policy version

The optimizer is a `StepOptimizer`: a trainer's is the swarm's (node/swarm.py
`SwarmOptimizer`, hivemind underneath); `LocalOptimizer` (node/local_optimizer.py) is its
in-process twin for a lone trainer, which the unit tests step with.

Samples with zero advantage contribute exactly zero gradient, so they are counted but
never forwarded: on arithmetic, where most groups are all-right or all-wrong, this is
most of the batch. Advantages are recomputed here from the rewards rather than trusted
from the wire.

The forward pass also checks the sampler logprobs a rollout node reported (`trainer.
max_logprob_gap`): a group whose mean log pi_theta - log mu over its checked samples' trained
tokens is further from 0 than the bound is rejected whole (`rl.logprob_gap`: made-up
logprobs, altered tokens, another model).
The check costs nothing extra in the honest case; when a group fails, its gradients are
already summed into `.grad` with the others', so the pass is thrown away and run again
without it. Samples with zero advantage are not forwarded, so not checked: they cannot move
the weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from agentjet import rl
from agentjet.config import EnvConfig, TrainerConfig
from agentjet.devices import out_of_memory
from agentjet.protocol import TrajectoryGroup, top_k_of, unpack_floats, unpack_ids, unpack_mask
from node.model import with_cache
from node.rounds import StepOutcome
from node.teacher import TeacherCheck
from node.verify import over_gap


@dataclass
class _Row:
    group_id: str
    prompt: torch.Tensor
    completion: torch.Tensor
    sampler_logprobs: torch.Tensor
    mask: torch.Tensor
    advantage: float
    # On-policy distillation: the teacher's logprobs and their weight (0: no teacher).
    teacher_logprobs: torch.Tensor | None = None
    teacher_coef: float = 0.0
    # With a teacher's top k (envs[].teacher_top_k): its top ids and logprobs, [T, k].
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None


@dataclass
class _Forward:
    """A micro-batch's forward pass: the learner's logprobs, the sampler's, the loss mask
    (all [B, T]), the advantages ([B], or [B, T] with a sampled-token teacher term), and with
    a teacher's top k the summed `rl.topk_distill_loss` and its KL metric."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    topk_loss: torch.Tensor | None = None
    topk_kl: float = 0.0


@dataclass
class _Pass:
    """What one forward/backward pass over a batch's rows added up to."""

    loss: float
    stats: dict[str, float]  # rl.policy_loss's statistics, averaged over micro-batches
    differences: list[float]  # per row: rl.logprob_differences
    num_tokens: int
    topk_kl: float | None = None  # mean over micro-batches with a teacher's top k


@dataclass(frozen=True)
class StepResult:
    """What `Learner.train_step` did: the optimizer step's outcome, the groups left out for
    their logprob gap, each checked group's gap (rl.logprob_gap), and the step's
    metrics (losses/, charts/, perf/)."""

    outcome: StepOutcome
    rejected: set[str]  # left out for their logprob gap, or their teacher logprobs'
    logprob_gaps: dict[str, float]
    metrics: dict[str, float]
    # Replays left out for their logprob gap (no mark against their node: node/replay.py).
    replays_dropped: set[str] = field(default_factory=set)
    # Groups whose teacher logprobs the trainer recomputed, each with its gap (those over
    # trainer.max_logprob_gap are in `rejected`, not in `logprob_gaps`).
    teacher_gaps: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The step's metrics row (metrics/trainer.jsonl)."""
        return {
            "policy_version": self.outcome.epoch,
            "optimizer_stepped": self.outcome.applied,
            "optimizer_discarded": self.outcome.discarded,
            "version_withheld": self.outcome.withheld,
            "peer_batch_ids": list(self.outcome.peer_batches),
            "batch_in_doubt": self.outcome.in_doubt,
            "rejected_group_ids": sorted(self.rejected),
            "logprob_gaps": self.logprob_gaps,
            **self.metrics,
        }


class StepOptimizer(Protocol):
    """What the learner needs of its optimizer: it names a batch's groups, then hands over
    the `.grad`s the batch accumulated, and reads the policy version the weights are at."""

    @property
    def epoch(self) -> int:
        """The policy version of the current weights."""
        ...

    @property
    def state_loads(self) -> int:
        """How often the weights were replaced by a state downloaded from a peer."""
        ...

    def training(self) -> AbstractContextManager[object]:
        """Held while the learner's forward and backward passes run: the model holds the
        weights the gradients are for (the policy version's, but for `LocalSteps`)."""
        ...

    def name_groups(self, group_ids: Iterable[str]) -> str:
        """Name the groups the next `step_outcome` trains; the id of the batch that holds
        them."""
        ...

    def step_outcome(self, batch_size: int, lr: float | None = None) -> StepOutcome:
        """Step on the `.grad`s of `batch_size` samples (once the epoch's samples are in),
        at learning rate `lr` (None: as the last step), and clear them; what became of
        them."""
        ...


def scheduled_lr(config: TrainerConfig, version: int) -> float:
    """The learning rate of the step from policy `version` (trainer.lr_decay_versions):
    linear from `lr` at version 0 to `lr_end` at `lr_decay_versions`, then `lr_end`. A
    function of the version alone, so every trainer of a swarm steps at the same rate."""
    if not config.lr_decay_versions:
        return config.lr
    done = min(version / config.lr_decay_versions, 1.0)
    return config.lr + (config.lr_end - config.lr) * done


def set_lr(optimizer: torch.optim.Optimizer, lr: float | None) -> None:
    """Set every param group of `optimizer` to learning rate `lr` (None: leave it)."""
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr


class Learner:
    def __init__(
        self,
        model: Any,
        optimizer: StepOptimizer,
        config: TrainerConfig,
        temperature: float,
        pad_token_id: int,
        compute_dtype: torch.dtype = torch.float32,
        teacher_coefs: dict[str, float] | None = None,
        teacher_check: TeacherCheck | None = None,
    ) -> None:
        """`model` holds float32 weights on the learner's device; forward passes run in
        `compute_dtype` there (autocast when it is not float32). `teacher_coefs`: the
        environments with a teacher, each with its `teacher_coef` (`teacher_coefs`).
        `teacher_check`: re-scores a share of fresh groups' teacher logprobs before the step
        (trainer.teacher_check_fraction)."""
        self.model = model
        self.device: torch.device = next(model.parameters()).device
        self.compute_dtype = compute_dtype
        self.optimizer = optimizer
        self.config = config
        # The sampler's logprobs are of softmax(logits / T); ours must be the same quantity.
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.teacher_coefs = teacher_coefs or {}
        self.teacher_check = teacher_check

    def train_step(
        self,
        groups: list[TrajectoryGroup],
        count_at_least: int = 0,
        replays: list[TrajectoryGroup] | None = None,
    ) -> StepResult:
        """Accumulate gradients over `groups` and `replays` (groups trained before, again:
        node/replay.py), less those that fail the logprob check, and step the
        optimizer. `count_at_least`: the samples the batch counts for toward the optimizer's
        target at least (a short step under dynamic sampling counts as full)."""
        start = time.perf_counter()
        replays = replays or []
        replay_ids = {g.group_id for g in replays}
        # Replays were checked when fresh: their teacher logprobs have not changed since.
        teacher_gaps = self.teacher_check.gaps(groups) if self.teacher_check else {}
        teacher_over = over_gap(teacher_gaps, self.config.max_logprob_gap)
        groups = [g for g in groups if g.group_id not in teacher_over]
        rows = self._rows(groups + replays)
        with self.optimizer.training():  # the weights to train are in the model
            done = self._accumulate_or_explain(rows)
            gap_of = self._group_gaps(rows, done.differences)
            over = over_gap(gap_of, self.config.max_logprob_gap)
            if over:
                # Their gradients are in `.grad` with the others': start again without them
                # (same weights, so the rest passes again).
                self.model.zero_grad(set_to_none=True)
                rows = [r for r in rows if r.group_id not in over]
                done = self._accumulate_or_explain(rows)
                groups = [g for g in groups if g.group_id not in over]
                replays = [g for g in replays if g.group_id not in over]
        rejected = (over - replay_ids) | teacher_over
        grad_norm = self._clip_gradients(rows)
        lr = scheduled_lr(self.config, self.optimizer.epoch)
        # Without a schedule the optimizer keeps the rate it was made with (a trainer's is
        # trainer.lr).
        step_lr = lr if self.config.lr_decay_versions else None
        outcome = self._step_optimizer(groups, replays, len(rows), count_at_least, step_lr)
        passed = {g: gap for g, gap in gap_of.items() if g not in over}
        return StepResult(
            outcome=outcome,
            rejected=rejected,
            replays_dropped=over & replay_ids,
            logprob_gaps=gap_of,
            teacher_gaps=teacher_gaps,
            metrics={
                **_step_metrics(done, grad_norm, groups, rows, passed, replay_ids, teacher_gaps),
                "charts/lr": lr,
                "perf/step_s": time.perf_counter() - start,
            },
        )

    def _clip_gradients(self, rows: list[_Row]) -> float:
        """Clip the accumulated gradients to `max_grad_norm`; their norm before (0: none)."""
        if not rows:
            return 0.0
        params = [p for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))

    def _step_optimizer(
        self,
        groups: list[TrajectoryGroup],
        replays: list[TrajectoryGroup],
        trained_samples: int,
        count_at_least: int,
        lr: float | None,
    ) -> StepOutcome:
        """Name the batch's groups and step the optimizer, at `lr` (None: its own), on the
        samples the batch counts for; a batch that counts for none adds nothing."""
        all_samples = sum(len(g.samples) for g in groups) + sum(len(g.samples) for g in replays)
        informative_only = bool(self.config.informative_samples_per_step)
        counted = _samples_counted(trained_samples, all_samples, informative_only, count_at_least)
        # Named even when they add no gradient: they are trained with the batch they join.
        # (Replays are not: their groups were trained, and named, once.)
        self.optimizer.name_groups(g.group_id for g in groups)
        if counted == 0:
            # No sample with gradient, or every group rejected: the batch adds nothing.
            return StepOutcome(self.optimizer.epoch, applied=False, discarded=False)
        return self.optimizer.step_outcome(batch_size=counted, lr=lr)

    def _accumulate_or_explain(self, rows: list[_Row]) -> _Pass:
        """`_accumulate`, with CUDA running out of memory said in one line with its sizes."""
        try:
            return self._accumulate(rows)
        except torch.OutOfMemoryError:
            longest = max((len(r.prompt) + len(r.completion) for r in rows), default=0)
            detail = (
                f"micro-batches of {self.config.micro_batch_samples} sequences, "
                f"up to {longest} tokens"
            )
            raise out_of_memory(
                "the learner", self.device, detail, "trainer.gpu_memory_share"
            ) from None

    def _accumulate(self, rows: list[_Row]) -> _Pass:
        """Forward and backward every row, in micro-batches; gradients add up in `.grad`."""
        num_tokens = int(sum(int(r.mask.sum()) for r in rows))
        self.model.train()
        loss_sum, micro = 0.0, 0
        stats_sum = {"ratio_mean": 0.0, "clip_frac": 0.0, "sampler_kl": 0.0}
        differences: list[float] = []
        topk_kls: list[float] = []
        size = self.config.micro_batch_samples
        for i in range(0, len(rows), size):
            with torch.autocast(
                self.device.type,
                dtype=self.compute_dtype,
                enabled=self.compute_dtype != torch.float32,
            ):
                out = self._forward(rows[i : i + size])
            loss, stats = rl.policy_loss(
                out.logprobs,
                out.old_logprobs,
                out.advantages,
                out.mask,
                self.config.clip_eps,
                num_tokens,
                self.config.clip_eps_high,
            )
            if out.topk_loss is not None:
                loss = loss + out.topk_loss / max(num_tokens, 1)
                topk_kls.append(out.topk_kl)
            loss.backward()
            differences += rl.logprob_differences(
                out.logprobs.detach(), out.old_logprobs, out.mask
            ).tolist()
            loss_sum += float(loss.detach())
            micro += 1
            for k, v in stats.items():
                stats_sum[k] += v
        self.model.eval()
        stats = {k: v / max(micro, 1) for k, v in stats_sum.items()}
        topk_kl = sum(topk_kls) / len(topk_kls) if topk_kls else None
        return _Pass(loss_sum, stats, differences, num_tokens, topk_kl)

    @staticmethod
    def _group_gaps(rows: list[_Row], differences: list[float]) -> dict[str, float]:
        """Each group's gap, over the trained tokens of all its rows (`rl.logprob_gap`)."""
        pooled: dict[str, tuple[list[float], list[int]]] = {}
        for row, difference in zip(rows, differences, strict=True):
            summed, tokens = pooled.setdefault(row.group_id, ([], []))
            summed.append(difference)
            tokens.append(int(row.mask.sum()))
        return {g: rl.logprob_gap(summed, tokens) for g, (summed, tokens) in pooled.items()}

    def _rows(self, groups: list[TrajectoryGroup]) -> list[_Row]:
        """The samples that carry gradient (non-zero advantage, some trained token)."""
        rows = []
        for group in groups:
            advantages = rl.sample_advantages(
                [s.reward for s in group.samples],
                [s.episode for s in group.samples],
                self.config.advantage_std,
            )
            coef = self.teacher_coefs.get(group.env, 0.0)
            for sample, advantage in zip(group.samples, advantages, strict=True):
                mask = torch.from_numpy(unpack_mask(sample.loss_mask).astype("int64"))
                teacher: torch.Tensor | None = None
                top_ids: torch.Tensor | None = None
                top_logprobs: torch.Tensor | None = None
                if coef and sample.teacher_logprobs:  # a teacher's signal: every token has one
                    teacher = torch.from_numpy(unpack_floats(sample.teacher_logprobs).copy())
                    n = len(mask)
                    k = top_k_of(sample.teacher_top_ids, n)
                    if k:
                        ids = unpack_ids(sample.teacher_top_ids).astype("int64").reshape(n, k)
                        top_ids = torch.from_numpy(ids)
                        values = unpack_floats(sample.teacher_top_logprobs).reshape(n, k)
                        top_logprobs = torch.from_numpy(values.copy())
                if (advantage == 0.0 and teacher is None) or int(mask.sum()) == 0:
                    continue
                rows.append(
                    _Row(
                        group_id=group.group_id,
                        prompt=torch.from_numpy(unpack_ids(sample.prompt_ids).astype("int64")),
                        completion=torch.from_numpy(
                            unpack_ids(sample.completion_ids).astype("int64")
                        ),
                        sampler_logprobs=torch.from_numpy(unpack_floats(sample.logprobs).copy()),
                        mask=mask,
                        advantage=advantage,
                        teacher_logprobs=teacher,
                        teacher_coef=coef if teacher is not None else 0.0,
                        teacher_top_ids=top_ids,
                        teacher_top_logprobs=top_logprobs,
                    )
                )
        return rows

    def _forward(self, rows: list[_Row]) -> _Forward:
        """A micro-batch's logprobs under the current weights, the sampler's, the loss mask
        (all [B, T]), the advantages ([B], or [B, T] when a row has a teacher) and the top-k
        distillation loss of rows with a teacher's top k, with each distinct prompt
        prefilled once.

        The n samples of a group share their prompt (44 tokens for SmolLM2's chat template,
        more than the completion), so the prompt runs once with gradient and its KV cache is
        indexed out to the rows — the same prefix sharing the engine uses, and exactly the
        same numbers as a full forward of every row. Logits are computed only where a
        trained token is predicted, which skips most of the vocabulary matmul and memory.
        """
        hidden, c_ids = self._hidden_states(rows)
        device = self.device
        width = c_ids.shape[1]
        mask = torch.stack([_right(r.mask, width) for r in rows]).to(device)
        # The vocabulary projection only where a token is trained (the model's own tokens):
        # in multi-turn sequences most completion positions are tool output and prompts.
        trained = mask.bool()
        logits = self.model.get_output_embeddings()(hidden[trained]).float() / self.temperature
        all_logprobs = torch.log_softmax(logits, dim=-1)
        picked = all_logprobs.gather(1, c_ids[trained].unsqueeze(-1))
        logprobs = torch.zeros(mask.shape, dtype=picked.dtype, device=device).masked_scatter(
            trained, picked
        )
        old_logprobs = torch.stack([_right(r.sampler_logprobs, width) for r in rows]).to(device)
        advantages = torch.tensor([r.advantage for r in rows], device=device)
        out = _Forward(logprobs, old_logprobs, mask, advantages)
        _add_teacher_terms(out, rows, all_logprobs, trained, device)
        return out

    def _hidden_states(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state that predicts each completion token ([B, T, d]) and the
        completion ids ([B, T], right-padded), each distinct prompt prefilled once."""
        prompts: dict[tuple[int, ...], int] = {}
        row_prompt = [prompts.setdefault(tuple(r.prompt.tolist()), len(prompts)) for r in rows]
        device = self.device
        index = torch.tensor(row_prompt, device=device)
        pad = self.pad_token_id
        p_ids, p_mask = _pad([list(p) for p in prompts], pad, left=True, device=device)
        c_ids, c_mask = _pad(
            [r.completion.tolist() for r in rows], self.pad_token_id, left=False, device=device
        )
        decoder = self.model.get_decoder()
        cache = DynamicCache(config=self.model.config)
        prompt_out = decoder(
            input_ids=p_ids,
            attention_mask=p_mask,
            position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0),
            **with_cache(cache),
        )
        cache.batch_select_indices(index)
        prompt_lengths = p_mask.sum(-1)[index]
        completion_out = decoder(
            input_ids=c_ids,
            attention_mask=torch.cat([p_mask[index], c_mask], dim=1),
            position_ids=prompt_lengths[:, None] + torch.arange(c_ids.shape[1], device=device),
            **with_cache(cache),
        )
        # Token t of a completion is predicted by the hidden state before it: the prompt's
        # last one (the last column, prompts are left-padded) for t = 0, then the completion's.
        hidden = torch.cat(
            [
                prompt_out.last_hidden_state[index, -1:],
                completion_out.last_hidden_state[:, :-1],
            ],
            dim=1,
        )
        return hidden, c_ids


def _add_teacher_terms(
    out: _Forward,
    rows: list[_Row],
    all_logprobs: torch.Tensor,
    trained: torch.Tensor,
    device: torch.device,
) -> None:
    """A micro-batch's distillation terms, into `out`: a row with a teacher's top k learns
    from it (`rl.topk_distill_loss` over the `trained` positions, whose full logprobs are
    `all_logprobs`); one with only the sampled tokens' teacher logprobs, from the advantage
    term (`rl.distill_advantages`)."""
    mask, width = out.mask, out.mask.shape[1]
    topped = [r.teacher_top_ids is not None for r in rows]
    if any(r.teacher_logprobs is not None and not t for r, t in zip(rows, topped, strict=True)):
        teacher = torch.stack([_right(_teacher_or_zeros(r), width) for r in rows]).to(device)
        coef = torch.tensor(
            [0.0 if t else r.teacher_coef for r, t in zip(rows, topped, strict=True)],
            device=device,
        )
        out.advantages = rl.distill_advantages(
            out.advantages, out.old_logprobs, teacher, mask, coef
        )
    if any(topped):
        top_ids, top_logprobs = _tops(rows, width)
        at_top = all_logprobs.gather(1, top_ids.to(device)[trained])
        teacher_top = top_logprobs.to(device)[trained]
        coef = torch.tensor(
            [r.teacher_coef if t else 0.0 for r, t in zip(rows, topped, strict=True)]
        )
        per_position = coef.to(device)[:, None].expand(mask.shape)[trained]
        out.topk_loss = rl.topk_distill_loss(at_top, teacher_top, per_position)
        taught = per_position > 0
        out.topk_kl = rl.topk_kl(at_top[taught].detach(), teacher_top[taught])


def _samples_counted(
    trained_samples: int, all_samples: int, informative_only: bool, at_least: int
) -> int:
    """The samples a batch counts for toward the optimizer's target: those with gradient
    (`informative_only`: trainer.informative_samples_per_step is set) or all of them, and at least
    `at_least` (a short step under dynamic sampling counts as full) unless there are none."""
    counted = trained_samples if informative_only else all_samples
    return max(counted, at_least) if counted else 0


def _step_metrics(
    done: _Pass,
    grad_norm: float,
    groups: list[TrajectoryGroup],
    rows: list[_Row],
    passed: dict[str, float],
    replay_ids: set[str],
    teacher_gaps: dict[str, float],
) -> dict[str, float]:
    """A step's losses/ and charts/ metrics: `passed` are the logprob gaps of the groups
    trained (fresh and replayed), `teacher_gaps` those of the groups whose teacher
    logprobs were checked."""
    rewards = [s.reward for g in groups for s in g.samples]
    taught = [r for r in rows if r.teacher_logprobs is not None]
    fresh_gaps = [gap for g, gap in passed.items() if g not in replay_ids]
    replay_gaps = [gap for g, gap in passed.items() if g in replay_ids]
    return {
        "losses/policy": done.loss,
        "losses/grad_norm": grad_norm,
        **{f"losses/{k}": v for k, v in done.stats.items()},
        # Of fresh groups (replays' gaps are larger: the policy moved since).
        "charts/logprob_gap_max": max(fresh_gaps, default=0.0),
        "charts/replay_logprob_gap_max": max(replay_gaps, default=0.0),
        "charts/reward_mean": sum(rewards) / max(len(rewards), 1),
        "charts/samples": sum(len(g.samples) for g in groups),
        "charts/trained_samples": len(rows),
        "charts/trained_tokens": done.num_tokens,
        **({"charts/teacher_topk_kl": done.topk_kl} if done.topk_kl is not None else {}),
        **(
            {
                "charts/teacher_samples": len(taught),
                "charts/teacher_kl": _teacher_kl(taught),
            }
            if taught
            else {}
        ),
        **(
            {
                "charts/teacher_checked_groups": len(teacher_gaps),
                "charts/teacher_check_gap_max": max(
                    (gap for gap in teacher_gaps.values() if math.isfinite(gap)),
                    default=0.0,
                ),
            }
            if teacher_gaps
            else {}
        ),
        "charts/zero_variance_groups": sum(
            1 for g in groups if rl.zero_variance([s.reward for s in g.samples])
        ),
    }


def _pad(
    seqs: list[list[int]], pad_id: int, left: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `seqs` padded to one width, on `device`."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        span = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[i, span] = torch.tensor(seq, dtype=torch.long)
        mask[i, span] = 1
    return ids.to(device), mask.to(device)


def _tops(rows: list[_Row], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' teacher top ids and logprobs, [B, width, k] for the largest k among them:
    padded with token 0 at logprob NO_TOKEN (weight exp(NO_TOKEN) = 0), as a row without a
    top k is whole."""
    k = max(r.teacher_top_ids.shape[1] for r in rows if r.teacher_top_ids is not None)
    ids = torch.zeros((len(rows), width, k), dtype=torch.long)
    logprobs = torch.full((len(rows), width, k), NO_TOKEN)
    for i, r in enumerate(rows):
        if r.teacher_top_ids is not None and r.teacher_top_logprobs is not None:
            n, kr = r.teacher_top_ids.shape
            ids[i, :n, :kr] = r.teacher_top_ids
            logprobs[i, :n, :kr] = r.teacher_top_logprobs
    return ids, logprobs


# The logprob of a padding entry of a top k: exp() is 0 in float32, and it stays finite.
NO_TOKEN = -1e4


def _teacher_or_zeros(row: _Row) -> torch.Tensor:
    """A row's teacher logprobs, or zeros of its width (no teacher: coef 0 reads none)."""
    if row.teacher_logprobs is not None:
        return row.teacher_logprobs
    return torch.zeros_like(row.sampler_logprobs)


def _teacher_kl(rows: list[_Row]) -> float:
    """Mean per-token reverse KL to the teacher (sampler's view) over rows with a teacher."""
    sampler = torch.cat([r.sampler_logprobs for r in rows])
    teacher = torch.cat([_teacher_or_zeros(r) for r in rows])
    return rl.teacher_kl(sampler, teacher, torch.cat([r.mask for r in rows]))


def teacher_coefs(envs: list[EnvConfig]) -> dict[str, float]:
    """The environments that name a teacher, with the weight of its signal."""
    return {env.name: env.teacher_coef for env in envs if env.teacher}


def _right(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` zero-padded on the right to `width`."""
    return torch.nn.functional.pad(values, (0, width - len(values)))
