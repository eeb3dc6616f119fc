"""`just bench-policies`: what several LoRA policies over one base cost a rollout node's
torch engine (issue 26): its memory with 1, 2 and 4 policies, and its sampling speed when
one batch mixes 4 policies' adapters against a batch of one policy.

    memory   a fresh process per count: TorchEngine on SmolLM2-135M (float32, CPU), then
             `load_adapters` for each policy (rank --rank on q/k/v/o_proj, random values:
             the cost does not depend on them), one mixed batch sampled; its RSS (VmHWM,
             the process's peak resident set) ──▶ "rss_mb": {"0", "1", "2", "4"} ("0": the
             engine without a bank, for reference)
    speed    one process, 4 policies loaded: --prompts arithmetic prompts x --samples
             samples x --new-tokens tokens (eos off: every row makes every token), each
             batch all one policy ("single") or the prompts dealt round-robin to the 4
             ("mixed"), alternated --repeats times; medians ──▶ "tokens_per_s" and
             "mixed_vs_single_tokens_per_s" (also "base": no adapters applied)

Targets (issue 26): rss_mb["4"] <= 1.2 x rss_mb["1"]; mixed_vs_single_tokens_per_s >= 0.8.
The engine is the rollout node's memory but for its sandboxes, ZMQ and Python (~0.3 GB,
the same for any number of policies). Results: bench/results/policies.json (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check import arithmetic_prompts  # noqa: E402
from learn import write_result  # noqa: E402

from agentjet.config import ModelConfig  # noqa: E402
from agentjet.episode import SamplingParams  # noqa: E402
from node.lora import random_adapters  # noqa: E402
from node.model import resolve_model  # noqa: E402
from node.torch_engine import TorchEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
NAMES = ("p0", "p1", "p2", "p3")


async def load(engine: TorchEngine, count: int, rank: int) -> None:
    lora = ModelConfig(lora_rank=rank, lora_alpha=rank, lora_targets=list(TARGETS))
    for i in range(count):
        adapters = random_adapters(engine.model, lora, seed=i, b_scale=0.01)
        await engine.load_adapters(NAMES[i], adapters, lora, 1)


def engine_for(args: argparse.Namespace) -> tuple[TorchEngine, list[list[int]]]:
    engine = TorchEngine(resolve_model("embedded:smollm2-135m"), seed=0, threads=args.threads)
    engine.eos_token_ids.clear()
    return engine, arithmetic_prompts(engine.tokenizer, args.prompts, seed=19)


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory_child(args: argparse.Namespace) -> None:
    """One count's engine: its peak RSS after loading and sampling a batch, as JSON."""
    engine, prompts = engine_for(args)
    count = args.child
    asyncio.run(load(engine, count, args.rank))
    policies = [NAMES[i % count] for i in range(len(prompts))] if count else None
    params = SamplingParams(max_new_tokens=args.new_tokens)
    asyncio.run(engine.generate(prompts, args.samples, params, policies))
    bank = engine.adapters.nbytes() if engine.adapters is not None else 0
    print(json.dumps({"rss_mb": round(peak_rss_mb()), "bank_mb": round(bank / 2**20, 2)}))


def speed(args: argparse.Namespace) -> dict:
    engine, prompts = engine_for(args)
    asyncio.run(load(engine, len(NAMES), args.rank))
    params = SamplingParams(max_new_tokens=args.new_tokens)
    arms = {
        "base": None,
        "single": [NAMES[0]] * len(prompts),
        "mixed": [NAMES[i % len(NAMES)] for i in range(len(prompts))],
    }
    asyncio.run(engine.generate(prompts, args.samples, params, arms["single"]))  # warm-up
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm, policies in arms.items():
            start = time.perf_counter()
            out = asyncio.run(engine.generate(prompts, args.samples, params, policies))
            tokens = sum(len(c.token_ids) for samples in out for c in samples)
            rates[arm].append(tokens / (time.perf_counter() - start))
            print(f"{arm}: {rates[arm][-1]:.0f} tokens/s", flush=True)
    return {arm: round(statistics.median(r), 1) for arm, r in rates.items()} | {
        "all": {arm: [round(x, 1) for x in r] for arm, r in rates.items()}
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "policies.json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        memory_child(args)
        return 0
    shared = [
        "--rank", str(args.rank), "--prompts", str(args.prompts), "--samples",
        str(args.samples), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
    ]  # fmt: skip
    memory = {}
    for count in (0, 1, 2, 4):
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(count), *shared],
            check=True, capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        memory[str(count)] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{count} policies: {memory[str(count)]}", flush=True)
    tokens = speed(args)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "model": "embedded:smollm2-135m (float32, CPU)",
        "rank": args.rank,
        "targets": list(TARGETS),
        "batch": {"prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens},
        "threads": args.threads,
        "rss_mb": {k: v["rss_mb"] for k, v in memory.items()},
        "bank_mb": {k: v["bank_mb"] for k, v in memory.items()},
        "rss_4_vs_1": round(memory["4"]["rss_mb"] / memory["1"]["rss_mb"], 3),
        "tokens_per_s": tokens,
        "mixed_vs_single_tokens_per_s": round(tokens["mixed"] / tokens["single"], 3),
        "single_vs_base_tokens_per_s": round(tokens["single"] / tokens["base"], 3),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
