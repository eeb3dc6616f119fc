"""The figures `just test-faults` collects in bench/results/faults.json.

The fault suite and the fuzz test each merge their own figures into the file that
AGENTJET_FAULTS_OUT names; without it (a plain `just test`) nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESULTS_ENV = "AGENTJET_FAULTS_OUT"


def merge_results(figures: dict[str, Any]) -> None:
    out = os.environ.get(RESULTS_ENV)
    if not out:
        return
    path = Path(out)
    current = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(current | figures, indent=2, sort_keys=True) + "\n")


def record_fuzz(target: str, inputs: int, crashed: bool) -> None:
    """One fuzzed endpoint's inputs and whether it stopped answering; keeps the totals."""
    out = os.environ.get(RESULTS_ENV)
    current = json.loads(Path(out).read_text()) if out and Path(out).exists() else {}
    targets = current.get("fuzz_targets", {}) | {target: {"inputs": inputs, "crashed": crashed}}
    merge_results(
        {
            "fuzz_targets": targets,
            "fuzz_inputs": sum(t["inputs"] for t in targets.values()),
            "fuzz_crashes": sum(t["crashed"] for t in targets.values()),
        }
    )
