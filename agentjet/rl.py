"""The RL math, readable top to bottom. Symbols follow the GRPO / PPO papers.

For a group of G samples of one task with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + eps)                       group-relative advantage
    A_i = r_i - mean(r)                        Dr. GRPO (trainer.advantage_std = false)

For every trained token t of sample i, with pi_theta the learner's policy and mu the
sampler's (possibly stale or engine-mismatched) policy that produced the token:

    ratio_t = exp(log pi_theta(y_t) - log mu(y_t))              importance weight
    loss_t  = max(-A_i * ratio_t, -A_i * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    loss    = sum_t mask_t * loss_t / N_tokens                   token-level mean over the step

Because the ratio is taken against the sampler's own logprobs (decoupled PPO), samples
from an older policy version stay correctly weighted up to the staleness bound. eps_low is
trainer.clip_eps; eps_high is trainer.clip_eps_high, DAPO's clip-higher when larger (0: the
same as eps_low). The token-level mean over the step is DAPO's: a long sample weighs by its
tokens, not as one sample.

On-policy distillation (an environment with a teacher, `envs[].teacher`): the teacher
scores the student's own sampled tokens (prefill, no generation), and the per-token reverse
KL estimate log mu(y_t) - log pi_teacher(y_t) becomes a per-token advantage term,

    A_{i,t} = A_i + coef * (log pi_teacher(y_t) - log mu(y_t))   (no discounting)

so a token the teacher finds likelier than the student did is pushed up, one it finds
less likely is pushed down; coef (`envs[].teacher_coef`) weighs the teacher against the
reward. The same clipped loss trains it: `advantages` may be per sample [B] or per token
[B, T].

With a teacher's top k (`envs[].teacher_top_k`), the teacher sends, at each trained
position t, its k likeliest next tokens K_t and their logprobs, and the sampled-token term
above gives way to a loss on the model's whole distribution there:

    loss_t = -coef * sum_{v in K_t} pi_teacher(v) * log pi_theta(v)

the cross-entropy to the teacher's top k (the forward KL to it, less the teacher's entropy
over K_t, which has no gradient): every position moves k tokens toward the teacher, where
the sampled term moves the one token sampled, by a one-sample estimate. It is minimised by
the teacher's distribution renormalised over K_t. It needs no importance weight: it is a
divergence at the positions the sampler visited, not a policy gradient. Added to the
policy loss and taken as the same token-level mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ADVANTAGE_EPS = 1e-6


def _mean_std(rewards: Sequence[float]) -> tuple[float, float]:
    n = len(rewards)
    mean = sum(rewards) / n
    return mean, math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)


def zero_variance(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards all agree: its advantages are all zero, it teaches nothing
    (what dynamic sampling leaves out). An empty group teaches nothing either."""
    return not rewards or _mean_std(rewards)[1] < ADVANTAGE_EPS


def group_advantages(rewards: Sequence[float], std: bool = True) -> list[float]:
    """GRPO advantages; all zero when every sample got the same reward (no signal).
    `std=False`: Dr. GRPO's r - mean(r), not divided by the group's std (which weighs a
    group that is nearly all right or all wrong up to sqrt(G - 1) times a half-right one)."""
    if zero_variance(rewards):
        return [0.0] * len(rewards)
    mean, sd = _mean_std(rewards)
    scale = sd + ADVANTAGE_EPS if std else 1.0
    return [(r - mean) / scale for r in rewards]


def sample_advantages(
    rewards: Sequence[float], episodes: Sequence[int], std: bool = True
) -> list[float]:
    """Advantages of a group's samples when an episode may span several samples (timeline
    merging keeps forked conversations apart): `episodes[i]` is sample i's episode, -1 for a
    sample that is an episode of its own. Each episode counts once, with its reward."""
    if all(e < 0 for e in episodes):
        return group_advantages(rewards, std)
    keys = [e if e >= 0 else -1 - i for i, e in enumerate(episodes)]  # lone samples: unique
    reward_of = dict(zip(keys, rewards, strict=True))
    order = list(reward_of)
    advantages = group_advantages([reward_of[k] for k in order], std)
    advantage_of = dict(zip(order, advantages, strict=True))
    return [advantage_of[k] for k in keys]


def distill_advantages(
    advantages: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: torch.Tensor,
) -> torch.Tensor:
    """Per-token advantages [B, T]: each sample's reward advantage `advantages` [B] plus
    `coef` [B] times the teacher's logprob less the sampler's, on trained tokens (`mask`);
    a sample without a teacher has coef 0 (its teacher logprobs are not read)."""
    term = (teacher_logprobs - sampler_logprobs) * mask.to(sampler_logprobs.dtype)
    return advantages.unsqueeze(1) + coef.unsqueeze(1) * term


def topk_distill_loss(
    logprobs_at_top: torch.Tensor, teacher_top_logprobs: torch.Tensor, coef: torch.Tensor
) -> torch.Tensor:
    """Summed over positions, coef times the cross-entropy to the teacher's top k:
    `logprobs_at_top` [N, k] the learner's logprobs of the teacher's top-k tokens at N
    trained positions, `teacher_top_logprobs` [N, k] the teacher's, `coef` [N] each
    position's weight (0: no teacher there)."""
    ce = -(teacher_top_logprobs.exp() * logprobs_at_top).sum(-1)
    return (coef * ce).sum()


def topk_kl(logprobs_at_top: torch.Tensor, teacher_top_logprobs: torch.Tensor) -> float:
    """Mean per position of the KL from the teacher's top k to the learner over those k
    tokens, sum_v pi_teacher(v) (log pi_teacher(v) - log pi_theta(v)) (a metric). Summed
    over k tokens, not the vocabulary: below 0 where the learner puts more mass on them than
    the teacher does (a student sharpened by its reward)."""
    p = teacher_top_logprobs.exp()
    per = (p * (teacher_top_logprobs - logprobs_at_top)).sum(-1)
    return float(per.mean()) if per.numel() else 0.0


def teacher_kl(
    sampler_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """Mean per-token reverse KL estimate, log mu - log pi_teacher, over the trained tokens."""
    mask = mask.to(sampler_logprobs.dtype)
    return float(((sampler_logprobs - teacher_logprobs) * mask).sum() / mask.sum().clamp(min=1))


def policy_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    num_tokens: int,
    clip_eps_high: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped importance-weighted policy-gradient loss; the ratio is clipped to
    [1 - clip_eps, 1 + clip_eps_high] (DAPO's clip-higher when clip_eps_high > clip_eps;
    0: symmetric).

    Shapes: `logprobs`, `sampler_logprobs`, `mask`: [B, T]; `advantages`: [B] (one per
    sample) or [B, T] (per token: `distill_advantages`).
    `num_tokens` is the number of trained tokens in the whole optimizer step, so that
    micro-batches add up to one token-level mean.
    """
    ratio = torch.exp(logprobs - sampler_logprobs)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + (clip_eps_high or clip_eps))
    per_token = torch.maximum(unclipped, clipped)
    mask = mask.to(per_token.dtype)
    loss = (per_token * mask).sum() / max(num_tokens, 1)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {
            "ratio_mean": float((ratio * mask).sum() / n),
            "clip_frac": float(((unclipped < clipped).to(mask.dtype) * mask).sum() / n),
            "sampler_kl": float(((sampler_logprobs - logprobs) * mask).sum() / n),
        }
    return loss, stats


def logprob_differences(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per sample, the sum of log pi_theta(y_t) - log mu(y_t) over its trained tokens, the
    part of a group's `logprob_gap` one sample contributes. Shapes: [B, T] -> [B]."""
    mask = mask.to(logprobs.dtype)
    return ((logprobs - sampler_logprobs) * mask).sum(-1)


# A sample's difference is spread over at least this many tokens in `logprob_gap`: a policy's
# move falls on a few deciding tokens, and a 1-3 token answer would carry a whole move per
# token (honest short answers reached 0.66 nats a token at lag 4: bench/LOG.md, 2026-12-06).
GAP_MIN_SAMPLE_TOKENS = 16


def logprob_gap(differences: Sequence[float], tokens: Sequence[int]) -> float:
    """A group's logprob gap: |mean of log pi_theta - log mu| over all its checked samples'
    trained tokens, from each sample's summed difference (`logprob_differences`) and its
    trained tokens, a sample counting GAP_MIN_SAMPLE_TOKENS tokens at least. 0 without
    trained tokens.

    How far the logprobs a rollout node reports are from the learner's own, robust to the
    policy having moved since: y_t was drawn from mu, so the mean difference estimates
    -KL(mu || pi_theta), which is second order in the policy's change (a token the policy
    now likes more, another it likes less, cancel), where the mean |difference| is first
    order and, on a 1-3 token answer, one token's whole move. Forgeries are systematic:
    made-up logprobs (zeroed, halved) and altered tokens (logprobs kept) all claim tokens
    likelier than the learner finds them, every sample the same way. Pooled over the group,
    not the largest of its samples: a short sample's mean is one token's difference.
    Numbers and the bound's reasoning: bench/LOG.md, "logprob gap on short answers".
    """
    count = sum(max(n, GAP_MIN_SAMPLE_TOKENS) for n in tokens if n)
    return abs(sum(differences)) / count if count else 0.0


def policy_lag(sample_version: int, current_version: int) -> int:
    """How many policy versions behind the learner a sample is."""
    return current_version - sample_version


def is_stale(sample_version: int, current_version: int, max_policy_lag: int) -> bool:
    return policy_lag(sample_version, current_version) > max_policy_lag
