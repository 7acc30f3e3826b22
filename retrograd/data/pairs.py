"""Preference pairs from JSONL, tokenized as one shared prompt and two continuations.

Accepted records (one per line):
  {"prompt": "...", "chosen": "...", "rejected": "..."}                  strings: one user turn, one
                                                                         assistant answer each
  {"prompt": [messages], "chosen": "..." | [messages], "rejected": ...}  a conversation, then the
                                                                         answers (strings or
                                                                         assistant messages)
  {"chosen": [messages], "rejected": [messages]}                         two whole conversations that
                                                                         differ only after a shared start

Both sides are rendered with the chat template; the tokens before the first trained (assistant)
token are the shared prompt, which a micro-batch holds once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.data.batching import Group
from retrograd.data.chat import ChatFormat
from retrograd.data.formats import ROLES, DataError, LoadReport, parse_jsonl, tokenize_record


@dataclass
class Pair:
    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    chosen_w: np.ndarray       # 1 where a continuation token is trained (assistant text), else 0
    rejected_w: np.ndarray
    line: int
    truncated: bool = False
    ref: tuple[float, float] | None = None     # the reference policy's (chosen, rejected) sums, once known

    def known_ref(self) -> tuple[float, float]:
        """`ref`, which the losses measured against the reference policy read once it is computed."""
        if self.ref is None:
            raise RuntimeError(f"line {self.line}: the pair's reference log-probs were not computed")
        return self.ref

    @property
    def tokens(self) -> np.ndarray:           # for token-budgeted batches
        return np.concatenate([self.prompt, self.chosen, self.rejected])

    @property
    def group(self) -> Group:
        return Group(self.prompt, [self.chosen, self.rejected])

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


def _messages(value, where: str, role: str | None = None) -> list[dict]:
    if isinstance(value, str):
        if not value:
            raise ValueError(f'"{where}" is empty')
        return [{"role": role or "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f'"{where}" must be a string or a non-empty list of messages')
    for i, m in enumerate(value):
        # an assistant turn that only calls tools has no content; every other message has text
        calls_only = isinstance(m, dict) and m.get("content") is None and m.get("tool_calls")
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (isinstance(m.get("content"), str)
                                                                         or calls_only):
            raise ValueError(f"{where}[{i}] must have a role ({', '.join(ROLES)}) and string content")
    return value


def conversations(rec: dict) -> tuple[list[dict], list[dict]]:
    """The chosen and rejected conversations of a record (ValueError says what is wrong)."""
    if not isinstance(rec, dict):
        raise ValueError("expected a JSON object per line")
    for key in ("chosen", "rejected"):
        if key not in rec:
            raise ValueError(f'missing "{key}" (expected prompt/chosen/rejected)')
    if "prompt" in rec:
        prompt = _messages(rec["prompt"], "prompt")
        if prompt[-1]["role"] == "assistant":
            raise ValueError("the prompt ends with an assistant turn; the answers go in chosen/rejected")
        chosen = prompt + _messages(rec["chosen"], "chosen", "assistant")
        rejected = prompt + _messages(rec["rejected"], "rejected", "assistant")
    else:
        chosen, rejected = _messages(rec["chosen"], "chosen"), _messages(rec["rejected"], "rejected")
    for name, conv in (("chosen", chosen), ("rejected", rejected)):
        if conv[-1]["role"] != "assistant":
            raise ValueError(f"{name} does not end with an assistant answer")
    return chosen, rejected


def tokenize_pair(rec: dict, tok, chat: ChatFormat, max_length: int, line: int = 0) -> Pair:
    """Both conversations rendered whole (with the record's "tools" catalog, when it has one: pairs
    of agentic traces); the shared start becomes the prompt."""
    chosen, rejected = conversations(rec)
    tools = rec.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError('"tools" must be a list of tool schemas')
    fmt = "tools" if tools else "chat"
    ids_c, mask_c = tokenize_record({"messages": chosen, "tools": tools}, fmt, tok, chat)
    ids_r, mask_r = tokenize_record({"messages": rejected, "tools": tools}, fmt, tok, chat)
    tc, mc = np.asarray(ids_c, np.int32), np.asarray(mask_c, bool)
    tr, mr = np.asarray(ids_r, np.int32), np.asarray(mask_r, bool)
    if not mc.any() or not mr.any():
        raise ValueError("an answer rendered to no trained tokens")
    start = min(int(np.argmax(mc)), int(np.argmax(mr)))
    common = 0
    while common < start and tc[common] == tr[common]:
        common += 1
    if common == 0:
        raise ValueError("chosen and rejected share no prompt")
    ends = (len(mc) - int(np.argmax(mc[::-1])), len(mr) - int(np.argmax(mr[::-1])))
    c, r = tc[common:ends[0]], tr[common:ends[1]]
    wc, wr = mc[common:ends[0]].astype(np.float32), mr[common:ends[1]].astype(np.float32)
    room = max_length - common
    if room < 2:
        raise ValueError(f"the prompt alone is {common} tokens, over max_length {max_length}")
    truncated = len(c) > room or len(r) > room
    return Pair(tc[:common], c[:room], r[:room], wc[:room], wr[:room], line, truncated)


def load_pairs(path: Path, tok, chat: ChatFormat, *, max_length: int = 1024,
               skip_bad: bool = False) -> tuple[list[Pair], LoadReport]:
    path = Path(path)
    report = LoadReport(path, format="pairs")

    def convert(rec: dict, lineno: int) -> Pair:
        pair = tokenize_pair(rec, tok, chat, max_length, lineno)
        report.n_truncated += pair.truncated
        return pair

    out = list(parse_jsonl(path, report, convert, skip_bad=skip_bad))
    report.n_examples = len(out)
    if not out:
        raise DataError(f"{path}: no usable preference pairs ({report.summary()})")
    return out, report
