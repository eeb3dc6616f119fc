"""Relays under faults, across network namespaces with rate-limited links: four rollout
nodes fetch a sealed version through each other's relays while one of them is SIGKILLed
mid-transfer and another serves every chunk with a bit flipped. Each node left standing
must end with the trainer's exact bytes.

The processes are bench/relay.py's (--faults): a trainer behind a node/publisher.py
Publisher with the swarm's keys, and rollout children doing what node/rollout.py does with
a version (node/relay.py fetch_relayed, a RelayServer on what it holds). The bench reaps
its children by PID; this test reaps the bench.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs
from tests.netns import require_netns

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]


def test_a_killed_relay_and_a_corrupting_one_cost_retries_never_a_wrong_weight(tmp_path):
    require_netns()
    out = tmp_path / "faults.json"
    argv = [sys.executable, str(ROOT / "bench" / "relay.py"), "--faults", "--out", str(out)]
    argv += ["--mbytes", "16", "--chunk-mb", "1", "--rate-mbit", "100"]
    bench = procs.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = bench.communicate(timeout=300)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, output[-3000:]
    result = json.loads(out.read_text())
    assert result["roles"] == {"r1": "", "r2": "killed", "r3": "corrupt", "r4": ""}
    trial = result["trial"]
    # the killed node was killed after it passed a chunk on, before it finished
    assert set(trial["exact"]) == {"r1", "r3", "r4"}
    assert all(trial["exact"].values()), trial  # the trainer's sha256, byte for byte
    assert result["ok"]
    for name in ("r1", "r4"):
        node = trial["nodes"][name]
        failures = node["relay_failures"]
        assert "does not unseal" in failures["r3"], failures  # every bad chunk refused
        assert "r2" in failures, failures
        assert node["from_relays"] > 0  # the relays that worked, worked
        assert node["from_relays"] + node["from_trainer"] == trial["num_chunks"]
    # the corrupting node's own fetch is sound: it only serves badly
    assert "r3" not in trial["nodes"]["r3"]["relay_failures"]
