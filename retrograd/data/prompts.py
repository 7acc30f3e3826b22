"""Prompt data sets for RL: {"prompt": "..."} or {"messages": [...]}, plus any fields the rewards
read (such as "answer"). Prompts are rendered with the chat template, ready for generation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.data.chat import ChatFormat
from retrograd.data.formats import ROLES, DataError, LoadReport, parse_jsonl


@dataclass
class Prompt:
    tokens: np.ndarray
    record: dict
    line: int
    messages: list


def messages_of(rec: dict) -> list[dict]:
    if isinstance(rec.get("prompt"), str) and rec["prompt"]:
        return [{"role": "user", "content": rec["prompt"]}]
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError('expected "prompt" (a non-empty string) or "messages" (a non-empty list)')
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must have a role ({', '.join(ROLES)}) and string content")
    if msgs[-1]["role"] == "assistant":
        raise ValueError("the last message is an assistant turn; a prompt ends before the answer")
    return msgs


def load_prompts(path: Path, tok, chat: ChatFormat, *, max_tokens: int = 512,
                 skip_bad: bool = False) -> tuple[list[Prompt], LoadReport]:
    path = Path(path)
    report = LoadReport(path, format="prompts")

    def convert(rec: dict, lineno: int) -> Prompt | None:
        msgs = messages_of(rec)
        text = chat.render(msgs, tools=rec.get("tools"), add_generation_prompt=True)
        ids = chat.encode(tok, text)
        if len(ids) > max_tokens:
            report.skip(f"prompt longer than {max_tokens} tokens")
            return None
        return Prompt(np.asarray(ids, np.int32), rec, lineno, msgs)

    out = list(parse_jsonl(path, report, convert, skip_bad=skip_bad))
    report.n_examples = len(out)
    if not out:
        raise DataError(f"{path}: no usable prompts ({report.summary()})")
    return out, report
