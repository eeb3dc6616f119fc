"""Batched sampling with a KV cache in plain torch: the engine for CPUs.

    prompts ──dedupe──▶ prefill each distinct prompt once (left padded) ──▶ KV cache
        ──repeat rows n times──▶ decode loop: sample ─▶ record (id, logprob) ─▶ drop finished rows
        ──▶ result[i][j] = Completion for sample j of prompt i

The decode loop is written here rather than taken from `model.generate` because the trainer
needs the sampler's own logprob of every token, defined exactly (see `sample_next`).

Sharing the prompt matters most on small CPUs: a GRPO group is n samples of one prompt, so
the prompt is prefilled once and its KV cache copied n times, and rows that hit eos leave the
batch at once. Measured with SmolLM2-135M (float32, 8 prompts of 44-48 tokens x 8 samples x
32 new tokens = 2048 tokens, temperature 1, eos disabled so every row runs all 32 steps; a
2-core AMD EPYC box, 2026-11):

    threads   prefix sharing   tokens/s, box idle   tokens/s, another process busy
    1         yes              210                  130-160
    1         no               133                  113-118
    2         yes              330-346              14-35
    2         no               205-214              28-58

Two threads win only on an idle box: when anything else holds a core, OpenMP's barrier
waits collapse throughput 10x. One thread is the safe default on small shared machines
(`rollout.torch_threads = 1`); `torch.set_num_threads` is process-wide. Sampling itself
avoids `torch.multinomial` (see `sample_next`), which had cost a third of each decode step.

`generate` and `load_state_dict` are coroutines: one batch or one weight load at a time,
each run across the bridge (agentjet/bridge.py) so the caller's event loop keeps serving
(`BridgedEngine`, node/engine_base.py, which the vLLM engine shares).

Several policies on one base (issue 26): `load_adapters` puts a policy's LoRA adapters in
the engine's `AdapterBank` (node/adapter_bank.py), and `generate(..., policies=[...])`
samples every prompt under its own policy in one batch; a prompt is shared across rows only
within a policy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
from transformers import DynamicCache

from agentjet.config import ModelConfig
from agentjet.devices import ALONE_SHARE, check_fits, engine_bytes, limit_memory, out_of_memory
from agentjet.episode import Completion, SamplingParams
from node.adapter_bank import AdapterBank
from node.engine_base import BridgedEngine, check_request, check_state_dict
from node.model import DTYPES, eos_token_ids, load_causal_lm, with_cache


class TorchEngine(BridgedEngine):
    """An `Engine` on a Hugging Face causal LM, with in-place weight reloads.

    `eos_token_ids` is public: callers may add ids that should end a turn (a tool-call
    closing token); a sampled stop id is kept as the completion's last token.
    """

    takes_adapters = False  # LoRA versions arrive merged into full weights

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        seed: int = 0,
        threads: int | None = None,
        device: torch.device | str = "cpu",
        memory_share: float = ALONE_SHARE,
    ) -> None:
        """`memory_share`: on a CUDA `device`, the share of its memory this engine may take
        (the weights must fit it, checked before they move there)."""
        super().__init__()
        if threads is not None:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        model, self.tokenizer = load_causal_lm(model_path, dtype)
        check_fits(
            "the torch engine",
            engine_bytes(model, DTYPES[dtype]),
            self.device,
            memory_share,
            "rollout.gpu_memory_share",
        )
        limit_memory(self.device, memory_share)
        torch.nn.Module.to(model, self.device)  # in place (transformers mistypes `to`)
        self.model = model
        self.vocab_size: int = self.model.config.vocab_size
        self.eos_token_ids: set[int] = eos_token_ids(model_path, self.tokenizer)
        self.max_positions: int = self.model.config.max_position_embeddings
        # Any id works: padded positions are masked out of attention.
        self._pad_id: int = self.tokenizer.pad_token_id or 0
        self._generator = torch.Generator(self.device).manual_seed(seed)
        # Policies' LoRA adapters over these weights (made by the first `load_adapters`).
        self.adapters: AdapterBank | None = None

    async def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        policies: Sequence[str | None] | None = None,
    ) -> list[list[Completion]]:
        """`n` completions per prompt; result[i][j] is sample j of prompt i.

        Each completion records the token ids exactly as sampled and, per token, the sampler
        logprob `log_softmax(logits / temperature)[token]` taken before top-p truncation
        (temperature 1 when greedy): the quantity the trainer recomputes for the importance
        ratio. A completion ends with an eos id ("stop", eos included) or after
        `max_new_tokens` ("length"). Each distinct prompt is prefilled once, however many
        samples and repeats it has; greedy samples of one prompt are identical, so greedy
        decodes each distinct prompt once and shares the result.

        `policies[i]` names the policy whose adapters (`load_adapters`) sample prompt i
        (None: the base weights); all prompts share one batch.

        The request is checked here; the decode runs across the bridge, after any call
        before it (one batch or weight load at a time).
        """
        check_request(prompts, n, params)
        if not prompts:
            return []
        if policies is not None:
            if len(policies) != len(prompts):
                raise ValueError(f"{len(policies)} policies for {len(prompts)} prompts")
            if self.adapters is None and any(p is not None for p in policies):
                raise ValueError("no policy adapters are loaded in this engine")
        longest = max(len(p) for p in prompts)
        if longest + params.max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                f"the model's {self.max_positions} positions"
            )
        return await self._exclusive(self._generate, prompts, n, params, policies)

    @torch.inference_mode()
    def _generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        policies: Sequence[str | None] | None = None,
    ) -> list[list[Completion]]:
        """`generate`'s blocking body (a bridge thread; checked requests only)."""
        longest = max(len(p) for p in prompts)
        keys = [
            (None if policies is None else policies[i], tuple(prompt))
            for i, prompt in enumerate(prompts)
        ]
        # Rows needed per distinct (policy, prompt): n per occurrence, or one when greedy.
        rows_needed: dict[tuple[str | None, tuple[int, ...]], int] = {}
        for key in keys:
            rows_needed[key] = 1 if params.greedy else rows_needed.get(key, 0) + n
        slots = None
        if self.adapters is not None:
            slots = self.adapters.slots([policy for policy, _ in rows_needed])
        try:
            decoded = self._decode(
                [prompt for _, prompt in rows_needed], list(rows_needed.values()), params, slots
            )
        except torch.OutOfMemoryError:
            detail = f"{sum(rows_needed.values())} rows, prompts up to {longest} tokens"
            raise out_of_memory(
                "the torch engine", self.device, detail, "rollout.gpu_memory_share"
            ) from None
        # Hand each occurrence the next unused rows of its prompt (they come out grouped).
        next_row: dict[tuple[str | None, tuple[int, ...]], int] = {}
        row = 0
        for key, count in rows_needed.items():
            next_row[key] = row
            row += count
        results = []
        for key in keys:
            if params.greedy:
                results.append([_copy(decoded[next_row[key]]) for _ in range(n)])
            else:
                results.append(decoded[next_row[key] : next_row[key] + n])
                next_row[key] += n
        return results

    def _decode(
        self,
        prompts: list[tuple[int, ...]],
        copies: list[int],
        params: SamplingParams,
        slots: torch.Tensor | None = None,
    ) -> list[Completion]:
        """Prefill `prompts` once, then sample `copies[i]` completions of prompt i (grouped);
        `slots[i]`: the adapter slot of prompt i's rows (None: no adapters)."""
        input_ids, attention_mask = self._left_pad(prompts)
        cache = DynamicCache(config=self.model.config)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        with self._rows(slots):
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **with_cache(cache),
                logits_to_keep=1,
            )
        # Share the prefill: each prompt's cache row, mask and logits repeated copies[i] times.
        expand = torch.arange(len(prompts), device=self.device).repeat_interleave(
            torch.tensor(copies, device=self.device)
        )
        cache.batch_select_indices(expand)
        slots = None if slots is None else slots[expand]
        attention_mask = attention_mask[expand]
        logits = out.logits[expand, -1]
        next_position = attention_mask.sum(-1)

        total = len(expand)
        token_ids: list[list[int]] = [[] for _ in range(total)]
        logprobs: list[list[float]] = [[] for _ in range(total)]
        finish: list[Literal["stop", "length"]] = ["length"] * total
        live = list(range(total))  # the completion each row of the batch writes to
        eos = torch.tensor(sorted(self.eos_token_ids), device=self.device)
        for step in range(params.max_new_tokens):
            tokens, token_logprobs = sample_next(logits, params, self._generator)
            for row, (token, logprob) in enumerate(
                zip(tokens.tolist(), token_logprobs.tolist(), strict=True)
            ):
                token_ids[live[row]].append(token)
                logprobs[live[row]].append(logprob)
            stopped = torch.isin(tokens, eos)
            for row in stopped.nonzero().flatten().tolist():
                finish[live[row]] = "stop"
            if step == params.max_new_tokens - 1 or bool(stopped.all()):
                break
            if bool(stopped.any()):
                keep = (~stopped).nonzero().flatten()
                cache.batch_select_indices(keep)
                slots = None if slots is None else slots[keep]
                live = [live[row] for row in keep.tolist()]
                tokens = tokens[keep]
                attention_mask, next_position = attention_mask[keep], next_position[keep]
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones((len(live), 1))], dim=-1
            )
            with self._rows(slots):
                out = self.model(
                    input_ids=tokens[:, None],
                    attention_mask=attention_mask,
                    position_ids=next_position[:, None],
                    **with_cache(cache),
                )
            logits = out.logits[:, -1]
            next_position = next_position + 1
        return [
            Completion(token_ids=ids, logprobs=lps, finish_reason=reason)
            for ids, lps, reason in zip(token_ids, logprobs, finish, strict=True)
        ]

    @contextmanager
    def _rows(self, slots: torch.Tensor | None) -> Iterator[None]:
        """Forwards inside run each batch row with its slot's adapters (None: none)."""
        if slots is None or self.adapters is None:
            yield
        else:
            with self.adapters.rows(slots):
                yield

    def _left_pad(self, prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left padding puts every prompt's last token in the last column, where decoding starts."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    async def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Take a new policy version's weights and start tagging samples with `version`.

        Everything is checked before anything is taken, so a wrong state dict (other
        architecture, truncated transfer) raises ValueError naming the key and leaves the
        current weights untouched. A tensor of the engine's dtype on its device becomes the
        weight itself (no copy: the caller's buffer, node/weights.py, is then the engine's,
        and the weights before it are let go); others are cast and copied into the weights
        already there. Keys are those of `named_parameters()`: tied weights (SmolLM2's
        lm_head) appear once. It waits for a decode in progress and runs across the bridge.
        """
        check_state_dict(self.state_dict(), state)
        await self._load_version(version, self._take_weights, state)

    @property
    def policy_versions(self) -> dict[str, int]:
        """The version of each policy's adapters loaded (`load_adapters`)."""
        return dict(self.adapters.versions) if self.adapters is not None else {}

    async def load_adapters(
        self, policy: str, adapters: Mapping[str, torch.Tensor], lora: ModelConfig, version: int
    ) -> None:
        """Take a version of `policy`'s LoRA adapters (peft names, as trainers publish them;
        `lora`: the policy's model config, for lora_alpha / lora_rank) next to the base
        weights; other policies' adapters stay as they are. Checked before anything changes
        (ValueError); waits for a decode in progress and runs across the bridge."""
        scale = lora.lora_alpha / lora.lora_rank
        if self.adapters is None:
            # Made now, on the loop: an empty bank hooks no layer, so a decode before this
            # load's turn computes the same numbers with it.
            self.adapters = AdapterBank(self.model)
        await self._exclusive(self.adapters.put, policy, adapters, scale, version)

    def _take_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """`load_state_dict`'s blocking body (a bridge thread; a checked state dict)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for key, tensor in state.items():
                param = params[key]
                if tensor.dtype == param.dtype and tensor.device == param.device:
                    param.data = tensor
                else:
                    param.data.copy_(tensor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live parameters by HF name, tied ones once (no copy: clone before changing)."""
        return {name: p.data for name, p in self.model.named_parameters()}


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` (rows, vocab); return (tokens, sampler logprobs).

    The logprob is `log_softmax(logits / T)[token]`, computed before top-p truncation (T = 1
    when greedy). Top-p keeps the smallest set of most likely tokens whose mass reaches
    `top_p` and samples from it renormalized.

    One exp pass serves both the sample and the logprob, and sampling inverts the CDF with
    one uniform draw per row: `torch.multinomial` draws an exponential per vocabulary entry,
    which cost a third of a decode step for SmolLM2 (49k vocab) on CPU.
    """
    scaled = logits.float() if params.greedy else logits.float() / params.temperature
    shifted = scaled - scaled.amax(dim=-1, keepdim=True)
    weights = shifted.exp()
    log_normalizer = weights.sum(dim=-1).log()
    if params.greedy:
        tokens = shifted.argmax(dim=-1)
    else:
        if params.top_p < 1.0:
            weights = _top_p_filter(weights, params.top_p)
        tokens = _sample_proportional(weights, generator)
    logprobs = shifted.gather(-1, tokens[:, None]).squeeze(-1) - log_normalizer
    return tokens, logprobs


def _sample_proportional(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Index i with probability weights[i] / sum(weights), per row (weights >= 0, unnormalized).

    The CDF is summed in float64 so rounding over a large vocabulary neither shifts mass nor
    makes a zero-weight token reachable (`right` search skips its flat CDF step).
    """
    cdf = weights.double().cumsum(dim=-1)
    draw = torch.rand(
        (len(weights), 1), generator=generator, dtype=torch.float64, device=weights.device
    )
    draw = draw * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, draw, right=True).squeeze(-1)
    return tokens.clamp(max=weights.shape[-1] - 1)


def _top_p_filter(weights: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus; the most likely token always stays."""
    sorted_weights, order = weights.sort(dim=-1, descending=True)
    mass = sorted_weights.cumsum(dim=-1)
    mass_before = (mass - sorted_weights) / mass[:, -1:]
    sorted_weights = sorted_weights.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(weights).scatter(-1, order, sorted_weights)


def _copy(completion: Completion) -> Completion:
    return Completion(
        token_ids=list(completion.token_ids),
        logprobs=list(completion.logprobs),
        finish_reason=completion.finish_reason,
    )
