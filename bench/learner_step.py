"""Where a trainer's time goes: one Learner.train_step of the default run's shape, timed.

    configs/local.toml's model (LoRA adapters when it trains them, its compute dtype)
    --groups arithmetic groups of 8 (the chat prompt; completions "a + b = c", rewards
    1, 0, 1, 0, ... so every sample carries gradient, as a group that teaches does)
    ──Learner.train_step, --steps times per setting──▶ seconds per step, trained tokens/s
    for each --micro (trainer.micro_batch_samples) × --attention (the model's attention
    kernel: "sdpa", transformers' default, or "eager") ──▶ bench/results/learner_step.json

One torch thread, as configs/local.toml gives the trainer. `--profile` adds the torch
profiler's top operations of one step of the first setting. The default run's steps
train 15-25 samples (bench/LOG.md, 2026-12-07 fourth): 3 groups of 8 is one of them.

Run: `just bench-learner-step`, machine idle.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agentjet import protocol  # noqa: E402
from agentjet.config import load_config  # noqa: E402
from agentjet.episode import Completion  # noqa: E402
from node.learner import Learner  # noqa: E402
from node.local_optimizer import LocalOptimizer  # noqa: E402
from node.lora import add_adapters  # noqa: E402
from node.model import DTYPES, load_causal_lm, resolve_model  # noqa: E402
from sandboxes.envs.chat import chat_prompt_ids  # noqa: E402
from tests.factories import groups_from_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE = 8


def make_groups(tokenizer, rng: random.Random, count: int, tag: str) -> list:
    """`count` groups of 2-digit sums, answers off by 0..7 (single-turn, as the env's)."""
    prompts, sampled = [], []
    for i in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        task = protocol.Task(
            id=f"{tag}-{i}",
            env="arithmetic",
            prompt=f"What is {a} + {b}? Answer with just the number.",
        )
        prompts.append(chat_prompt_ids(tokenizer, None, task))
        group = []
        for j in range(GROUP_SIZE):
            ids = tokenizer.encode(f"{a} + {b} = {a + b + j}", add_special_tokens=False)
            ids.append(int(tokenizer.eos_token_id))
            group.append(
                Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")
            )
        sampled.append(group)
    return groups_from_samples(prompts, sampled, tag)


def one_setting(args: argparse.Namespace, micro: int, attention: str, profiled: bool) -> dict:
    """Seconds per step of a fresh model and optimizer with this micro-batch and kernel;
    `profiled`: and the top operations of one more step."""
    # The logprob check off (as bench/gpu_check.py): the completions here were not sampled,
    # so their logprobs are made up, and a rejected group would be trained a second time.
    settings = [f"trainer.micro_batch_samples={micro}", "trainer.max_logprob_gap=0"]
    config = load_config(args.config, settings)
    compute = DTYPES[config.model.dtype]
    model, tokenizer = load_causal_lm(resolve_model(config.model.name), "float32")
    model.set_attn_implementation(attention)
    torch.manual_seed(0)
    if config.model.lora_rank:
        model = add_adapters(model, config.model)
    params = [p for p in model.parameters() if p.requires_grad]
    samples = args.groups * GROUP_SIZE
    optimizer = LocalOptimizer(
        params, lr=config.trainer.lr, weight_decay=0.0, target_batch_size=samples
    )
    pad = int(tokenizer.pad_token_id or 0)
    learner = Learner(model, optimizer, config.trainer, 1.0, pad, compute_dtype=compute)
    rng = random.Random(0)
    learner.train_step(make_groups(tokenizer, rng, args.groups, "warm"))
    seconds, tokens = [], 0
    for step in range(args.steps):
        groups = make_groups(tokenizer, rng, args.groups, f"s{step}")
        start = time.perf_counter()
        result = learner.train_step(groups)
        seconds.append(time.perf_counter() - start)
        tokens = int(result.metrics["charts/trained_tokens"])
    row = {
        "micro_batch_samples": micro,
        "attention": attention,
        "step_s_median": round(statistics.median(seconds), 3),
        "step_s": [round(s, 3) for s in seconds],
        "trained_tokens": tokens,
        "trained_tokens_per_s": round(tokens / statistics.median(seconds), 1),
    }
    if profiled:
        row["profile_top"] = profile_top(
            lambda: learner.train_step(make_groups(tokenizer, rng, args.groups, "profiled"))
        )
    return row


def profile_top(step: Callable[[], object], count: int = 8) -> list[dict]:
    """The operations of `step` that took the most of its CPU time, with their shares."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    return [{"op": e.key, "self_share": round(e.self_cpu_time_total / total, 3)} for e in top]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro", type=lambda v: [int(m) for m in v.split(",")], default=[8, 64])
    parser.add_argument("--attention", type=lambda v: v.split(","), default=["sdpa", "eager"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "learner_step.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict] = []
    for attention in args.attention:
        for micro in args.micro:
            rows.append(one_setting(args, micro, attention, profiled=args.profile and not rows))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile_top"}), flush=True)
    result = {
        "config": str(args.config.relative_to(ROOT))
        if args.config.is_relative_to(ROOT)
        else str(args.config),
        "groups": args.groups,
        "group_size": GROUP_SIZE,
        "machine": "1 torch thread",
        "date": time.strftime("%Y-%m-%d"),
        "settings": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
