"""One policy-gradient step over a batch of trajectory groups.

    groups ──advantages (recomputed from rewards)──▶ samples with A != 0
           ──micro-batches──▶ forward: log pi_theta(completion tokens) ──▶ rl.policy_loss
           ──backward (grads accumulate)──▶ clip ──▶ SwarmOptimizer.step ──▶ new policy version

Samples with zero advantage contribute exactly zero gradient, so they are counted but
never forwarded: on arithmetic, where most groups are all-right or all-wrong, this is
most of the batch. Advantages are recomputed here from the rewards rather than trusted
from the wire.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from agentjet import rl
from agentjet.config import TrainerConfig
from agentjet.protocol import TrajectoryGroup, unpack_floats, unpack_ids, unpack_mask
from node.swarm import StepOutcome, SwarmOptimizer


@dataclass
class _Row:
    prompt: torch.Tensor
    completion: torch.Tensor
    sampler_logprobs: torch.Tensor
    mask: torch.Tensor
    advantage: float


class Learner:
    def __init__(
        self,
        model: Any,
        swarm: SwarmOptimizer,
        config: TrainerConfig,
        temperature: float,
        pad_token_id: int,
    ) -> None:
        self.model = model
        self.swarm = swarm
        self.config = config
        # The sampler's logprobs are of softmax(logits / T); ours must be the same quantity.
        self.temperature = temperature
        self.pad_token_id = pad_token_id

    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, Any]:
        """Accumulate gradients over `groups`, step the swarm optimizer, return metrics."""
        start = time.perf_counter()
        rows, num_samples = self._rows(groups)
        num_tokens = int(sum(int(r.mask.sum()) for r in rows))
        self.model.train()
        loss_sum, micro = 0.0, 0
        stats_sum = {"ratio_mean": 0.0, "clip_frac": 0.0, "sampler_kl": 0.0}
        size = self.config.micro_batch_samples
        for i in range(0, len(rows), size):
            loss, stats = self._micro_step(rows[i : i + size], num_tokens)
            loss.backward()
            loss_sum += float(loss.detach())
            micro += 1
            for k, v in stats.items():
                stats_sum[k] += v
        grad_norm = 0.0
        if rows:
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        self.model.eval()
        if self.config.informative_samples_per_step and not rows:
            # Counted in samples with gradient; a batch without any adds nothing.
            outcome = StepOutcome(self.swarm.epoch, applied=False, discarded=False)
        else:
            counted = len(rows) if self.config.informative_samples_per_step else num_samples
            outcome = self.swarm.step_outcome(batch_size=counted)
        rewards = [s.reward for g in groups for s in g.samples]
        return {
            "policy_version": outcome.epoch,
            "optimizer_stepped": outcome.applied,
            "optimizer_discarded": outcome.discarded,
            "losses/policy": loss_sum,
            "losses/grad_norm": grad_norm,
            **{f"losses/{k}": v / max(micro, 1) for k, v in stats_sum.items()},
            "charts/reward_mean": sum(rewards) / max(len(rewards), 1),
            "charts/samples": num_samples,
            "charts/trained_samples": len(rows),
            "charts/trained_tokens": num_tokens,
            "charts/zero_variance_groups": sum(
                1 for g in groups if len({s.reward for s in g.samples}) == 1
            ),
            "perf/step_s": time.perf_counter() - start,
        }

    def _rows(self, groups: list[TrajectoryGroup]) -> tuple[list[_Row], int]:
        rows, num_samples = [], 0
        for group in groups:
            advantages = rl.sample_advantages(
                [s.reward for s in group.samples], [s.episode for s in group.samples]
            )
            num_samples += len(group.samples)
            for sample, advantage in zip(group.samples, advantages, strict=True):
                mask = torch.from_numpy(unpack_mask(sample.loss_mask).astype("int64"))
                if advantage == 0.0 or int(mask.sum()) == 0:
                    continue
                rows.append(
                    _Row(
                        prompt=torch.from_numpy(unpack_ids(sample.prompt_ids).astype("int64")),
                        completion=torch.from_numpy(
                            unpack_ids(sample.completion_ids).astype("int64")
                        ),
                        sampler_logprobs=torch.from_numpy(unpack_floats(sample.logprobs).copy()),
                        mask=mask,
                        advantage=advantage,
                    )
                )
        return rows, num_samples

    def _micro_step(
        self, rows: list[_Row], num_tokens: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward a micro-batch with each distinct prompt prefilled once.

        The n samples of a group share their prompt (44 tokens for SmolLM2's chat template,
        more than the completion), so the prompt runs once with gradient and its KV cache is
        indexed out to the rows — the same prefix sharing the engine uses, and exactly the
        same numbers as a full forward of every row. Logits are computed only where a
        trained token is predicted, which skips most of the vocabulary matmul and memory.
        """
        prompts: dict[tuple[int, ...], int] = {}
        row_prompt = [prompts.setdefault(tuple(r.prompt.tolist()), len(prompts)) for r in rows]
        index = torch.tensor(row_prompt)
        p_ids, p_mask = _pad([list(p) for p in prompts], self.pad_token_id, left=True)
        c_ids, c_mask = _pad([r.completion.tolist() for r in rows], self.pad_token_id, left=False)
        decoder = self.model.get_decoder()
        cache = DynamicCache(config=self.model.config)
        prompt_out = decoder(
            input_ids=p_ids,
            attention_mask=p_mask,
            position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
        )
        cache.batch_select_indices(index)
        prompt_lengths = p_mask.sum(-1)[index]
        completion_out = decoder(
            input_ids=c_ids,
            attention_mask=torch.cat([p_mask[index], c_mask], dim=1),
            position_ids=prompt_lengths[:, None] + torch.arange(c_ids.shape[1]),
            cache=cache,
            use_cache=True,
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
        width = c_ids.shape[1]
        mask = torch.stack([_right(r.mask, width) for r in rows])
        # The vocabulary projection only where a token is trained (the model's own tokens):
        # in multi-turn sequences most completion positions are tool output and prompts.
        trained = mask.bool()
        logits = self.model.get_output_embeddings()(hidden[trained]).float() / self.temperature
        picked = torch.log_softmax(logits, dim=-1).gather(1, c_ids[trained].unsqueeze(-1))
        logprobs = torch.zeros(mask.shape, dtype=picked.dtype).masked_scatter(trained, picked)
        old_logprobs = torch.stack([_right(r.sampler_logprobs, width) for r in rows])
        advantages = torch.tensor([r.advantage for r in rows])
        return rl.policy_loss(
            logprobs, old_logprobs, advantages, mask, self.config.clip_eps, num_tokens
        )


def _pad(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `seqs` padded to one width."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        span = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[i, span] = torch.tensor(seq, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def _right(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` zero-padded on the right to `width`."""
    return torch.nn.functional.pad(values, (0, width - len(values)))
