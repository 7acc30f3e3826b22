"""Chat templates: the model's own Jinja template from the GGUF (or an override, or a built-in
fallback when the model has none), rendering, and splitting a conversation into trainable
(assistant) and masked (everything else) token spans.

Tools reach the model through its template when the template knows about tools; otherwise the
catalog is described in the system prompt and calls are written as <tool_call>{json}</tool_call>
(the Hermes convention), which is also what the parser in generation/toolcalls.py reads back.
The same code renders prompts for training, chat, rollouts and the server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from retrograd.errors import RetrogradError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else 'user' %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
FALLBACKS = {"gemma3": GEMMA, "gemma2": GEMMA, "gemma": GEMMA}


class ChatTemplateError(RetrogradError, ValueError):
    pass


def _raise(msg: str) -> None:
    raise TemplateError(msg)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@dataclass
class ChatFormat:
    """A compiled chat template plus the special strings it needs."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = "model"        # "model", "override" or "fallback:<name>"

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._tpl = env.from_string(self.source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        self.native_tools = "tool_calls" in self.source or "tools" in self.source

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = False) -> str:
        msgs, tools_arg = prepare_messages(messages, tools, self.native_tools)
        try:
            return self._tpl.render(messages=msgs, tools=tools_arg, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from None

    def encode(self, tok, text: str) -> list[int]:
        """Token ids of rendered text; the BOS token is added unless the template already wrote it."""
        return tok.encode(text, add_bos=tok.add_bos and not (self.bos_token and text.startswith(self.bos_token)))

    def segments(self, messages: list[dict], tools: list[dict] | None = None) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, trainable) spans; assistant turns are trainable."""
        out: list[tuple[str, bool]] = []
        done = ""
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            prefix = self.render(messages[:i], tools=tools, add_generation_prompt=True)
            full = self.render(messages[: i + 1], tools=tools)
            if not prefix.startswith(done) or not full.startswith(prefix):
                raise ChatTemplateError(
                    "the chat template does not render conversations prefix by prefix, so assistant turns "
                    "cannot be located; set [model].chat_template to a template that does")
            if len(prefix) > len(done):
                out.append((prefix[len(done):], False))
            out.append((full[len(prefix):], True))
            done = full
        final = self.render(messages, tools=tools)
        if len(final) > len(done):
            out.append((final[len(done):], False))
        return out


def format_for(tokenizer, override: str | None = None) -> ChatFormat:
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id >= 0 else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id >= 0 else ""
    if override:
        return ChatFormat(override, bos, eos, "override")
    if tokenizer.chat_template:
        return ChatFormat(tokenizer.chat_template, bos, eos, "model")
    name = tokenizer.arch if tokenizer.arch in FALLBACKS else "chatml"
    return ChatFormat(FALLBACKS.get(tokenizer.arch, CHATML), bos, eos, f"fallback:{name}")


# ---- tools without template support ----------------------------------------------------------
TOOL_SYSTEM = (
    "You can call tools. The available tools, as JSON schemas:\n{catalog}\n"
    "To call a tool, answer with one line per call:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{...}}}}</tool_call>\n'
    "Tool results come back in <tool_response> tags. When you have the answer, reply normally."
)


def tool_catalog_text(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)


def call_text(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "</tool_call>"


def prepare_messages(messages: list[dict], tools: list[dict] | None, native: bool):
    """Messages and tools as the template gets them; without native tool support, tools go into
    the system prompt, calls into assistant text and results into user turns."""
    if native:
        return messages, tools
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>{content}</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        block = TOOL_SYSTEM.format(catalog=tool_catalog_text(tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None
