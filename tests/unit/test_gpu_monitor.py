"""GPU statistics from NVML: quiet absence without a driver, the CUDA-to-NVML device mapping,
the metrics keys, the directory record's `gpus` and their column in `agentjet status`."""

from __future__ import annotations

import logging
import warnings

import msgspec
import pytest
import torch

from agentjet import protocol
from agentjet.protocol import GpuStats, NodeRecord
from agentjet_app.cli_status import format_swarm
from node.gpu_monitor import GpuMonitor, cuda_indices, metrics, nvml_indices

pytestmark = pytest.mark.unit

H200 = GpuStats(
    index=0,
    name="NVIDIA H200",
    util_pct=87.0,
    mem_used_mb=30822.4,  # 30.1 GiB
    mem_total_mb=143771.0,  # 140.4 GiB
    power_w=312.4,
    temp_c=64.0,
)
# A board that reports neither power nor temperature.
QUIET = GpuStats(index=3, name="X", util_pct=5.0, mem_used_mb=1024.0, mem_total_mb=81920.0)


def test_a_gpu_role_samples_each_step_without_warnings(caplog: pytest.LogCaptureFixture):
    """Without an NVIDIA driver (this project's CPU boxes) every sample is empty, NVML says so
    once at debug level and never warns; on a GPU machine the role's GPU is reported."""
    caplog.set_level(logging.DEBUG, logger="node.gpu_monitor")
    monitor = GpuMonitor.for_devices(["cuda:0"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = [monitor.sample() for _ in range(50)]
    state = monitor.state
    monitor.close()
    assert caught == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    if torch.cuda.is_available():
        assert state == "ready"
        for stats in samples:
            assert [gpu.index for gpu in stats] == [0]
            assert 0 <= stats[0].util_pct <= 100
            assert 0 < stats[0].mem_used_mb <= stats[0].mem_total_mb
        assert "gpu/0/mem_total_mb" in metrics(samples[-1])
    else:
        assert state == "unavailable"
        assert samples == [[]] * 50 and metrics([]) == {}
        unavailable = [r for r in caplog.records if "NVML unavailable" in r.getMessage()]
        assert len(unavailable) == 1 and unavailable[0].levelno == logging.DEBUG


def test_a_cpu_role_never_starts_nvml():
    monitor = GpuMonitor.for_devices(["cpu", torch.device("cpu")])
    assert monitor.cuda == []
    assert monitor.sample() == [] and monitor.sample() == []
    assert monitor.state == "untried"
    monitor.close()
    assert monitor.sample() == []


def test_cuda_indices_keep_cuda_devices_once_in_order():
    devices: list[torch.device | str] = [
        "cpu",
        "cuda:2",
        torch.device("cuda:1"),
        "cuda",
        "cuda:2",
        "meta",
    ]
    assert cuda_indices(devices) == [2, 1, 0]


@pytest.mark.parametrize(
    ("cuda", "visible", "nvml"),
    [
        ([0, 1], None, [0, 1]),  # unset: every device, in order
        ([1], "2,3", [3]),
        ([0, 1, 2], "2,3", [2, 3, None]),  # CUDA sees two devices only
        ([0], "", [None]),  # set but empty: no device
        ([0, 1], " 3 , 1", [3, 1]),
        ([0, 1], "1,-1,0", [1, None]),  # CUDA stops reading at the first invalid entry
        ([0, 1], "0,foo,1", [0, None]),
        (
            [1, 0],
            "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6,GPU-0a1b",
            ["GPU-0a1b", "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"],
        ),
        (
            [0],
            "MIG-5f2c1a4e-9f0b-5d6e-8a7b-1c2d3e4f5a6b",
            ["MIG-5f2c1a4e-9f0b-5d6e-8a7b-1c2d3e4f5a6b"],
        ),
    ],
)
def test_cuda_visible_devices_maps_cuda_indices_to_nvml_devices(cuda, visible, nvml):
    assert nvml_indices(cuda, visible) == nvml


def test_metrics_flatten_each_gpu_and_skip_what_it_does_not_report():
    assert metrics([H200, QUIET]) == {
        "gpu/0/util_pct": 87.0,
        "gpu/0/mem_used_mb": 30822.4,
        "gpu/0/mem_total_mb": 143771.0,
        "gpu/0/power_w": 312.4,
        "gpu/0/temp_c": 64.0,
        "gpu/3/util_pct": 5.0,
        "gpu/3/mem_used_mb": 1024.0,
        "gpu/3/mem_total_mb": 81920.0,
    }
    assert metrics([]) == {}


def test_node_record_carries_its_gpus_and_older_records_decode_without():
    record = NodeRecord(node_id="t1", role="trainer", gpus=[H200, QUIET])
    decoded = protocol.node_record_decoder.decode(protocol.encode(record))
    assert decoded == record and decoded.gpus[1].power_w is None
    older = msgspec.msgpack.encode({"node_id": "r1", "role": "rollout", "policy_version": 3})
    assert protocol.node_record_decoder.decode(older).gpus == []


def test_status_shows_each_gpu_on_its_own_line_and_a_dash_without():
    records = [
        NodeRecord(node_id="r1", role="rollout", maddrs=["/ip4/10.0.0.2"], time=9.0),
        NodeRecord(
            node_id="t1",
            role="trainer",
            endpoint="tcp://10.0.0.1:5555",
            policy_version=12,
            queue=2,
            capacity=8,
            samples_per_s=10.0,
            time=9.5,
            gpus=[H200, QUIET],
        ),
    ]
    lines = format_swarm(records, now=10.0).splitlines()
    assert lines == [
        "swarm: 0 coordinator, 1 trainer, 1 rollout",
        "role     node              address  version  queue  samples/s  heartbeat  gpus",
        "trainer    t1  tcp://10.0.0.1:5555       12    2/8      10.00  0.5 s ago"
        "  0: 87% 30.1/140.4 GiB 312 W 64C",
        " " * lines[2].index("0:") + "3: 5% 1.0/80.0 GiB",  # the trainer's second GPU
        "rollout    r1        /ip4/10.0.0.2        0    0/0       0.00  1.0 s ago  -",
    ]
