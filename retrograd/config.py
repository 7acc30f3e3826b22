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

from retrograd.errors import ConfigError  # noqa: F401 - the configuration's error type, re-exported

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from retrograd.sections import (  # noqa: F401 - the sections are part of the configuration's interface
    ALGORITHMS,
    TARGETS,
    TRACKERS,
    AgentSection,
    CheckpointSection,
    DataSection,
    DistillSection,
    DistributedSection,
    EndpointSection,
    EvaluationSection,
    GrpoSection,
    JudgeSection,
    LoraSection,
    ModelSection,
    PpoSection,
    PreferenceSection,
    RolloutSection,
    RunSection,
    ServingSection,
    TrainingSection,
)


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
    agent: AgentSection = field(default_factory=AgentSection)
    serving: ServingSection = field(default_factory=ServingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    source: Path | None = None      # the TOML file, when there is one
    base_dir: Path | None = None    # where relative paths resolve, when not the file's directory

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name in ("source", "base_dir"):
                continue
            out[f.name] = _section_dict(getattr(self, f.name))
        return out


def _section_dict(sec: Any) -> dict:
    return {k.name: _plain(getattr(sec, k.name)) for k in dataclasses.fields(sec) if getattr(sec, k.name) is not None}


#: metrics where higher is better; every other metric is better lower (losses, KL, perplexity)
HIGHER_IS_BETTER = ("eval_reward", "eval_pref_accuracy", "eval_reward_accuracy", "eval_reward_margin", "eval_top1",
                    "eval_verify_pass", "eval_judge_score")
RL_ALGORITHMS = ("grpo", "ppo", "agent_grpo")


def best_metric(cfg: Config) -> tuple[str, bool]:
    """The metric that picks best.state and whether higher is better."""
    c = cfg.checkpoint
    name = c.best_metric or ("eval_reward" if cfg.run.algorithm in RL_ALGORITHMS else "eval_loss")
    higher = c.best_mode == "max" or (c.best_mode == "auto" and name in HIGHER_IS_BETTER)
    return name, higher


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v):
        return _section_dict(v)
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


def _fill(sec: Any, body: dict, label: str, name: str, base: Path) -> None:
    """Set the keys of one [name] table on its dataclass; sub-tables ([agent.judge]) recurse."""
    known = {f.name: f for f in dataclasses.fields(sec)}
    hints = typing.get_type_hints(type(sec))
    for key, value in body.items():
        where = f"{label}: [{name}].{key}"
        if key not in known:
            raise ConfigError(f"{label}: unknown key [{name}].{key}; expected one of {', '.join(known)}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{label}: [{name}.{key}] must be a table, got {value!r}")
            _fill(getattr(sec, key), value, label, f"{name}.{key}", base)
            continue
        setattr(sec, key, _coerce(value, hints[key], where, dict(known[key].metadata), base))


def from_dict(raw: dict, source: Path | None = None, base: Path | None = None) -> Config:
    """A configuration from parsed TOML; relative paths resolve against `base`, by default the
    source file's directory (retrograd-server passes the submitter's directory for a TOML body)."""
    label = str(source) if source else "<config>"
    base = Path(base) if base else (source.parent if source else Path.cwd())
    cfg = Config(source=source, base_dir=base)
    sections = {f.name: f for f in dataclasses.fields(Config) if f.name not in ("source", "base_dir")}
    for name, body in raw.items():
        if name not in sections:
            raise ConfigError(f"{label}: unknown section [{name}]; expected one of "
                              f"{', '.join('[' + s + ']' for s in sections)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{label}: [{name}] must be a table, got {body!r}")
        _fill(getattr(cfg, name), body, label, name, base)
    _cross_check(cfg, label)
    return cfg


def _cross_check(cfg: Config, label: str) -> None:
    bad = [t for t in cfg.lora.targets if t not in TARGETS]
    if bad or not cfg.lora.targets:
        raise ConfigError(f"{label}: [lora].targets: expected some of {', '.join(TARGETS)}, got {cfg.lora.targets!r}")
    bad = [t for t in cfg.run.report_to if t not in TRACKERS]
    if bad or len(set(cfg.run.report_to)) != len(cfg.run.report_to):
        raise ConfigError(f"{label}: [run].report_to: expected distinct entries of {', '.join(TRACKERS)}, got "
                          f"{cfg.run.report_to!r}")
    if cfg.training.neftune_alpha > 0 and cfg.run.algorithm != "sft":
        raise ConfigError(f"{label}: [training].neftune_alpha applies to sft only (noise on the inputs of "
                          f"supervised examples), not to {cfg.run.algorithm}")
    if cfg.lora.variant == "dora" and cfg.run.algorithm in RL_ALGORITHMS:
        raise ConfigError(f"{label}: [lora].variant = \"dora\" cannot train {cfg.run.algorithm}: its rollouts are sampled "
                          "by llama.cpp, which cannot apply DoRA's magnitudes (the model would be merged again after "
                          "every step); use variant = \"lora\", or dora with sft, distill or preference")


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


#: every "section.key" that names an input file
PATH_KEYS = ("model.path", "lora.init_adapter", "data.train", "evaluation.data", "distill.teacher",
             "distill.teacher_file", "distill.eval_teacher_file", "agent.scenarios", "agent.state_template",
             "agent.judge.local_model")


def check_paths(cfg: Config, skip: tuple[str, ...] = (), reads: tuple[str, ...] = PATH_KEYS) -> None:
    """Files the command will read must exist (checked once everything is resolved): the entries
    in `reads` (by default every input file of a run) except those in `skip`, which the command
    writes instead of reads."""
    label = str(cfg.source) if cfg.source else "<config>"
    for name in reads:
        if name in skip:
            continue
        *secs, key = name.split(".")
        obj = cfg
        for part in secs:
            obj = getattr(obj, part)
        p = getattr(obj, key)
        sec = ".".join(secs)
        if p is not None and not Path(p).is_file():
            raise ConfigError(f"{label}: [{sec}].{key}: file not found: {p}")


def describe() -> str:
    """Every section and key with type, default and help, for `--help` style listings."""
    lines: list[str] = []

    def section(name: str, sec: Any) -> None:
        lines.append(f"[{name}]")
        hints = typing.get_type_hints(type(sec))
        subs = []
        for k in dataclasses.fields(sec):
            if dataclasses.is_dataclass(hints[k.name]):
                subs.append((f"{name}.{k.name}", getattr(sec, k.name)))
                continue
            lines.append(f"  {k.name:<20} {_describe(hints[k.name]):<18} default {getattr(sec, k.name)!r:<12} "
                         f"{k.metadata.get('help', '')}")
        for sub_name, sub in subs:
            section(sub_name, sub)

    defaults = Config()
    for f in dataclasses.fields(Config):
        if f.name not in ("source", "base_dir"):
            section(f.name, getattr(defaults, f.name))
    return "\n".join(lines)
