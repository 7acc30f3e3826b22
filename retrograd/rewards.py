"""Reward functions for RL, combined with weights from `[grpo].rewards` / `[ppo].rewards`:

    [[grpo.rewards]]
    name = "answer_match"        # built-in: final answer equals record["answer"] after normalisation
    weight = 1.0
    [[grpo.rewards]]
    name = "regex"               # built-in: 1 when `pattern` matches the stripped completion
    pattern = '^\\d+$'
    weight = 0.5
    [[grpo.rewards]]
    function = "my_rewards.py:score"   # a user function, resolved against the config's directory
    weight = 1.0

Built-ins: answer_match (extract = "last_number" | "boxed" | "after_hash" | "full", field = "answer"),
regex (pattern), length (target characters; -max(0, len - target) / target), json_valid (keys).
A user function is called as fn(completion: str, record: dict, **options) and must return a number.
A reward that raises or returns a non-number stops the run with the function's name and the
prompt's line, unless `reward_errors = "zero"` (then it scores 0 and is counted).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from retrograd.errors import ConfigError, RetrogradError


class RewardError(RetrogradError):
    """A reward function failed while scoring (exit 1)."""


class RewardConfigError(RewardError, ConfigError):
    """A [[grpo.rewards]] / [[ppo.rewards]] table is wrong (exit 2)."""

    exit_code = 2


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalise(text: str) -> str:
    t = str(text).strip().lower().rstrip(".")
    t = t.replace(",", "").replace("$", "").strip()
    try:
        v = float(t)
        return str(int(v)) if v == int(v) else repr(v)
    except ValueError:
        return " ".join(t.split())


def extract(text: str, how: str) -> str | None:
    if how == "full":
        return text
    if how == "boxed":
        m = re.findall(r"\\boxed\{([^}]*)\}", text)
        return m[-1] if m else None
    if how == "after_hash":
        m = re.findall(r"####\s*(.+)", text)
        return m[-1].strip() if m else None
    nums = _NUM.findall(text)
    return nums[-1] if nums else None


def answer_match(completion: str, record: dict, field: str = "answer", extract_with: str = "last_number") -> float:
    if field not in record:
        raise KeyError(f"the record has no {field!r} field")
    got = extract(completion, extract_with)
    return 1.0 if got is not None and normalise(got) == normalise(record[field]) else 0.0


def regex(completion: str, record: dict, pattern: str = ".") -> float:
    return 1.0 if re.search(pattern, completion.strip()) else 0.0


def length(completion: str, record: dict, target: int = 200) -> float:
    return -max(0, len(completion) - target) / max(target, 1)


def json_valid(completion: str, record: dict, keys: list | None = None) -> float:
    try:
        obj = json.loads(completion.strip())
    except json.JSONDecodeError:
        return 0.0
    if keys and (not isinstance(obj, dict) or any(k not in obj for k in keys)):
        return 0.0
    return 1.0


BUILTINS: dict[str, tuple[Callable, dict]] = {
    "answer_match": (answer_match, {"field": str, "extract": str}),
    "regex": (regex, {"pattern": str}),
    "length": (length, {"target": int}),
    "json_valid": (json_valid, {"keys": list}),
}


@dataclass
class Reward:
    name: str
    fn: Callable
    weight: float
    options: dict = field(default_factory=dict)


def _load_user(spec: str, base: Path, where: str) -> Callable:
    path_s, _, fname = spec.rpartition(":")
    if not path_s or not fname:
        raise RewardConfigError(f"{where}.function: expected 'path/to/file.py:function', got {spec!r}")
    path = Path(path_s)
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise RewardConfigError(f"{where}.function: file not found: {path}")
    mod_spec = importlib.util.spec_from_file_location(f"retrograd_user_reward_{path.stem}", path)
    if mod_spec is None or mod_spec.loader is None:
        raise RewardConfigError(f"{where}.function: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:  # the user's module is arbitrary code
        raise RewardConfigError(f"{where}.function: importing {path} failed: {exc}") from None
    fn = getattr(module, fname, None)
    if not callable(fn):
        raise RewardConfigError(f"{where}.function: {path} has no function {fname!r}")
    return fn


def build(specs: list[dict], base: Path, section: str, label: str = "") -> list[Reward]:
    """Reward objects from the config's list of tables; errors name the file (label) and
    [section].rewards[i]."""
    at = f"{label}: " if label else ""
    if not specs:
        raise RewardConfigError(f"{at}[{section}].rewards: at least one reward is required")
    out = []
    for i, spec in enumerate(specs):
        where = f"{at}[{section}].rewards[{i}]"
        if not isinstance(spec, dict):
            raise RewardConfigError(f"{where}: expected a table, got {spec!r}")
        spec = dict(spec)
        weight = spec.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise RewardConfigError(f"{where}.weight: expected a number, got {weight!r}")
        if "function" in spec:
            fn = _load_user(str(spec.pop("function")), base, where)
            name = spec.pop("name", getattr(fn, "__name__", "function"))
            out.append(Reward(str(name), fn, float(weight), spec))
            continue
        name = spec.pop("name", None)
        if name not in BUILTINS:
            raise RewardConfigError(f"{where}.name: expected one of {', '.join(BUILTINS)} (or a 'function'), got {name!r}")
        fn, allowed = BUILTINS[name]
        for k, v in spec.items():
            if k not in allowed:
                raise RewardConfigError(f"{where}: unknown option {k!r} for {name}; expected {', '.join(allowed) or 'none'}")
            if not isinstance(v, allowed[k]) or isinstance(v, bool):
                raise RewardConfigError(f"{where}.{k}: expected {allowed[k].__name__}, got {v!r}")
        if name == "regex":
            try:
                re.compile(spec.get("pattern", "."))
            except re.error as exc:
                raise RewardConfigError(f"{where}.pattern: not a valid regular expression ({exc})") from None
        if "extract" in spec:
            spec["extract_with"] = spec.pop("extract")
        out.append(Reward(name, fn, float(weight), spec))
    return out


@dataclass
class Scored:
    total: list[float]
    per_fn: dict[str, list[float]]
    errors: int = 0


def score(rewards: list[Reward], completions: list[str], record: dict, line: int, on_error: str = "raise") -> Scored:
    per: dict[str, list[float]] = {r.name: [] for r in rewards}
    totals = [0.0] * len(completions)
    errors = 0
    for r in rewards:
        for j, text in enumerate(completions):
            try:
                v = r.fn(text, record, **r.options)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                    raise TypeError(f"returned {v!r}, expected a finite number")
                v = float(v)
            except Exception as exc:  # user code: report, never crash with a traceback
                if on_error != "zero":
                    raise RewardError(f"reward {r.name!r} failed on the prompt at line {line} "
                                      f"(completion {text[:60]!r}): {exc}") from None
                v = 0.0
                errors += 1
            per[r.name].append(v)
            totals[j] += r.weight * v
    return Scored(totals, per, errors)
