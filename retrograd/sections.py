"""The sections of a run configuration: one dataclass per TOML table, each key with its default,
its help text and its constraints (`opt`). retrograd.config reads TOML into them and validates;
`retrograd --help`-style listings come from the same metadata.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ALGORITHMS = ("sft", "grpo", "ppo", "distill", "preference", "agent_grpo")
#: LoRA targets; the config layer cannot load the C library, so a test checks these equal native.TARGETS
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
#: [training].matmul_precision's values; a test checks each is a route of native.MATMUL_ROUTES. The plain
#: ones leave the kernel to the CPU, the others force one (the names `retrograd preflight` prints)
MATMUL_PRECISIONS = ("auto", "bf16", "f16", "native", "amx-bf16", "avx512-bf16", "avx2-f16", "ggml-bf16", "ggml-f16")
#: experiment trackers [run].report_to accepts, each installed by the extra of the same name
TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")


def opt(default: Any = None, help: str = "", *, choices: tuple = (), min: float | None = None,
        max: float | None = None, path: bool = False, tables: bool = False) -> Any:
    meta = {"help": help, "choices": choices, "min": min, "max": max, "path": path, "tables": tables}
    if isinstance(default, list):
        return field(default_factory=functools.partial(list, default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelSection:
    path: Path | None = opt(None, "GGUF model; omitted means the embedded default model", path=True)
    ctx: int = opt(2048, "context length for generation and the longest training sequence", min=16)
    chat_template: str | None = opt(None, "Jinja chat template overriding the model's own")
    threads: int = opt(0, "CPU threads for generation (0: all cores)", min=0)
    device: str = opt("auto", "auto, cpu or gpu", choices=("auto", "cpu", "gpu"))


@dataclass
class LoraSection:
    rank: int = opt(16, "LoRA rank", min=1, max=4096)
    alpha: float = opt(32.0, "LoRA alpha; the update is scaled by alpha / rank (rslora: alpha / sqrt(rank))",
                       min=0.0)
    scaling: str = opt("standard", "standard (alpha / rank) or rslora (alpha / sqrt(rank)); the exported adapter "
                                   "carries the effective alpha", choices=("standard", "rslora"))
    dropout: float = opt(0.0, "LoRA dropout on the adapter's input while training (sft and distill; 0: off)",
                         min=0.0, max=0.9)
    variant: str = opt("lora", "lora, or dora (a learned magnitude per output row; sft, distill and preference; "
                               "exported as adapter.gguf for retrograd and merged.gguf for llama.cpp)",
                       choices=("lora", "dora"))
    merged_format: str = opt("f16", "dora: how merged.gguf stores the merged weights: f16 (faithful), q8_0 (half "
                                    "the size) or base (each weight's own type; a 4-bit grid loses most of the change)",
                             choices=("f16", "q8_0", "base"))
    targets: list = opt(list(TARGETS), "projections that get an adapter: q k v o gate up down")
    init_adapter: Path | None = opt(None, "start from this llama.cpp LoRA GGUF", path=True)


@dataclass
class RunSection:
    algorithm: str = opt("sft", "training algorithm", choices=ALGORITHMS)
    name: str = opt("", "run name (default: the config file's name)")
    output: Path | None = opt(None, "run directory (default: runs/<name> beside the config)", path=True)
    seed: int = opt(0, "seed for initialisation, data order and sampling", min=0)
    report_to: list = opt([], "experiment trackers that also get the run's metrics, configuration and final adapter: "
                              "tensorboard, mlflow, wandb, trackio (each installed by the extra of its name, "
                              "pip install 'retrograd[mlflow]'; docs/trackers.md)")


@dataclass
class DataSection:
    train: Path | None = opt(None, "training data, JSONL", path=True)
    format: str = opt("auto", "record format", choices=("auto", "text", "chat", "prompt_completion", "tools"))
    max_length: int = opt(1024, "longer examples are truncated to this many tokens", min=8)
    packing: bool = opt(True, "pack several short examples into one micro-batch")
    eval_split: float = opt(0.0, "fraction of the training data held out for evaluation", min=0.0, max=0.5)
    skip_bad_lines: bool = opt(False, "skip malformed lines (counted and reported) instead of stopping")
    shuffle: bool = opt(True, "shuffle the training examples every epoch")


@dataclass
class TrainingSection:
    epochs: float = opt(1.0, "passes over the training data (ignored when max_steps > 0)", min=0.0)
    max_steps: int = opt(0, "optimizer steps; 0 means derive from epochs", min=0)
    batch_size: int = opt(8, "sequences per optimizer step (before grad_accum)", min=1)
    batch_tokens: int = opt(0, "if > 0, batches are cut by this many tokens instead of batch_size", min=0)
    micro_batch_tokens: int = opt(512, "tokens per forward/backward pass (memory knob)", min=16)
    grad_accum: int = opt(1, "batches accumulated per optimizer step", min=1)
    learning_rate: float = opt(2e-4, "peak learning rate", min=0.0)
    lr_schedule: str = opt("cosine", "decay after warm-up", choices=("cosine", "linear", "constant"))
    warmup_steps: int = opt(0, "linear warm-up steps", min=0)
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=0.999999)
    beta2: float = opt(0.999, "AdamW beta2", min=0.0, max=0.999999)
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: off)", min=0.0)
    neftune_alpha: float = opt(0.0, "NEFTune (sft only): uniform noise of size alpha / sqrt(L * d) on the input "
                                    "embeddings while training, L the sequence's length, d the width (0: off; "
                                    "the paper uses 5)", min=0.0)
    lora_plus_ratio: float = opt(1.0, "LoRA+: the B matrices learn at learning_rate x this (1: plain LoRA; "
                                      "the LoRA+ paper suggests 16)", min=0.0)
    matmul_precision: str = opt("auto", "how the frozen quantized weights are multiplied on the CPU: through a "
                                        "16-bit copy made per micro-batch, bf16 (the faster where the CPU has "
                                        "AVX512-BF16) or f16 (3 more bits of mantissa; packed with F32 activations "
                                        "on CPUs with AVX2); auto: bf16 on such CPUs, else f16 (`retrograd "
                                        "preflight` says which, and which kernel); native: llama.cpp's own quantized "
                                        "kernels (log-probs bit-equal to llama.cpp's, slower on most types). To "
                                        "benchmark or compare, one route can be forced: amx-bf16, avx512-bf16 or "
                                        "avx2-f16 (retrograd's packed kernels; an error where the CPU lacks one), "
                                        "ggml-bf16 or ggml-f16 (ggml's own product of the 16-bit copies); these "
                                        "convert every quantized weight, as bf16 and f16 do (docs/numerics.md)",
                                choices=MATMUL_PRECISIONS)
    weight_cache_mb: int = opt(0, "MiB of 16-bit copies of the quantized base weights kept between micro-batches "
                                  "(CPU; 0: convert per micro-batch); results are unchanged", min=0)
    activation_checkpointing: bool = opt(False, "recompute each layer's activations in the backward from its saved "
                                                "input: memory grows with one layer's activations, not all of them, "
                                                "for a second forward pass's time (long sequences)")
    threads: int = opt(0, "CPU threads (0: all cores; RETRO_THREADS overrides)", min=0)
    require_gpu_resident: bool = opt(False, "fail if any op of the training graph would run on the CPU")
    log_every: int = opt(1, "print a progress line every N steps when stderr is not a terminal "
                            "(metrics.jsonl gets every step)", min=1)


@dataclass
class CheckpointSection:
    directory: Path | None = opt(None, "where step-N.state directories go (default: <output>/checkpoints)",
                                    path=True)
    every_steps: int = opt(50, "save every N optimizer steps (0: only at the end)", min=0)
    keep: int = opt(3, "keep the last K checkpoints (best.state is kept apart)", min=1)
    best_metric: str = opt("", "metric that selects best.state (default: eval_reward for RL, eval_loss otherwise)")
    best_mode: str = opt("auto", "whether best_metric is better lower (min) or higher (max); auto knows "
                                 "retrograd's own metrics", choices=("auto", "min", "max"))


@dataclass
class EvaluationSection:
    data: Path | None = opt(None, "evaluation data (default: the held-out split)", path=True)
    every_steps: int = opt(0, "evaluate every N steps (0: only at the end)", min=0)
    limit: int = opt(0, "evaluate on at most N examples (0: all)", min=0)


@dataclass
class RolloutSection:
    """Settings every RL algorithm shares: how prompts are read, how completions are sampled and
    scored ([grpo] and [ppo] both have these keys)."""

    max_new_tokens: int = opt(64, "longest completion", min=1)
    max_prompt_tokens: int = opt(512, "longer prompts are skipped", min=8)
    temperature: float = opt(1.0, "sampling temperature", min=0.0, max=5.0)
    top_p: float = opt(1.0, "sampling top-p", min=0.0, max=1.0)
    top_k: int = opt(0, "sampling top-k (0: off)", min=0)
    stop: list = opt([], "stop strings")
    reward_errors: str = opt("raise", "a reward that fails: stop ('raise') or score 0 ('zero')", choices=("raise", "zero"))
    rewards: list = opt([], "reward functions with weights ([[grpo.rewards]] / [[ppo.rewards]] tables)", tables=True)
    eval_prompts: int = opt(32, "prompts scored at each evaluation (greedy, fixed)", min=1)
    generator_weights: str = opt("auto", "weights the rollout generator decodes with: the model file's own "
                                 "('native'); its Q4_1 weights split for llama.cpp's Q4_0 kernels, exactly "
                                 "('split', cached); a cached f16 / bf16 / q8_0 copy (more memory; bf16 needs "
                                 "AVX512-BF16 to be fast); 'auto': split for a Q4_1 model of at most 1 GiB on the "
                                 "CPU, else native",
                                 choices=("auto", "native", "split", "f16", "bf16", "q8_0"))


@dataclass
class GrpoSection(RolloutSection):
    group_size: int = opt(8, "completions per prompt, generated as one batch", min=2, max=64)
    prompts_per_step: int = opt(4, "prompts (groups) per optimizer step", min=1)
    beta: float = opt(0.04, "KL coefficient to the base model (0: no reference pass)", min=0.0)
    epsilon: float = opt(0.2, "clip range of the importance ratio (lower side; both sides unless epsilon_high)", min=0.0)
    epsilon_high: float = opt(0.0, "upper clip range (DAPO's clip-higher; 0: same as epsilon)", min=0.0)
    loss: str = opt("grpo", "loss variant", choices=("grpo", "dr_grpo", "dapo", "gspo"))
    scale_rewards: bool = opt(True, "divide advantages by the group's reward std (dr_grpo: set false)")
    num_iterations: int = opt(1, "optimizer updates per batch of rollouts", min=1, max=16)
    resample_zero_groups: int = opt(0, "draw up to N other prompts when a group's rewards are all equal", min=0)


@dataclass
class PpoSection(RolloutSection):
    batch_prompts: int = opt(16, "prompts (one completion each) per batch of rollouts", min=1)
    gamma: float = opt(1.0, "discount", min=0.0, max=1.0)
    lam: float = opt(0.95, "GAE lambda", min=0.0, max=1.0)
    vf_coef: float = opt(0.1, "weight of the value loss", min=0.0)
    cliprange: float = opt(0.2, "policy ratio clip range", min=0.0)
    cliprange_value: float = opt(0.2, "value clip range around the rollout's values", min=0.0)
    kl_coef: float = opt(0.05, "per-token KL penalty to the base model, folded into the rewards", min=0.0)
    ppo_epochs: int = opt(2, "optimizer updates per batch of rollouts", min=1, max=16)
    whiten_advantages: bool = opt(True, "normalise advantages over the batch")
    value_lr: float = opt(1e-3, "learning rate of the value head", min=0.0)
    bench_samples: int = opt(4, "samples per prompt in bench", min=1, max=64)


@dataclass
class DistillSection:
    teacher: Path | None = opt(None, "teacher GGUF with the student's vocabulary, forward passes only "
                                     "(default: the embedded default model)", path=True)
    teacher_file: Path | None = opt(None, "offline top-k file written by `retrograd distill-teacher` for [data].train; "
                                          "the teacher is then never loaded", path=True)
    eval_teacher_file: Path | None = opt(None, "offline top-k file for [evaluation].data (offline mode)", path=True)
    k: int = opt(32, "teacher tokens per position the loss covers", min=1, max=1024)
    temperature: float = opt(1.0, "distillation temperature (loss scaled by T^2)", min=0.05, max=20.0)
    divergence: str = opt("forward_kl", "forward_kl, reverse_kl or jsd", choices=("forward_kl", "reverse_kl", "jsd"))
    ce_weight: float = opt(0.0, "weight of the cross-entropy on the data's own tokens, added to the divergence",
                           min=0.0)


@dataclass
class PreferenceSection:
    loss: str = opt("dpo", "dpo, ipo, simpo (no reference) or orpo (no reference)",
                    choices=("dpo", "ipo", "simpo", "orpo"))
    beta: float = opt(0.1, "strength of the preference (dpo/ipo: KL-regularisation; simpo: reward scale)", min=1e-6)
    simpo_gamma: float = opt(0.5, "SimPO target reward margin", min=0.0)
    orpo_lambda: float = opt(0.1, "ORPO weight of the odds-ratio term beside the chosen NLL", min=0.0)


@dataclass
class EndpointSection:
    """An OpenAI-compatible chat endpoint ([agent.judge] and [agent.collect_api])."""

    base_url: str = opt("", "base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1 (a `retrograd serve`)")
    model: str = opt("", "model id to ask for at that endpoint")
    api_key_env: str = opt("", "environment variable holding the API key (empty: no key sent)")
    timeout_seconds: float = opt(60.0, "time limit of one request", min=0.1)
    retries: int = opt(2, "retries after a failed request (connection error, 5xx, timeout)", min=0, max=10)
    max_tokens: int = opt(512, "longest answer asked for", min=1)
    temperature: float = opt(0.0, "sampling temperature", min=0.0, max=5.0)


@dataclass
class JudgeSection(EndpointSection):
    local_model: Path | None = opt(None, "judge with this local GGUF through retrograd's own generation engine "
                                         "instead of an endpoint", path=True)
    rubric: str = opt("Score how well each attempt completes the task: correct use of the tools, a correct and "
                      "complete final answer, no invented facts.", "what the judge scores the group against")


@dataclass
class AgentSection:
    scenarios: Path | None = opt(None, "scenarios, JSONL: {\"task\": ..., \"verify\": ..., \"answer\": ...} per line",
                                 path=True)
    servers: list = opt([], "tool servers ([[agent.servers]] tables: name plus command (stdio MCP), url "
                            "(streamable HTTP MCP) or functions (Python 'file.py:function' tools))", tables=True)
    state_template: Path | None = opt(None, "a file (e.g. an SQLite database) copied fresh for every rollout; "
                                            "tools see their rollout's copy", path=True)
    max_turns: int = opt(6, "model turns per conversation before it is cut (truncated)", min=1, max=64)
    max_new_tokens: int = opt(256, "longest model turn", min=1)
    tool_timeout_seconds: float = opt(10.0, "time limit of one tool call (then it is a tool error)", min=0.1)
    tool_output_chars: int = opt(4000, "longer tool results are cut to this many characters", min=64)
    system_prompt: str = opt("", "system prompt placed before the task (the tool catalog is added by the chat "
                                 "template or, without tool support, to the system prompt)")
    tool_use_reward: float = opt(0.0, "added to the reward of a conversation with at least one successful tool call "
                                      "(shapes a small model toward the call format; 0: off)", min=0.0)
    unfinished_penalty: float = opt(0.0, "subtracted from the reward of a conversation that ran out of turns or "
                                         "context without a final answer (0: off)", min=0.0)
    tool_error_penalty: float = opt(0.0, "subtracted from the reward for each failed tool call (an error, an unknown "
                                         "tool, a call that could not be read; 0: off)", min=0.0)
    seed: int = opt(0, "seed of rollouts in collect (scenario i is rolled out from seed + i * k)", min=0)
    generate_count: int = opt(20, "scenarios `retrograd scenarios generate` writes", min=1)
    judge: JudgeSection = field(default_factory=JudgeSection)
    collect_api: EndpointSection = field(default_factory=EndpointSection)


@dataclass
class ServingSection:
    enabled: bool = opt(False, "let retrograd-server serve this run's live weights while it trains")
    idle_seconds: int = opt(300, "unload a served model after this many idle seconds", min=1)
    device_wait_seconds: int = opt(0, "how long a load may wait for a device a run holds (0: refuse)", min=0)
    queue: int = opt(8, "requests waiting for a decoding slot beyond the parallel ones; more get HTTP 429", min=1)
    parallel: int = opt(0, "sequences decoded together in one batch (continuous batching; the KV cache holds "
                           "parallel x ctx cells; 0: 8, fewer when ctx > 4096; 1: one request at a time)", min=0,
                        max=256)
    wait_seconds: int = opt(120, "a request waiting longer than this for a decoding slot gets HTTP 503", min=1)
    generator_weights: str = opt("native", "weights the server decodes with, as [grpo].generator_weights: "
                                 "'native' (the model file's own), 'split' (a Q4_1 model through llama.cpp's "
                                 "Q4_0 kernels, cached), 'auto' (split for a Q4_1 model of at most 1 GiB on the "
                                 "CPU), or a cached f16 / bf16 / q8_0 copy",
                                 choices=("auto", "native", "split", "f16", "bf16", "q8_0"))
    max_body_bytes: int = opt(4 << 20, "largest request body accepted (HTTP 413 beyond)", min=1024)


@dataclass
class DistributedSection:
    backend: str = opt("none", "none (one process) or ray (data-parallel gradients and rollouts on Ray workers)",
                       choices=("none", "ray"))
    address: str = opt("local", "local (a private Ray instance on this machine), auto (the cluster `ray start` "
                                "runs here) or a cluster address such as 10.0.0.5:6379")
    workers: int = opt(2, "worker processes; each holds the model (mmap) and a replica of the adapter", min=1,
                       max=1024)
    threads_per_worker: int = opt(1, "CPU threads of each worker (also the CPUs it reserves in Ray)", min=1)
    rollouts: bool = opt(True, "grpo, ppo, agent_grpo: sample the step's groups on the workers")
    check_every: int = opt(10, "compare the replicas' adapter and optimizer state with a hash every N steps "
                               "(0: never)", min=0)
    max_restarts: int = opt(3, "workers replaced after they die, per run; then the survivors carry on", min=0)
