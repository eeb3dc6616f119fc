"""Per-GPU health from NVML, for a role's metrics rows and its record in the swarm's directory.

    GpuMonitor.for_devices(["cuda:1", "cpu"]) ──▶ the CUDA indices the role uses: [1]
                                                  (none: a CPU role, NVML never touched)
    first sample() ── nvmlInit ── fails (no library, no driver) ──▶ one debug line, then [] for good
                               └─ CUDA index ──nvml_indices(CUDA_VISIBLE_DEVICES)──▶ NVML handle
    sample() ──▶ [GpuStats(index, name, util %, memory used/total MiB, power W, temperature C)]
        ├── metrics(stats) ──▶ {"gpu/1/util_pct": …, …} merged into the role's metrics row
        └── NodeRecord.gpus ──▶ the swarm's directory ──▶ `agentjet status --join`
    close() ──▶ nvmlShutdown (when nvmlInit succeeded)

This is the only module that imports `pynvml` (the `nvidia-ml-py` package). Where NVML is
absent (a CPU box, a container without the driver) a monitor reports nothing, without an
error or a warning; a board that does not report power or temperature leaves those None; a
GPU whose utilisation or memory cannot be read is left out of that sample.

CUDA numbers the devices it shows after CUDA_VISIBLE_DEVICES; NVML numbers every device of
the machine in PCI bus order. CUDA's default order (FASTEST_FIRST) is the PCI bus order on
machines whose GPUs are all alike, the usual case; with mixed GPUs set
CUDA_DEVICE_ORDER=PCI_BUS_ID so that both number the same boards alike.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from agentjet.protocol import GpuStats

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MIB = 2**20
# A CUDA_VISIBLE_DEVICES entry that names a device by index, or by UUID (or a unique
# prefix of one).
_INDEX = re.compile(r"[0-9]+")
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]*")


def cuda_indices(devices: Iterable[torch.device | str]) -> list[int]:
    """The CUDA indices among `devices` ("cuda" is device 0), in order, once each; CPU and
    other devices are ignored."""
    indices: list[int] = []
    for device in devices:
        kind, _, index = str(device).partition(":")
        if kind == "cuda":
            i = int(index) if index else 0
            if i not in indices:
                indices.append(i)
    return indices


def nvml_indices(cuda: Sequence[int], visible: str | None) -> list[int | str | None]:
    """For each CUDA index, the device NVML knows it as: its NVML index, or the UUID (or
    UUID prefix) CUDA_VISIBLE_DEVICES names it by; None when CUDA does not see that many.

    `visible` is CUDA_VISIBLE_DEVICES (None: unset, every device in order). As CUDA does,
    the list is read up to its first entry that is neither an index nor a UUID ("-1", say).
    """
    if visible is None:
        return list(cuda)
    entries: list[int | str] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if _INDEX.fullmatch(entry):
            entries.append(int(entry))
        elif _UUID.fullmatch(entry):
            entries.append(entry)
        else:
            break
    return [entries[i] if 0 <= i < len(entries) else None for i in cuda]


def metrics(stats: list[GpuStats]) -> dict[str, float]:
    """`stats` as metrics-row keys (`gpu/<cuda index>/util_pct`, …); what a GPU does not
    report is left out, and no GPUs give no keys."""
    row: dict[str, float] = {}
    for gpu in stats:
        values = {
            "util_pct": gpu.util_pct,
            "mem_used_mb": gpu.mem_used_mb,
            "mem_total_mb": gpu.mem_total_mb,
            "power_w": gpu.power_w,
            "temp_c": gpu.temp_c,
        }
        row |= {f"gpu/{gpu.index}/{key}": v for key, v in values.items() if v is not None}
    return row


class GpuMonitor:
    """See the module docstring. One per role; `sample()` at each metrics row or heartbeat
    (a few NVML calls per GPU, well under a millisecond each)."""

    def __init__(self, cuda: Sequence[int], visible: str | None = None) -> None:
        """`cuda`: the CUDA indices the role uses; `visible`: CUDA_VISIBLE_DEVICES (None:
        read from the environment now)."""
        self.cuda = list(cuda)
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        # "untried" until the first sample of a monitor with GPUs.
        self.state: Literal["untried", "ready", "unavailable"] = "untried"
        self._nvml: Any = None  # the pynvml module, once nvmlInit succeeded
        self._gpus: list[tuple[int, Any, str]] = []  # (CUDA index, NVML handle, name)
        self._failing: set[int] = set()  # CUDA indices whose last read failed

    @classmethod
    def for_devices(cls, devices: Iterable[torch.device | str]) -> GpuMonitor:
        """A monitor of the CUDA devices among `devices` (e.g. "cpu", "cuda:1")."""
        return cls(cuda_indices(devices))

    def sample(self) -> list[GpuStats]:
        """What each GPU of the role does now; [] without NVML or without GPUs. NVML's
        errors never escape."""
        if not self.cuda or self.state == "unavailable":
            return []
        if self.state == "untried":
            self._start()
            if self.state != "ready":
                return []
        stats = []
        for index, handle, name in self._gpus:
            gpu = self._read(index, handle, name)
            if gpu is not None:
                stats.append(gpu)
        return stats

    def close(self) -> None:
        """Release NVML (when it was initialised); the monitor reports nothing after."""
        if self.state == "ready":
            try:
                self._nvml.nvmlShutdown()
            except Exception as e:
                log.debug("nvmlShutdown failed: %r", e)
        self.state = "unavailable"
        self._gpus = []

    def _start(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, or NVMLError: no library, no driver, no GPU
            log.debug("NVML unavailable (%r): no GPU statistics from this node", e)
            self.state = "unavailable"
            return
        self._nvml = pynvml
        self.state = "ready"
        for index, device in zip(self.cuda, nvml_indices(self.cuda, self.visible), strict=True):
            handle = self._handle(device)
            if handle is None:
                log.debug("NVML does not know CUDA device %d (%r): left out", index, device)
                continue
            try:
                name = str(pynvml.nvmlDeviceGetName(handle))
            except pynvml.NVMLError:
                name = ""
            self._gpus.append((index, handle, name))

    def _handle(self, device: int | str | None) -> Any:
        nvml = self._nvml
        if device is None:
            return None
        try:
            if isinstance(device, int):
                return nvml.nvmlDeviceGetHandleByIndex(device)
            return nvml.nvmlDeviceGetHandleByUUID(device)
        except nvml.NVMLError:
            pass
        if isinstance(device, str):  # CUDA also takes a unique prefix of a GPU's UUID
            try:
                handles = [
                    nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())
                ]
                found = [h for h in handles if str(nvml.nvmlDeviceGetUUID(h)).startswith(device)]
            except nvml.NVMLError:
                return None
            if len(found) == 1:
                return found[0]
        return None

    def _read(self, index: int, handle: Any, name: str) -> GpuStats | None:
        nvml = self._nvml
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as e:
            if index not in self._failing:  # once per spell of failures, not every step
                log.debug("NVML cannot read CUDA device %d (%r): left out", index, e)
                self._failing.add(index)
            return None
        self._failing.discard(index)
        try:
            power_w: float | None = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except nvml.NVMLError:
            power_w = None
        try:
            temp_c: float | None = float(
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            )
        except nvml.NVMLError:
            temp_c = None
        return GpuStats(
            index=index,
            name=name,
            util_pct=float(util),
            mem_used_mb=memory.used / MIB,
            mem_total_mb=memory.total / MIB,
            power_w=power_w,
            temp_c=temp_c,
        )
