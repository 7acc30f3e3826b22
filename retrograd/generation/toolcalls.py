"""Parsing tool calls out of generated text, for the common formats:

  hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>      (Hermes, Qwen, retrograd's own)
  llama3   <|python_tag|>{"name": ..., "parameters": {...}}  or the whole answer as that JSON object
  mistral  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]   (or [TOOL_CALLS]name[ARGS]{...})
  gemma    ```tool_code\\nname(a=1, b="x")\\n```   or   [name(a=1), other()]
  json     a fenced or bare JSON object with "name" and "arguments"/"parameters" (fallback)

A malformed call is reported in `errors` and never raised: the caller decides what to do with it
(the server returns the text as content; rollouts count it as a malformed trace).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def to_openai(self, index: int) -> dict:
        return {"id": f"call_{index}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    format: str = ""
    unknown: list[ToolCall] = field(default_factory=list)   # well-formed calls to tools not offered


def _call_from_obj(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    fn: dict[Any, Any] = obj["function"] if isinstance(obj.get("function"), dict) else obj
    name = fn.get("name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(name, args)


def _json_calls(text: str, errors: list[str], where: str) -> list[ToolCall]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        errors.append(f"{where}: not valid JSON ({exc.msg})")
        return []
    objs = obj if isinstance(obj, list) else [obj]
    calls = []
    for o in objs:
        c = _call_from_obj(o)
        if c is None:
            errors.append(f"{where}: expected an object with a name and object arguments")
        else:
            calls.append(c)
    return calls


def _python_calls(text: str, errors: list[str]) -> list[ToolCall]:
    """Gemma-style calls written as Python: name(a=1, b='x'), possibly several, or in a list."""
    src = text.strip()
    try:
        tree = ast.parse(src, mode="eval")
    except SyntaxError:
        errors.append("tool_code: not a Python call")
        return []
    nodes = tree.body.elts if isinstance(tree.body, (ast.List, ast.Tuple)) else [tree.body]
    calls = []
    for n in nodes:
        if not isinstance(n, ast.Call) or not isinstance(n.func, (ast.Name, ast.Attribute)) or n.args:
            errors.append("tool_code: expected name(keyword=value, ...)")
            continue
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in n.keywords if kw.arg}
        except ValueError:
            errors.append("tool_code: arguments must be literals")
            continue
        name = n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
        calls.append(ToolCall(name, args))
    return calls


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"```(?:tool_code|tool_call|python)\s*\n(.*?)```", re.S)
_JSON_FENCE = re.compile(r"```(?:json)?\s*\n(\{.*?\})\s*```", re.S)


def parse(text: str, tool_names: set[str] | None = None) -> Parsed:
    """Find tool calls in `text`; with tool_names, calls to unknown tools are reported as errors."""
    errors: list[str] = []
    calls: list[ToolCall] = []
    unknown: list[ToolCall] = []
    content: str | None = text
    fmt = ""
    if "<tool_call>" in text:
        fmt = "hermes"
        for m in _HERMES.finditer(text):
            calls += _json_calls(m.group(1), errors, "<tool_call>")
        content = _HERMES.sub("", text).strip()
    elif "[TOOL_CALLS]" in text:
        fmt = "mistral"
        head, _, rest = text.partition("[TOOL_CALLS]")
        rest = rest.strip()
        if "[ARGS]" in rest:
            for part in rest.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                try:
                    c = _call_from_obj({"name": name.strip(), "arguments": json.loads(args)})
                except json.JSONDecodeError:
                    c = None
                if c is None:
                    errors.append("[TOOL_CALLS]: expected name[ARGS]{json object}")
                else:
                    calls.append(c)
        else:
            calls += _json_calls(rest, errors, "[TOOL_CALLS]")
        content = head.strip()
    elif "<|python_tag|>" in text:
        fmt = "llama3"
        head, _, rest = text.partition("<|python_tag|>")
        for line in [x for x in rest.replace("<|eom_id|>", "").split(";") if x.strip()]:
            calls += _json_calls(line.strip(), errors, "<|python_tag|>")
        content = head.strip()
    elif _FENCE.search(text):
        fmt = "gemma"
        for m in _FENCE.finditer(text):
            calls += _python_calls(m.group(1), errors)
        content = _FENCE.sub("", text).strip()
    else:
        stripped = text.strip()
        if re.fullmatch(r"\[\s*\w+\(.*\)\s*\]", stripped, re.S):
            fmt = "gemma"
            calls += _python_calls(stripped, errors)
            content = ""
        else:
            fence = _JSON_FENCE.search(stripped)
            candidate = fence.group(1) if fence else stripped
            if candidate.startswith("{") and '"name"' in candidate:
                found = _json_calls(candidate, [], "json")
                if found:
                    fmt = "llama3" if '"parameters"' in candidate else "json"
                    calls = found
                    content = (stripped.replace(fence.group(0), "") if fence else "").strip()
    if tool_names is not None:
        for c in list(calls):
            if c.name not in tool_names:
                errors.append(f"call to unknown tool {c.name!r}")
                calls.remove(c)
                unknown.append(c)
    return Parsed(content if content else None, calls, errors, fmt, unknown)
