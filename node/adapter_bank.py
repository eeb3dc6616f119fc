"""Many LoRA adapters over one base model, chosen per row of a batch (issue 26: policies
that share a base model share one copy of it on a rollout node).

    engine model ──AdapterBank(model)──▶ a forward hook on each Linear an adapter targets:
        y = W0·x + B[p]·(A[p]·x)        p: the row's slot, B[p] pre-scaled by alpha / rank
    bank.put("planner", tensors, scale, version)  ──▶ that policy's slot replaced, others
                                                       untouched
    with bank.rows(slots): model(...)       ──▶ one forward, every row its own adapter

Per layer, the slots' A and B are stacked ([slots, rank, in] and [slots, out, rank], ranks
zero-padded to the bank's largest): a batch gathers its rows' adapters and runs two batched
matmuls per layer, the segmented LoRA of S-LoRA and Punica in its plainest form, not a loop
over adapters. Slot 0 is all zeros: rows that use the base weights alone. Hooks, not wrapped
modules, so the model's parameter names (and full-weight loads) stay as they were.

The adapter tensors are a version's, in peft's names (`node/lora.py`), checked against the
base weights before anything changes: a wrong key, pair or shape raises ValueError and leaves
every slot as it was.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from node.lora import adapter_pairs


class _Layer:
    """One targeted Linear's stacked adapters."""

    def __init__(self, linear: torch.nn.Linear, slots: int) -> None:
        out_features, in_features = linear.weight.shape
        weight = linear.weight
        self.a = weight.new_zeros((slots, 0, in_features))
        self.b = weight.new_zeros((slots, out_features, 0))


class AdapterBank:
    """LoRA adapters of several policies on one model, applied per row."""

    def __init__(self, model: torch.nn.Module) -> None:
        # Every Linear an adapter may target, by its weight's HF name; hooked when one does.
        self._linears = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
        self._base = {name + ".weight": m.weight for name, m in self._linears.items()}
        self._layers: dict[str, _Layer] = {}
        self._hooks: list[Any] = []
        self._slot_count = 1  # slot 0: no adapters
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self.versions: dict[str, int] = {}
        self._index: torch.Tensor | None = None

    @property
    def policies(self) -> list[str]:
        return sorted(self._slots)

    def put(
        self, policy: str, adapters: Mapping[str, torch.Tensor], scale: float, version: int
    ) -> None:
        """Take `policy`'s adapters (peft names; B is multiplied by `scale`, lora_alpha /
        lora_rank) into its slot, a new one for a new policy; other slots are untouched.
        Layers the adapters leave out run the base weights for this policy."""
        pairs = adapter_pairs(adapters, self._base)
        rank = max((a.shape[0] for a, _ in pairs.values()), default=0)
        slot = self._slots.get(policy)
        if slot is None:
            slot = self._free.pop() if self._free else self._slot_count
            self._slot_count = max(self._slot_count, slot + 1)
        for module in pairs.keys() - self._layers.keys():  # first adapter on this layer
            layer = self._layers[module] = _Layer(self._linears[module], self._slot_count)
            self._hooks.append(self._linears[module].register_forward_hook(self._hook(layer)))
        for layer in self._layers.values():
            if slot == layer.a.shape[0]:  # a new slot at the end
                layer.a = torch.cat([layer.a, torch.zeros_like(layer.a[:1])])
                layer.b = torch.cat([layer.b, torch.zeros_like(layer.b[:1])])
            if rank > layer.a.shape[1]:  # pad every slot up to the new largest rank
                grow = rank - layer.a.shape[1]
                layer.a = torch.nn.functional.pad(layer.a, (0, 0, 0, grow))
                layer.b = torch.nn.functional.pad(layer.b, (0, grow))
            layer.a[slot].zero_()
            layer.b[slot].zero_()
        for module, (a, b) in pairs.items():
            layer = self._layers[module]
            r = a.shape[0]
            layer.a[slot, :r] = a.to(layer.a.dtype)
            layer.b[slot, :, :r] = (b.float() * scale).to(layer.b.dtype)
        self._slots[policy] = slot
        self.versions[policy] = version

    def remove(self, policy: str) -> None:
        """Drop `policy`'s adapters; its slot is reused by the next new policy."""
        slot = self._slots.pop(policy)
        del self.versions[policy]
        for layer in self._layers.values():
            layer.a[slot].zero_()
            layer.b[slot].zero_()
        self._free.append(slot)

    def slots(self, policies: Sequence[str | None]) -> torch.Tensor:
        """Each row's slot (None: the base weights). ValueError for a policy not here."""
        unknown = sorted({p for p in policies if p is not None and p not in self._slots})
        if unknown:
            raise ValueError(f"no adapters for policy {', '.join(map(repr, unknown))} here")
        device = next(iter(self._base.values())).device
        return torch.tensor([0 if p is None else self._slots[p] for p in policies], device=device)

    @contextmanager
    def rows(self, slots: torch.Tensor) -> Iterator[None]:
        """Forwards inside apply slot `slots[i]` to batch row i."""
        self._index = slots
        try:
            yield
        finally:
            self._index = None

    def close(self) -> None:
        """Remove the hooks: the model computes with its base weights alone again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self._layers.values() for t in (layer.a, layer.b))

    def _hook(self, layer: _Layer) -> Any:
        def add_adapters(_module: Any, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> Any:
            index = self._index
            if index is None or layer.a.shape[1] == 0:
                return None  # no rows chosen, or no adapter anywhere: the output as it is
            x = inputs[0]
            if x.shape[0] != index.shape[0]:
                raise ValueError(f"a batch of {x.shape[0]} rows, slots for {index.shape[0]}")
            a, b = layer.a[index], layer.b[index]  # [rows, rank, in], [rows, out, rank]
            return y + torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))

        return add_adapters
