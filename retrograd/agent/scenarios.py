"""Scenario files: JSONL, one scenario per line.

    {"task": "Add a note titled 'milk' with body 'buy 2 litres'.", "verify": {"sql": "SELECT ..."}}

Fields: `task` (required, a non-empty string: the user's request), `verify` (optional spec, see
`retrograd.agent.verify`), `answer` (optional reference answer: a string or a number), `id` (optional string or
integer, unique in the file; default "<file name>:<line>"). Other fields are kept in `Scenario.extra` (verify
functions receive them). Blank lines and lines starting with "#" or "//" are skipped. Every problem is a
`ScenarioError` "FILE:LINE: what is wrong".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrograd.agent import verify
from retrograd.errors import RetrogradError

KNOWN = ("task", "verify", "answer", "id")


class ScenarioError(RetrogradError):
    """A scenarios file is missing or has a malformed line."""


@dataclass
class Scenario:
    task: str
    verify: Any = None
    answer: str | None = None
    id: str = ""
    extra: dict = field(default_factory=dict)
    source: Path | None = None
    line: int = 0

    @property
    def base(self) -> Path:
        """Where the scenario's "function" verify files resolve: its file's directory."""
        return self.source.parent if self.source else Path.cwd()

    def to_dict(self) -> dict:
        """The scenario as written (known fields plus extras), as verify functions receive it."""
        out: dict[str, Any] = {"id": self.id, "task": self.task}
        if self.verify is not None:
            out["verify"] = self.verify
        if self.answer is not None:
            out["answer"] = self.answer
        out.update(self.extra)
        return out

    def check(self, answer: str | None, state: Path | None) -> verify.Verdict:
        """Evaluate this scenario's verify spec on a finished rollout."""
        return verify.evaluate(self.verify, answer, state, self.to_dict(), self.base)


def parse_line(text: str, where: str, base: Path | None, default_id: str) -> Scenario:
    """One scenario from one JSON object; `where` ("FILE:LINE") prefixes every error."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(rec, dict):
        raise ScenarioError(f"{where}: expected a JSON object {{\"task\": ...}}, got {type(rec).__name__}")
    if "task" not in rec:
        raise ScenarioError(f"{where}: missing \"task\" (the request the model is given)")
    task = rec["task"]
    if not isinstance(task, str) or not task.strip():
        raise ScenarioError(f"{where}: \"task\" must be a non-empty string, got {task!r}")
    spec = rec.get("verify")
    if spec is not None:
        problem = verify.spec_problem(spec, base)
        if problem:
            raise ScenarioError(f"{where}: verify: {problem}")
    answer = rec.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ScenarioError(f"{where}: \"answer\" must be a string or a number, got {answer!r}")
        answer = str(answer)
    sid = rec.get("id", default_id)
    if isinstance(sid, bool) or not isinstance(sid, (str, int)) or str(sid) == "":
        raise ScenarioError(f"{where}: \"id\" must be a non-empty string or an integer, got {sid!r}")
    extra = {k: v for k, v in rec.items() if k not in KNOWN}
    return Scenario(task=task, verify=spec, answer=answer, id=str(sid), extra=extra)


def load(path: Path, limit: int = 0) -> list[Scenario]:
    """Every scenario of a JSONL file (the first `limit` when limit > 0)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenarios file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from None
    out: list[Scenario] = []
    seen: dict[str, int] = {}
    base = path.resolve().parent
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "//")):
            continue
        where = f"{path}:{lineno}"
        sc = parse_line(stripped, where, base, f"{path.name}:{lineno}")
        if sc.id in seen:
            raise ScenarioError(f"{where}: id {sc.id!r} is used again (first on line {seen[sc.id]})")
        seen[sc.id] = lineno
        sc.source, sc.line = path.resolve(), lineno
        out.append(sc)
        if limit and len(out) >= limit:
            break
    if not out:
        raise ScenarioError(f"{path}: no scenarios (expected one JSON object per line)")
    return out
