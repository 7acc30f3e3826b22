"""JSONL data sets: reading, format detection, validation (errors name the file and line), and
turning records into token sequences with a mask of the tokens the loss covers.

Formats:
  text               {"text": "..."}                              every token is trained
  prompt_completion  {"prompt": "...", "completion": "..."}       the completion is trained
  chat               {"messages": [{"role", "content"}, ...]}     assistant turns are trained
  tools              {"messages": [... assistant "tool_calls", "tool" results ...], "tools": [...]}
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrograd.data.chat import ChatFormat, ChatTemplateError
from retrograd.errors import RetrogradError

FORMATS = ("text", "chat", "prompt_completion", "tools")
ROLES = ("system", "user", "assistant", "tool")


class DataError(RetrogradError, ValueError):
    """A problem with a data file, located by file and line."""


@dataclass
class Example:
    tokens: np.ndarray          # int32 [n]
    trained: np.ndarray         # bool [n]: token i is a label (predicted from position i-1)
    line: int = 0
    truncated: bool = False
    record: dict | None = None

    @property
    def n_trained(self) -> int:
        return int(self.trained[1:].sum())


@dataclass
class LoadReport:
    path: Path
    format: str = ""
    n_lines: int = 0
    n_examples: int = 0
    skipped: dict = field(default_factory=dict)   # reason -> count
    n_truncated: int = 0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def summary(self) -> str:
        parts = [f"{self.n_examples} examples ({self.format}) from {self.path.name}"]
        if self.n_truncated:
            parts.append(f"{self.n_truncated} truncated")
        for reason, n in sorted(self.skipped.items()):
            parts.append(f"{n} skipped: {reason}")
        return ", ".join(parts)


def detect(record: dict) -> str | None:
    if "messages" in record:
        if record.get("tools") or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                      for m in record.get("messages") or []):
            return "tools"
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def validate(record: dict, fmt: str) -> None:
    """Raise ValueError describing what is wrong with a record of the given format."""
    if fmt == "text":
        if not isinstance(record.get("text"), str) or not record["text"]:
            raise ValueError('expected {"text": "<non-empty string>"}')
    elif fmt == "prompt_completion":
        for k in ("prompt", "completion"):
            if not isinstance(record.get(k), str):
                raise ValueError(f'"{k}" must be a string')
        if not record["completion"]:
            raise ValueError('"completion" is empty')
    else:
        msgs = record.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError('"messages" must be a non-empty list')
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{i}] must be an object")
            if m.get("role") not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string")
            if content is None and not m.get("tool_calls"):
                raise ValueError(f"messages[{i}] has no content")
            for j, call in enumerate(m.get("tool_calls") or []):
                fn = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] needs a function name")
        if not any(m.get("role") == "assistant" for m in msgs):
            raise ValueError("no assistant message to train on")
        if fmt == "tools" and record.get("tools") is not None and not isinstance(record["tools"], list):
            raise ValueError('"tools" must be a list of tool schemas')


def parse_jsonl(path: Path, report: LoadReport, convert, *, skip_bad: bool = False) -> Iterator:
    """Yield convert(record, line) for every non-blank line of a JSONL file. A line that is not a
    JSON object, or that convert rejects with ValueError, stops with `FILE:LINE: reason`, or with
    skip_bad is counted in the report and skipped. convert returns None for a record it has
    skipped (and counted) itself."""
    path = Path(path)
    try:
        fh = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such data file") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            report.n_lines += 1
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("expected a JSON object per line")
                out = convert(rec, lineno)
            except (json.JSONDecodeError, ValueError, AttributeError) as exc:
                msg = f"not valid JSON ({exc.msg})" if isinstance(exc, json.JSONDecodeError) else str(exc)
                if not skip_bad:
                    raise DataError(f"{path}:{lineno}: {msg}") from None
                report.skip(msg if len(msg) < 60 else msg[:57] + "...")
                continue
            if out is not None:
                yield out


def read_jsonl(path: Path, fmt: str = "auto", *, skip_bad: bool = False,
               report: LoadReport | None = None) -> Iterator[tuple[int, dict, str]]:
    """Yield (line number, record, format) for every valid record."""
    report = report or LoadReport(Path(path))

    def check(rec: dict, lineno: int) -> tuple[int, dict, str]:
        this = detect(rec) if fmt == "auto" else fmt
        if this is None:
            raise ValueError('cannot tell the format: expected "text", "prompt"+"completion" or "messages"')
        if fmt == "auto" and report.format and this != report.format and {this, report.format} != {"chat", "tools"}:
            raise ValueError(f"record is {this} but earlier records are {report.format}")
        validate(rec, this)
        report.format = report.format or this
        return lineno, rec, this

    return parse_jsonl(path, report, check, skip_bad=skip_bad)


def tokenize_record(rec: dict, fmt: str, tok, chat: ChatFormat) -> tuple[list[int], list[bool]]:
    ids: list[int]
    mask: list[bool]
    if fmt == "text":
        ids = tok.encode(rec["text"], add_bos=tok.add_bos, special=False) + [tok.eos_id]
        mask = [True] * len(ids)
        if tok.add_bos:
            mask[0] = False
        return ids, mask
    if fmt == "prompt_completion":
        p = tok.encode(rec["prompt"], add_bos=tok.add_bos, special=False)
        c = tok.encode(rec["completion"], special=False) + [tok.eos_id]
        return p + c, [False] * len(p) + [True] * len(c)
    ids, mask = [], []
    for k, (text, trained) in enumerate(chat.segments(rec["messages"], rec.get("tools"))):
        add_bos = k == 0 and tok.add_bos and not (chat.bos_token and text.startswith(chat.bos_token))
        seg = tok.encode(text, add_bos=add_bos, special=True)
        ids += seg
        mask += [trained] * len(seg)
        if add_bos:
            mask[len(mask) - len(seg)] = False
    return ids, mask


def load_examples(path: Path, tok, chat: ChatFormat, *, fmt: str = "auto", max_length: int = 1024,
                  skip_bad: bool = False) -> tuple[list[Example], LoadReport]:
    report = LoadReport(Path(path))
    out = []
    for lineno, rec, this in read_jsonl(path, fmt, skip_bad=skip_bad, report=report):
        try:
            ids, mask = tokenize_record(rec, this, tok, chat)
        except ChatTemplateError as exc:
            if not skip_bad:
                raise DataError(f"{path}:{lineno}: {exc}") from None
            report.skip("chat template failed")
            continue
        truncated = len(ids) > max_length
        if truncated:
            ids, mask = ids[:max_length], mask[:max_length]
            report.n_truncated += 1
        ex = Example(np.asarray(ids, np.int32), np.asarray(mask, bool), lineno, truncated, rec)
        if ex.n_trained == 0:
            report.skip("no trained tokens left after truncation")
            continue
        out.append(ex)
    report.n_examples = len(out)
    if not out:
        raise DataError(f"{path}: no usable examples ({report.summary()})")
    return out, report
