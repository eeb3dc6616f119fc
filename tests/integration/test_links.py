"""Delta versions over slow links, under faults, across network namespaces (8 Mbit/s each
way): two rollout nodes fetch a sealed version whole, then as a delta through each other's
relay while one relay flips a bit in every chunk it serves; a link cut mid-delta; a node
that missed ten versions. Every fetch must end with the trainer's exact bytes.

The processes are bench/links.py's (--faults): a trainer behind a node/publisher.py
Publisher with the swarm's keys, making each version's delta as node/trainer_versions.py
does, and rollout children fetching as node/policy_sync.py does (its `fetch_into`). The
bench reaps its children by PID; this test reaps the bench.
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
TIMEOUT_S = 3.0  # the nodes' request timeout: the cut lasts three of them


def test_deltas_survive_a_corrupt_relay_a_cut_link_and_ten_missed_versions(tmp_path):
    require_netns()
    out = tmp_path / "faults.json"
    argv = [sys.executable, str(ROOT / "bench" / "links.py"), "--faults", "--out", str(out)]
    argv += ["--mbytes", "8", "--rate-mbit", "8", "--chunk-kb", "256", "--nodes", "2"]
    argv += ["--timeout-s", str(TIMEOUT_S)]
    # (killed and reaped by subprocess.run if it runs past the timeout)
    bench = procs.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )
    assert bench.returncode == 0, bench.stdout[-3000:]
    result = json.loads(out.read_text())
    trials = {name: t for name, t in result.items() if name != "settings"}
    # every fetch ended with the trainer's bytes (sha256 of the whole version)
    assert all(t["exact"] for t in trials.values()), trials
    assert [t["form"] for t in trials.values()] == ["full", "delta", "delta", "full", "delta"]
    corrupt = trials["delta_past_a_corrupt_relay"]
    # the delta is a fraction of the version (about half its bf16 values changed)
    assert corrupt["fetched_bytes"] < 0.5 * corrupt["version_bytes"]
    # r1 refused what r2's relay served and took it from the trainer
    assert "does not unseal" in corrupt["nodes"]["r1"]["relay_failures"]["r2"]
    assert corrupt["nodes"]["r1"]["from_trainer"] > 0
    # r2's own fetch is sound: it only serves badly
    assert corrupt["nodes"]["r2"]["relay_failures"] == {}
    cut = trials["delta_across_a_cut"]
    # its requests went unanswered through the cut, and the fetch was done again
    assert cut["interrupted"]["r1"], cut
    assert cut["all_have_s"] > 3 * TIMEOUT_S
    # ten versions missed: the newest comes whole (its delta is from a version r1 lacks),
    # the next as a delta again
    assert trials["after_missing_ten"]["version"] - cut["version"] == 10
    assert trials["then_a_delta"]["fetched_bytes"] < trials["after_missing_ten"]["fetched_bytes"]
