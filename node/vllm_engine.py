"""The vLLM engine for real GPUs: same `Generator` interface and contract as the torch engine.

    prompts ──TokensPrompt──▶ (bridge thread) vllm.LLM.generate (n samples, per-request
        seeds, logprobs=0) ──▶ Completion(token ids, sampler logprobs, stop/length)
    trainer weights ──load_state_dict──▶ (bridge thread) collective_rpc("agentjet_load_weights")
        on every worker ──▶ model.load_weights ──▶ prefix cache reset ──▶ new policy version

The only module that imports vLLM, and only inside `VLLMEngine.__init__`/methods, so the rest of
the node imports on machines without it.

Written against the vLLM V1 offline API (0.10.1 and later: `logprobs_mode` arrived in 0.10.1),
read from vLLM's sampler and `ParentRequest` sources, never run on the CPU-only box it was
written on; tests/gpu/test_vllm_engine.py runs the engine contract on a lent GPU:

- `logprobs_mode="processed_logprobs"` makes the reported logprob the log-softmax of the logits
  after temperature, i.e. agentjet's sampler logprob `log_softmax(logits / T)[token]`
  (greedy: T = 1). The default `raw_logprobs` ignores the temperature. vLLM's "processed"
  values are taken after top-k/top-p masking, which agentjet does not want (the trainer
  recomputes the untruncated tempered distribution), so this engine refuses top_p < 1.
- Reproducibility comes from per-request seeds drawn from the engine's seed: vLLM gives the
  n children of a request `seed + index`, so request seeds are spaced `MAX_SAMPLES_PER_PROMPT`
  apart and never share a random stream.
- The interface is asynchronous (`await generate`, `await load_state_dict`, one at a time),
  but what runs behind it is vLLM's offline, blocking `LLM`, called across the one bridge to
  a thread (agentjet/bridge.py): a batch is decoded whole, and requests of the next batch
  wait for it, as with the torch engine. vLLM's own `AsyncLLM` would let requests join a
  running batch; it is not used because nothing here could run it (no GPU where this was
  written).
- A LoRA policy's versions load as adapters (`lora` given: `enable_lora`): each version is
  written as a PEFT adapter folder (node/lora.py) and added under its own LoRA id with
  `llm_engine.add_lora`; batches are sampled with that `LoRARequest`, and the previous
  version's adapter is removed. The base weights are never touched.
- Several policies over one base (`policy_loras`, issue 26): `load_adapters(policy, ...)`
  adds a policy's version the same way, under a LoRA name and id new to each version, and
  `generate(..., policies=[...])` passes one `LoRARequest` per prompt: vLLM batches rows of
  different adapters together (its punica kernels). vLLM keys cached prefix blocks by the
  LoRA's name or id, so a new version needs no prefix cache reset, and the other policies'
  cached prefixes stay.
- Full-weight reload goes through a worker extension (`worker_extension_cls`) and
  `LLM.collective_rpc`, the path vLLM's own RLHF examples use; tensors travel to the worker
  process serialized, so this suits models up to a few GB. Tied `lm_head.weight` is skipped by
  vLLM's Llama loader. The prefix cache holds KV computed with the old weights and is reset.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from agentjet.config import ModelConfig
from agentjet.devices import check_fits
from agentjet.episode import Completion, SamplingParams
from node.engine_base import BridgedEngine, check_request, check_state_dict
from node.lora import adapter_pairs, write_adapter
from node.model import DTYPES, eos_token_ids, load_causal_lm, load_tokenizer

# The extension class vLLM mixes into its GPU worker, imported by name in the worker process.
WORKER_EXTENSION = "node.vllm_engine.WeightLoaderExtension"
# Children of one request use seeds base .. base + n - 1 (vLLM); bases are spaced this far.
MAX_SAMPLES_PER_PROMPT = 1024
# The LoRA ranks vLLM accepts as `max_lora_rank`; a policy's rank is rounded up to one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class WeightLoaderExtension:
    """Methods vLLM adds to its worker class; `self` is the worker (it has `model_runner`)."""

    model_runner: Any

    def agentjet_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # HF-named tensors; the model's loader maps them onto its fused qkv/gate_up layout.
        self.model_runner.model.load_weights(weights=weights)


class VLLMEngine(BridgedEngine):
    """An `Engine` on vLLM's in-process `LLM`, with weight reloads between policy versions.

    `state_dict()` is a CPU copy of the current weights under their HF names (what trainers
    publish), kept because vLLM stores fused, renamed tensors; it costs one model's worth of
    host memory. With `lora`, they stay the base weights and versions are adapters.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        device: torch.device | str = "cuda:0",
        lora: ModelConfig | None = None,
        policy_loras: Sequence[ModelConfig] = (),
    ) -> None:
        """`gpu_memory_utilization` (rollout.gpu_memory_share) defaults to half the GPU so a
        trainer fits beside it; `enforce_eager` skips CUDA graph capture (faster start,
        slower decode: tests). `device` cuda:N runs vLLM's engine process on GPU N: it sees
        that GPU alone (CUDA_VISIBLE_DEVICES, which vLLM reads when it starts its worker).
        `lora` (the model config of a LoRA policy): versions load as adapters.
        `policy_loras`: the model configs of the policies whose adapters `load_adapters`
        will take (vLLM sizes its LoRA slots and ranks when it starts)."""
        from vllm import LLM

        super().__init__()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"the vLLM engine runs on CUDA GPUs, not {self.device}")
        if self.device.index:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else [str(i) for i in range(self.device.index + 1)]
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[self.device.index]
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (allowed: {', '.join(DTYPES)})")
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size: int = AutoConfig.from_pretrained(str(model_path)).vocab_size
        self.eos_token_ids: set[int] = eos_token_ids(model_path, self.tokenizer)
        self._dtype = DTYPES[dtype]
        self._state = load_causal_lm(model_path, dtype)[0].state_dict()
        weights = sum(t.numel() * t.element_size() for t in self._state.values())
        share_key = "rollout.gpu_memory_share"
        check_fits("the vLLM engine", weights, self.device, gpu_memory_utilization, share_key)
        self._seeds = random.Random(seed)
        self._lora_config = lora
        self.takes_adapters = lora is not None
        # The LoRARequest of each policy's version loaded (None: `lora`'s single policy).
        self._adapters: dict[str | None, Any] = {}
        self._next_lora_id = 1
        self.policy_versions: dict[str, int] = {}
        self._policy_slots = len(policy_loras)
        self._adapter_dirs = tempfile.TemporaryDirectory(prefix="agentjet-lora-")
        loras = [*([lora] if lora is not None else []), *policy_loras]
        lora_args: dict[str, Any] = {}
        if loras:
            largest = max(c.lora_rank for c in loras)
            rank = min(r for r in VLLM_LORA_RANKS if r >= largest)
            lora_args = {
                "enable_lora": True,
                "max_lora_rank": rank,
                "max_loras": len(loras),
                # a version is added before the one it replaces is removed
                "max_cpu_loras": len(loras) + 1,
            }
        self._llm = LLM(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            # A GRPO group is n samples of one prompt, and agent turns extend the last one.
            enable_prefix_caching=True,
            **lora_args,
        )

    async def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        policies: Sequence[str | None] | None = None,
    ) -> list[list[Completion]]:
        """`n` completions per prompt; result[i][j] is sample j of prompt i.

        Same meaning as `TorchEngine.generate`: token ids as sampled, each with
        `log_softmax(logits / T)[token]` (T = 1 when greedy), ending at an eos id (kept,
        "stop") or after max_new_tokens ("length"); `policies[i]` names the policy whose
        adapters (`load_adapters`) sample prompt i (None: the base weights). Checked here,
        decoded across the bridge.
        """
        check_request(prompts, n, params)
        if policies is not None:
            if len(policies) != len(prompts):
                raise ValueError(f"{len(policies)} policies for {len(prompts)} prompts")
            unknown = sorted({p for p in policies if p is not None and p not in self._adapters})
            if unknown:
                raise ValueError(f"no adapters for policy {', '.join(map(repr, unknown))} here")
        if n > MAX_SAMPLES_PER_PROMPT:
            raise ValueError(f"n must be <= {MAX_SAMPLES_PER_PROMPT}, got {n}")
        if params.top_p < 1.0 and not params.greedy:
            raise ValueError(
                "the vLLM engine needs top_p = 1: vLLM reports logprobs after top-p "
                "truncation, the trainer needs them before (set rollout.sampling.top_p = 1)"
            )
        if not prompts:
            return []
        return await self._exclusive(self._generate, prompts, n, params, policies)

    def _generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        policies: Sequence[str | None] | None = None,
    ) -> list[list[Completion]]:
        """`generate`'s blocking body (a bridge thread; checked requests only)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        sampling = [
            VllmSamplingParams(
                # Greedy samples are identical: decode one and copy it.
                n=1 if params.greedy else n,
                temperature=0.0 if params.greedy else params.temperature,
                top_p=1.0,
                max_tokens=params.max_new_tokens,
                logprobs=0,
                stop_token_ids=sorted(self.eos_token_ids),
                seed=self._seeds.getrandbits(30) * MAX_SAMPLES_PER_PROMPT,
                detokenize=False,
            )
            for _ in prompts
        ]
        adapter: Any = self._adapters.get(None)
        if policies is not None:  # one LoRARequest (or None) per prompt
            adapter = [None if p is None else self._adapters[p] for p in policies]
        outputs = self._llm.generate(
            requests, sampling_params=sampling, use_tqdm=False, lora_request=adapter
        )
        results = []
        for output in outputs:
            if params.greedy:
                results.append([_completion(output.outputs[0]) for _ in range(n)])
            else:
                results.append([_completion(sample) for sample in output.outputs])
        return results

    async def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a new policy version into every worker (full weights; adapter tensors when
        `takes_adapters`); checked first, like the torch engine, then loaded across the
        bridge once no decode is running."""
        if self.takes_adapters:
            adapter_pairs(state, self._state)
        else:
            check_state_dict(self._state, state)
        if self.takes_adapters:
            assert self._lora_config is not None
            lora = self._lora_config
            await self._load_version(version, self._swap_adapter, None, state, lora, version)
        else:
            self._state = await self._load_version(version, self._load_weights, state)

    async def load_adapters(
        self, policy: str, adapters: Mapping[str, torch.Tensor], lora: ModelConfig, version: int
    ) -> None:
        """Take a version of `policy`'s LoRA adapters (one of `policy_loras`); the other
        policies' stay. Checked first (ValueError), loaded once no decode is running."""
        adapter_pairs(adapters, self._state)
        if policy not in self.policy_versions and len(self.policy_versions) >= self._policy_slots:
            raise ValueError(f"this engine was started for {self._policy_slots} policies")
        await self._exclusive(self._swap_adapter, policy, adapters, lora, version)
        self.policy_versions[policy] = version  # still in its turn (`_exclusive`)

    def _swap_adapter(
        self,
        policy: str | None,
        adapters: Mapping[str, torch.Tensor],
        lora: ModelConfig,
        version: int,
    ) -> None:
        """A version's adapters (blocking, a bridge thread): written as a PEFT folder and
        added under a LoRA name and id new to it; the policy's previous version removed."""
        from vllm.lora.request import LoRARequest

        name = f"{policy or 'policy'}-v{version}-{self._next_lora_id}"
        folder = Path(self._adapter_dirs.name) / name
        write_adapter(adapters, self._state, lora, folder)
        new = LoRARequest(name, self._next_lora_id, str(folder))
        self._next_lora_id += 1
        self._llm.llm_engine.add_lora(new)
        old = self._adapters.get(policy)
        self._adapters[policy] = new
        if old is not None:
            self._llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _load_weights(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`load_state_dict`'s blocking body (a bridge thread): the CPU copy it loaded."""
        weights = {key: tensor.detach().to("cpu", self._dtype) for key, tensor in state.items()}
        self._llm.collective_rpc("agentjet_load_weights", args=(list(weights.items()),))
        self._llm.reset_prefix_cache()
        return weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights last loaded, by HF name (a CPU copy, see the class docstring)."""
        return dict(self._state)


def _completion(sample: Any) -> Completion:
    """A vLLM `CompletionOutput` (logprobs=0: one {token: Logprob} per position) as ours."""
    token_ids = list(sample.token_ids)
    logprobs = [
        float(position[token].logprob)
        for token, position in zip(token_ids, sample.logprobs, strict=True)
    ]
    if sample.finish_reason == "stop":
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason="stop")
    if sample.finish_reason == "length":
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason="length")
    raise RuntimeError(f"vLLM ended a request with finish_reason={sample.finish_reason!r}")
