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

from agentjet import rl
from agentjet.config import TrainerConfig
from agentjet.protocol import TrajectoryGroup, unpack_floats, unpack_ids, unpack_mask
from node.swarm import SwarmOptimizer


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

    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
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
        version = self.swarm.step(batch_size=num_samples)
        rewards = [s.reward for g in groups for s in g.samples]
        return {
            "policy_version": version,
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
            advantages = rl.group_advantages([s.reward for s in group.samples])
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
        """Right-padded batch; logits only at completion positions (saves the vocab matmul)."""
        lengths = [len(r.prompt) + len(r.completion) for r in rows]
        width = max(lengths)
        comp_width = max(len(r.completion) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        old_logprobs = torch.zeros((len(rows), comp_width))
        mask = torch.zeros((len(rows), comp_width), dtype=torch.long)
        targets = torch.zeros((len(rows), comp_width), dtype=torch.long)
        # positions[b, t]: index of the hidden state that predicts completion token t
        positions = torch.zeros((len(rows), comp_width), dtype=torch.long)
        for b, r in enumerate(rows):
            n_p, n_c = len(r.prompt), len(r.completion)
            input_ids[b, : n_p + n_c] = torch.cat([r.prompt, r.completion])
            attention[b, : n_p + n_c] = 1
            old_logprobs[b, :n_c] = r.sampler_logprobs
            mask[b, :n_c] = r.mask
            targets[b, :n_c] = r.completion
            positions[b, :n_c] = torch.arange(n_p - 1, n_p - 1 + n_c)
        hidden = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention
        ).last_hidden_state
        picked = torch.gather(hidden, 1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        logits = self.model.get_output_embeddings()(picked).float() / self.temperature
        logprobs = torch.gather(
            torch.log_softmax(logits, dim=-1), 2, targets.unsqueeze(-1)
        ).squeeze(-1)
        advantages = torch.tensor([r.advantage for r in rows])
        return rl.policy_loss(
            logprobs, old_logprobs, advantages, mask, self.config.clip_eps, num_tokens
        )
