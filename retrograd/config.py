"""Run configuration: typed dataclasses read from TOML, validated with messages that name the file,
the key and what was expected.

Paths written in the file resolve against the file's directory; paths given on the command line
resolve against the current directory (the CLI resolves them before they get here). The resolved
configuration is written into the run's output and into every checkpoint (`to_dict`).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ALGORITHMS = ("sft", "grpo", "ppo", "distill", "preference", "agent_grpo")
BUILT_ALGORITHMS = ("sft", "grpo", "ppo", "distill", "preference")
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class ConfigError(ValueError):
    """One clear line: file, key, what was expected."""


def opt(default: Any = None, help: str = "", *, choices: tuple = (), min: float | None = None,
        max: float | None = None, path: bool = False, tables: bool = False) -> Any:
    meta = {"help": help, "choices": choices, "min": min, "max": max, "path": path, "tables": tables}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
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
    alpha: float = opt(32.0, "LoRA alpha; the update is scaled by alpha / rank", min=0.0)
    dropout: float = opt(0.0, "LoRA dropout (only 0.0 is supported in this version)", min=0.0, max=0.0)
    targets: list = opt(list(TARGETS), "projections that get an adapter: q k v o gate up down")
    init_adapter: Path | None = opt(None, "start from this llama.cpp LoRA GGUF", path=True)


@dataclass
class RunSection:
    algorithm: str = opt("sft", "training algorithm", choices=ALGORITHMS)
    name: str = opt("", "run name (default: the config file's name)")
    output: Path | None = opt(None, "run directory (default: runs/<name> beside the config)", path=True)
    seed: int = opt(0, "seed for initialisation, data order and sampling", min=0)


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
    threads: int = opt(0, "CPU threads (0: all cores; RETRO_THREADS overrides)", min=0)
    require_gpu_resident: bool = opt(False, "fail if any op of the training graph would run on the CPU")
    log_every: int = opt(1, "write a metrics line every N steps", min=1)


@dataclass
class CheckpointSection:
    directory: Path | None = opt(None, "where step-N.state directories go (default: <output>/checkpoints)",
                                    path=True)
    every_steps: int = opt(50, "save every N optimizer steps (0: only at the end)", min=0)
    keep: int = opt(3, "keep the last K checkpoints (best.state is kept apart)", min=1)
    best_metric: str = opt("eval_loss", "metric that selects best.state (lower is better)")


@dataclass
class EvaluationSection:
    data: Path | None = opt(None, "evaluation data (default: the held-out split)", path=True)
    every_steps: int = opt(0, "evaluate every N steps (0: only at the end)", min=0)
    limit: int = opt(0, "evaluate on at most N examples (0: all)", min=0)


@dataclass
class GrpoSection:
    group_size: int = opt(8, "completions per prompt, generated as one batch", min=2, max=64)
    prompts_per_step: int = opt(4, "prompts (groups) per optimizer step", min=1)
    max_new_tokens: int = opt(64, "longest completion", min=1)
    max_prompt_tokens: int = opt(512, "longer prompts are skipped", min=8)
    temperature: float = opt(1.0, "sampling temperature", min=0.0, max=5.0)
    top_p: float = opt(1.0, "sampling top-p", min=0.0, max=1.0)
    top_k: int = opt(0, "sampling top-k (0: off)", min=0)
    stop: list = opt([], "stop strings")
    beta: float = opt(0.04, "KL coefficient to the base model (0: no reference pass)", min=0.0)
    epsilon: float = opt(0.2, "clip range of the importance ratio (lower side; both sides unless epsilon_high)", min=0.0)
    epsilon_high: float = opt(0.0, "upper clip range (DAPO's clip-higher; 0: same as epsilon)", min=0.0)
    loss: str = opt("grpo", "loss variant", choices=("grpo", "dr_grpo", "dapo", "gspo"))
    scale_rewards: bool = opt(True, "divide advantages by the group's reward std (dr_grpo: set false)")
    num_iterations: int = opt(1, "optimizer updates per batch of rollouts", min=1, max=16)
    resample_zero_groups: int = opt(0, "draw up to N other prompts when a group's rewards are all equal", min=0)
    reward_errors: str = opt("raise", "a reward that fails: stop ('raise') or score 0 ('zero')", choices=("raise", "zero"))
    rewards: list = opt([], "reward functions with weights ([[grpo.rewards]] tables)", tables=True)
    eval_prompts: int = opt(32, "prompts scored at each evaluation (greedy, fixed)", min=1)


@dataclass
class PpoSection:
    batch_prompts: int = opt(16, "prompts (one completion each) per batch of rollouts", min=1)
    max_new_tokens: int = opt(64, "longest completion", min=1)
    max_prompt_tokens: int = opt(512, "longer prompts are skipped", min=8)
    temperature: float = opt(1.0, "sampling temperature", min=0.0, max=5.0)
    top_p: float = opt(1.0, "sampling top-p", min=0.0, max=1.0)
    stop: list = opt([], "stop strings")
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
    reward_errors: str = opt("raise", "a reward that fails: stop ('raise') or score 0 ('zero')", choices=("raise", "zero"))
    rewards: list = opt([], "reward functions with weights ([[ppo.rewards]] tables)", tables=True)


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
class ServingSection:
    enabled: bool = opt(False, "let retrograd-server serve this run's live weights while it trains")
    idle_seconds: int = opt(300, "unload a served model after this many idle seconds", min=1)
    device_wait_seconds: int = opt(0, "how long a load may wait for a device a run holds (0: refuse)", min=0)
    queue: int = opt(8, "requests waiting beyond this get HTTP 429", min=1)
    max_body_bytes: int = opt(4 << 20, "largest request body accepted (HTTP 413 beyond)", min=1024)


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)
    ppo: PpoSection = field(default_factory=PpoSection)
    distill: DistillSection = field(default_factory=DistillSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    serving: ServingSection = field(default_factory=ServingSection)
    source: Path | None = None      # the TOML file, when there is one

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "source":
                continue
            sec = getattr(self, f.name)
            out[f.name] = {k.name: _plain(getattr(sec, k.name)) for k in dataclasses.fields(sec)
                           if getattr(sec, k.name) is not None}
        return out


def _plain(v: Any) -> Any:
    return str(v) if isinstance(v, Path) else v


def _is_union(origin: Any) -> bool:
    return origin is typing.Union or origin is types.UnionType


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if _is_union(origin):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _describe(args[0])
    if origin is list or tp is list:
        return "a list of strings"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            Path: "a path (string)"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, where: str, meta: dict, base: Path) -> Any:
    origin = typing.get_origin(tp)
    if _is_union(origin):
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        origin = typing.get_origin(tp)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
    elif tp is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: expected a path (string), got {value!r}")
        p = Path(value).expanduser()
        value = p if p.is_absolute() else (base / p)
    elif (tp is list or origin is list) and meta.get("tables"):
        if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
            raise ConfigError(f"{where}: expected a list of tables ([[...]] entries), got {value!r}")
    elif tp is list or origin is list:
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{where}: expected one of {', '.join(map(str, meta['choices']))}, got {value!r}")
    if meta.get("min") is not None and isinstance(value, (int, float)) and value < meta["min"]:
        raise ConfigError(f"{where}: must be >= {meta['min']}, got {value!r}")
    if meta.get("max") is not None and isinstance(value, (int, float)) and value > meta["max"]:
        raise ConfigError(f"{where}: must be <= {meta['max']}, got {value!r}")
    return value


def from_dict(raw: dict, source: Path | None = None) -> Config:
    label = str(source) if source else "<config>"
    base = source.parent if source else Path.cwd()
    cfg = Config(source=source)
    sections = {f.name: f for f in dataclasses.fields(Config) if f.name != "source"}
    for name, body in raw.items():
        if name not in sections:
            raise ConfigError(f"{label}: unknown section [{name}]; expected one of "
                              f"{', '.join('[' + s + ']' for s in sections)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{label}: [{name}] must be a table, got {body!r}")
        sec = getattr(cfg, name)
        known = {f.name: f for f in dataclasses.fields(sec)}
        hints = typing.get_type_hints(type(sec))
        for key, value in body.items():
            where = f"{label}: [{name}].{key}"
            if key not in known:
                raise ConfigError(f"{label}: unknown key [{name}].{key}; expected one of {', '.join(known)}")
            setattr(sec, key, _coerce(value, hints[key], where, dict(known[key].metadata), base))
    _cross_check(cfg, label)
    return cfg


def _cross_check(cfg: Config, label: str) -> None:
    bad = [t for t in cfg.lora.targets if t not in TARGETS]
    if bad or not cfg.lora.targets:
        raise ConfigError(f"{label}: [lora].targets: expected some of {', '.join(TARGETS)}, got {cfg.lora.targets!r}")
    if cfg.run.algorithm not in BUILT_ALGORITHMS:
        raise ConfigError(f"{label}: [run].algorithm = {cfg.run.algorithm!r} is not built yet in this version "
                          f"(available: {', '.join(BUILT_ALGORITHMS)})")


def load(path: Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return from_dict(raw, path.resolve())


def check_paths(cfg: Config, skip: tuple[str, ...] = ()) -> None:
    """Files the run will read must exist (checked once everything is resolved); `skip` names
    "section.key" entries a command writes instead of reads."""
    label = str(cfg.source) if cfg.source else "<config>"
    for sec, key in (("model", "path"), ("lora", "init_adapter"), ("data", "train"), ("evaluation", "data"),
                     ("distill", "teacher"), ("distill", "teacher_file"), ("distill", "eval_teacher_file")):
        p = getattr(getattr(cfg, sec), key)
        if f"{sec}.{key}" in skip:
            continue
        if p is not None and not Path(p).is_file():
            raise ConfigError(f"{label}: [{sec}].{key}: file not found: {p}")


def describe() -> str:
    """Every section and key with type, default and help, for `--help` style listings."""
    lines = []
    for f in dataclasses.fields(Config):
        if f.name == "source":
            continue
        lines.append(f"[{f.name}]")
        sec = f.default_factory()
        hints = typing.get_type_hints(type(sec))
        for k in dataclasses.fields(sec):
            lines.append(f"  {k.name:<20} {_describe(hints[k.name]):<18} default {getattr(sec, k.name)!r:<12} "
                         f"{k.metadata.get('help', '')}")
    return "\n".join(lines)
