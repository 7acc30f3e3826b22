"""Verify specs: did a finished rollout do its task? And fresh per-rollout copies of the state template.

A spec is one of

- ``{"sql": "SELECT ..."}``: run on the rollout's final state database (opened read-only); passes when the first
  column of the first row is truthy (no row fails);
- ``{"answer_equals": "..."}``: the final answer equals the text, ignoring case, surrounding whitespace and quotes,
  runs of whitespace and one final period;
- ``{"answer_contains": "..."}``: the final answer contains the text, ignoring case;
- ``{"answer_matches": "regex"}``: ``re.search`` finds the pattern in the final answer (write ``(?i)`` for case);
- ``{"function": "file.py:function"}``: ``function(final_answer, state_path, scenario)`` returns a bool or a float
  score in [0, 1] (the file resolves against the scenarios file's directory); a float passes at 1.0;
- a list of specs: all must pass (the score is their mean).

Evaluation never raises for a problem of the rollout or of the user's check: an SQL error, a missing state or a
verify function that raises is a failed verify whose detail says why.
"""

from __future__ import annotations

import math
import re
import shutil
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd.agent import pyfunc
from retrograd.errors import RetrogradError

KINDS = ("sql", "answer_equals", "answer_contains", "answer_matches", "function")
SQL_SECONDS = 5.0       # an SQL check that runs longer is stopped (and fails)


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verify: `passed`, a one-line `detail` and a `score` in [0, 1].

    Unpacks as ``passed, detail = verdict``."""

    passed: bool
    detail: str
    score: float = 0.0

    def __iter__(self):
        return iter((self.passed, self.detail))


def spec_problem(spec: Any, base: Path | None = None) -> str | None:
    """What is wrong with a verify spec (None when it is valid); `base` is where "function" files resolve and,
    when given, such a file must exist."""
    if isinstance(spec, list):
        if not spec:
            return "an empty list (give at least one spec)"
        for i, part in enumerate(spec):
            if isinstance(part, list):
                return f"[{i}]: a list inside a list (lists are flat: all must pass)"
            problem = spec_problem(part, base)
            if problem:
                return f"[{i}]: {problem}"
        return None
    if not isinstance(spec, dict):
        return f"expected a table such as {{\"sql\": \"SELECT ...\"}} or a list of them, got {spec!r}"
    if len(spec) != 1:
        return (f"expected exactly one of {', '.join(KINDS)} in one spec, got keys {sorted(spec)} "
                "(use a list of specs when all must pass)")
    (kind, value), = spec.items()
    if kind not in KINDS:
        return f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}"
    if not isinstance(value, str) or not value.strip():
        return f"{kind}: expected a non-empty string, got {value!r}"
    if kind == "sql":
        problem = _sql_syntax_problem(value)
        if problem:
            return f"sql: {problem}: {value!r}"
    if kind == "answer_matches":
        try:
            re.compile(value)
        except re.error as exc:
            return f"answer_matches: not a valid regular expression ({exc}): {value!r}"
    if kind == "function":
        try:
            pyfunc.split_ref(value)
            if base is not None:
                path = pyfunc.resolve_file(value, base)
                if not path.is_file():
                    return f"function: {path}: no such file"
        except pyfunc.FunctionRefError as exc:
            return f"function: {exc}"
    return None


def _sql_syntax_problem(query: str) -> str | None:
    """A syntax error of one SQL statement (compiled against an empty database: unknown tables are fine)."""
    con = sqlite3.connect(":memory:")
    try:
        con.execute("EXPLAIN " + query)
    except sqlite3.ProgrammingError as exc:
        return f"not one SQL statement ({exc})"
    except sqlite3.Error as exc:
        msg = str(exc)
        if any(m in msg for m in ("syntax error", "incomplete input", "unrecognized token")):
            return f"not a complete SQL statement ({msg})"
    finally:
        con.close()
    return None


def evaluate(spec: Any, answer: str | None, state: Path | None, scenario: Mapping | None = None,
             base: Path | None = None) -> Verdict:
    """Check one rollout: `answer` is its final answer (None or "" when it gave none), `state` the rollout's
    state file (None without a state template), `scenario` the scenario's fields (passed to verify functions),
    `base` the directory "function" files resolve against (default: the current directory)."""
    if spec is None:
        return Verdict(False, "the scenario has no verify spec", 0.0)
    problem = spec_problem(spec)
    if problem:
        return Verdict(False, f"invalid verify spec: {problem}", 0.0)
    return _evaluate(spec, answer or "", state, dict(scenario or {}), Path(base) if base else Path.cwd())


def _evaluate(spec: Any, answer: str, state: Path | None, scenario: dict, base: Path) -> Verdict:
    if isinstance(spec, list):
        parts = [_evaluate(s, answer, state, scenario, base) for s in spec]
        failed = [p.detail for p in parts if not p.passed]
        score = sum(p.score for p in parts) / len(parts)
        if failed:
            return Verdict(False, f"{len(failed)} of {len(parts)} checks failed: " + "; ".join(failed), score)
        return Verdict(True, "; ".join(p.detail for p in parts), score)
    (kind, value), = spec.items()
    if kind == "sql":
        return _sql(value, state)
    if kind == "function":
        return _function(value, answer, state, scenario, base)
    if not answer.strip():
        return Verdict(False, f"{kind}: no final answer", 0.0)
    if kind == "answer_equals":
        ok = _norm(answer) == _norm(value)
        return _verdict(ok, f"answer_equals {value!r}: " + ("equal" if ok else f"got {_short(answer)}"))
    if kind == "answer_contains":
        ok = value.casefold() in answer.casefold()
        return _verdict(ok, f"answer_contains {value!r}: " + ("found" if ok else f"not in {_short(answer)}"))
    ok = re.search(value, answer) is not None
    return _verdict(ok, f"answer_matches {value!r}: " + ("matched" if ok else f"no match in {_short(answer)}"))


def _verdict(ok: bool, detail: str) -> Verdict:
    return Verdict(ok, detail, 1.0 if ok else 0.0)


def _norm(text: str) -> str:
    t = " ".join(text.split()).casefold()
    t = t.strip().strip("\"'`").strip()
    return t[:-1].rstrip() if t.endswith(".") else t


def _short(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def _sql(query: str, state: Path | None) -> Verdict:
    if state is None:
        return Verdict(False, "sql: no state database (set [agent].state_template)", 0.0)
    state = Path(state)
    if not state.is_file():
        return Verdict(False, f"sql: state database {state} does not exist", 0.0)
    try:
        con = sqlite3.connect(state.resolve().as_uri() + "?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        return Verdict(False, f"sql: cannot open {state}: {exc}", 0.0)
    deadline = time.monotonic() + SQL_SECONDS
    con.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
    try:
        row = con.execute(query).fetchone()
    except sqlite3.Error as exc:
        why = f"took longer than {SQL_SECONDS:g} s" if time.monotonic() > deadline else str(exc)
        return Verdict(False, f"sql error ({why}) in {query!r}", 0.0)
    finally:
        con.close()
    if row is None:
        return Verdict(False, f"sql returned no row: {query!r}", 0.0)
    ok = bool(row[0])
    return _verdict(ok, f"sql {'true' if ok else 'false'} ({row[0]!r}): {query!r}")


def _function(ref: str, answer: str, state: Path | None, scenario: dict, base: Path) -> Verdict:
    try:
        fn = pyfunc.load_function(ref, base)
    except pyfunc.FunctionRefError as exc:
        return Verdict(False, f"function {ref}: {exc}", 0.0)
    try:
        value = fn(answer, state, scenario)
    except Exception as exc:  # the user's check failing is a failed verify, not a crashed run
        return Verdict(False, f"function {ref} raised {type(exc).__name__}: {exc}", 0.0)
    if isinstance(value, bool):
        return _verdict(value, f"function {ref}: {value}")
    if isinstance(value, (int, float)) and math.isfinite(value):
        score = min(1.0, max(0.0, float(value)))
        return Verdict(score >= 1.0, f"function {ref}: {value:g}", score)
    return Verdict(False, f"function {ref} returned {value!r}; expected true/false or a number in [0, 1]", 0.0)


# --- per-rollout state ------------------------------------------------------------------------------------

_SIDE_FILES = ("-wal", "-shm", "-journal")


def fresh_state(template: Path | None, workdir: Path, rollout_id: object) -> Path | None:
    """A fresh copy of the state template for one rollout: `workdir`/state-<rollout_id><suffix> (an absolute
    path), replacing any earlier copy of that name (and its SQLite side files). None when there is no template."""
    if template is None:
        return None
    template = Path(template)
    if not template.is_file():
        raise RetrogradError(f"{template}: state template not found")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(rollout_id)) or "0"
    dst = workdir / f"state-{safe}{template.suffix}"
    discard_state(dst)
    shutil.copyfile(template, dst)
    return dst


def discard_state(path: Path | None) -> None:
    """Remove a rollout's state copy and its SQLite side files (missing files are fine)."""
    if path is None:
        return
    path = Path(path)
    for p in (path, *(path.with_name(path.name + s) for s in _SIDE_FILES)):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
