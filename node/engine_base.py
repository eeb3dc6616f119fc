"""What the inference engines share (node/torch_engine.py, node/vllm_engine.py): one call at
a time across the bridge, and the checks that make them refuse the same requests alike.

    await generate / load_state_dict / load_adapters (checked on the loop)
        ──▶ BridgedEngine._exclusive: the engine's lock (`Exclusive`), then
            agentjet/bridge.py `blocking` ──▶ the blocking body in a bridge thread
        ◀── its result, on the loop; the next call waiting for the lock starts after

An EngineError (the engine is gone: vLLM's engine core died) is kept as `failure` and
raised by every later call, before it crosses the bridge.

A decode and a weight load share the weights (and the torch engine's random generator, the
vLLM engine's offline `LLM`, which is not reentrant), so they never overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ParamSpec, TypeVar

import torch

from agentjet.bridge import Exclusive, blocking
from agentjet.episode import SamplingParams
from agentjet.errors import EngineError

P = ParamSpec("P")
T = TypeVar("T")


class BridgedEngine:
    """An engine's blocking work run one call at a time, each across the bridge, with the
    policy version its samples are tagged with."""

    def __init__(self) -> None:
        self.policy_version: int = 0
        # One decode or weight load at a time: they share the weights.
        self._busy = Exclusive()
        # The EngineError that ended this engine (vLLM's engine core died), raised again by
        # every later call: whoever met it first (an environment, or an agent's call
        # through the OpenAI endpoint), the rollout node sees it after the batch.
        self.failure: EngineError | None = None

    def close(self) -> None:
        """Nothing to stop: an engine that starts processes overrides it."""

    async def _exclusive(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` in a bridge thread, once every call before it has ended.

        It returns to the caller before any call waiting behind it starts (the lock is let
        go without yielding to the loop), so what the caller does next on the loop, before
        its next await, is still done in its turn."""
        async with self._busy.hold():
            return await self._unless_failed(fn, *args, **kwargs)

    async def _load_version(
        self, version: int, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`_exclusive` for a new policy version: samples are tagged `version` once `fn`
        has run, before any call waiting behind it starts."""
        async with self._busy.hold():
            result = await self._unless_failed(fn, *args, **kwargs)
            self.policy_version = version  # on the loop, before any waiting decode starts
            return result

    async def _unless_failed(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn` across the bridge, unless the engine has failed: its EngineError, kept."""
        if self.failure is not None:
            raise self.failure
        try:
            return await blocking(fn, *args, **kwargs)
        except Exception as e:
            self.failure = self._engine_error(e)
            if self.failure is None or self.failure is e:
                raise
            raise self.failure from None

    def _engine_error(self, error: Exception) -> EngineError | None:
        """`error` as the EngineError that ends this engine when it says the engine is gone,
        else None (a bad request, say: the engine serves on). An engine whose inference runs
        in processes of its own overrides it to name their death."""
        return error if isinstance(error, EngineError) else None


def check_request(prompts: list[list[int]], n: int, params: SamplingParams) -> None:
    """Refuse requests no engine can serve; shared by the engines so they fail alike."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if not params.greedy and params.temperature <= 0:
        raise ValueError(f"temperature must be > 0 (or greedy=True), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")


def check_state_dict(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first key where `state` does not fit the model's `own`."""
    missing = sorted(own.keys() - state.keys())
    if missing:
        raise ValueError(f"state dict lacks {missing[0]!r} ({len(missing)} keys missing)")
    unexpected = sorted(state.keys() - own.keys())
    if unexpected:
        raise ValueError(f"state dict has unexpected key {unexpected[0]!r}")
    for key, tensor in state.items():
        if tensor.shape != own[key].shape:
            raise ValueError(
                f"{key!r} has shape {tuple(tensor.shape)}, the model needs {tuple(own[key].shape)}"
            )
