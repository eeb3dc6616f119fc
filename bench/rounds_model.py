"""`just rounds-model`: gradient rounds for bigger models, on paper, from measured costs.

    measured   bench/results/links.json "rounds" (`just bench-links-rounds`): per mode, the
               bytes one trainer sends per round over the bytes of its float32 trainable
               weights (SmolLM2-135M, full and LoRA: the wire's share, framing included);
               at 100 Mbit/s the line round_s = fixed_s + s_per_mb x MB sent, whose
               s_per_mb over the link's floor (8 / rate) is the wire's overhead. Other
               rates take the same overhead over their floor and the same fixed_s (a
               round's matchmaking and bookkeeping).
    assumed    models (Qwen2.5 0.5B, 7B, 32B; parameter counts from their configs), LoRA
               rank 8 on q/k/v/o (agentjet's default `model.lora_targets`), 2 trainers
               (each sends about its trainable bytes per round in hivemind's all-reduce
               of 2; with N trainers 2(N-1)/N of them), local steps as in the mode
    compute    one global step's forward and backward on one H100: 6 x params x tokens
               FLOPs for full fine-tuning, 4 x params x tokens for LoRA (no weight
               gradients of the base), over H100 SXM's 989 TFLOP/s dense bf16 (NVIDIA's
               datasheet) at an assumed 40% utilisation; tokens per global step: 64
               samples of 512 tokens (TOKENS_PER_STEP). 7B and 32B full fine-tuning do
               not fit one H100's memory with AdamW (16 bytes a parameter): their figure
               is the compute of the step wherever it runs, spread over several GPUs.

Prints a markdown table (docs/links.md, "Bigger models on paper") and writes
bench/results/rounds_model.json. Needs the rounds' results; measures nothing itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "links.json"

# name: (parameters, LoRA rank-8 q/k/v/o parameters: 8 x layers x sum of in + out sizes)
MODELS = {
    "0.5B": (494e6, 8 * 24 * (2 * (896 + 896) + 2 * (896 + 128))),
    "7B": (7.62e9, 8 * 28 * (2 * (3584 + 3584) + 2 * (3584 + 512))),
    "32B": (32.8e9, 8 * 64 * (2 * (5120 + 5120) + 2 * (5120 + 1024))),
}
H100_FLOPS = 989e12 * 0.40
TOKENS_PER_STEP = 64 * 512
LINKS = {"100mbit": 100.0, "1gbit": 1000.0}  # Mbit/s
# The modes of the table: (measured mode whose wire share is used, inner steps per round).
MODES = {
    "exact (fp32)": ("exact", 1),
    "fp16": ("fp16", 1),
    "uint8": ("uint8", 1),
    "local steps H=4, fp16": ("local_steps_fp16", 4),
    "local steps H=16, uint8": ("uint8", 16),
}


def compute_s(params: float, lora: bool) -> float:
    """One global step's forward and backward on one H100 (see the module docstring)."""
    return (4 if lora else 6) * params * TOKENS_PER_STEP / H100_FLOPS


def wire_share(cells: dict[str, Any], kind: str, mode: str) -> float | None:
    """Bytes a trainer sent per round over its float32 trainable bytes, measured for
    `kind` and `mode` on any link (the share does not depend on the link)."""
    for profile in ("100mbit", "1gbit", "loopback", "20mbit"):
        cell = cells.get(profile, {}).get(kind, {}).get(mode)
        if cell and cell.get("measured") and cell.get("bytes_per_round"):
            return float(cell["bytes_per_round"]) / float(cell["trainable_bytes"])
    return None


def table(rounds: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    cells, fit = rounds["cells"], rounds["per_byte"]["100mbit"]
    overhead = fit["s_per_mb"] / fit["floor_s_per_mb"]
    rows = []
    for model, (full, lora) in MODELS.items():
        for kind, params in (("full", full), ("lora", lora)):
            step = compute_s(full, lora=kind == "lora")
            for label, (mode, h) in MODES.items():
                share = wire_share(cells, kind, mode)
                if share is None:
                    continue
                mb = params * 4 * share / 1e6
                row: dict[str, Any] = {
                    "model": model,
                    "kind": kind,
                    "mode": label,
                    "mb_per_round": round(mb, 1),
                    "compute_s": round(step, 2),
                }
                for link, rate in LINKS.items():
                    s_per_mb = overhead * 8 / rate
                    row[link] = round((fit["fixed_s"] + s_per_mb * mb) / h, 2)
                rows.append(row)
    lines = [
        "| model | trained | mode | MB per round | wire s per global step, 100 Mbit/s "
        "| 1 Gbit/s | compute s (1 H100) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        marks = ["**" if r[link] > r["compute_s"] else "" for link in LINKS]
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['mode']} | {r['mb_per_round']:,.0f} "
            f"| {marks[0]}{r['100mbit']:,.1f}{marks[0]} | {marks[1]}{r['1gbit']:,.1f}{marks[1]} "
            f"| {r['compute_s']:.2f} |"
        )
    return rows, "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/rounds_model.json")
    args = parser.parse_args()
    rounds = json.loads(args.results.read_text()).get("rounds")
    if not rounds or "per_byte" not in rounds:
        print(f"no measured rounds in {args.results}: run `just bench-links-rounds` first")
        return 1
    if "100mbit" not in rounds["per_byte"]:
        print(f"no per-byte line for 100mbit in {args.results}")
        return 1
    rows, text = table(rounds)
    print(text)
    print("\n(bold: the wire takes longer than the step's compute: link-bound)")
    args.out.write_text(json.dumps({"rows": rows, "assumptions": __doc__}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
