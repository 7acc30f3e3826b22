"""The one place where a conversation with tools becomes model input and a generated turn becomes
a message again. `serve` and the agentic rollouts both go through here, so a model is prompted and
read the same way in training and in use.

Tools reach the model through its chat template when the template has a tool format, otherwise
through the system prompt (data/chat.py); calls come back in any of the formats
generation/toolcalls.py reads, and leave here as OpenAI-style `tool_calls`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retrograd.data.chat import ChatFormat
from retrograd.generation.toolcalls import ToolCall, parse


def prompt_text(chat: ChatFormat, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    return chat.render(messages, tools=tools or None, add_generation_prompt=add_generation_prompt)


def encode_prompt(tok, chat: ChatFormat, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt the model continues to write the next assistant turn."""
    return chat.encode(tok, prompt_text(chat, messages, tools))


def tool_names(tools: list[dict] | None) -> set[str]:
    return {t.get("function", t)["name"] for t in tools or []}


@dataclass
class Reply:
    """A generated assistant turn, read: its text, the well-formed calls to offered tools, calls to
    tools that were not offered, and what could not be read as a call."""

    text: str
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    unknown: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)

    def message(self) -> dict:
        """The turn as an OpenAI-style assistant message."""
        msg: dict = {"role": "assistant", "content": self.content if self.calls else self.text}
        if self.calls:
            msg["tool_calls"] = [c.to_openai(i) for i, c in enumerate(self.calls)]
        return msg


def read_reply(text: str, tools: list[dict] | None) -> Reply:
    """Find the tool calls in a generated turn (no tools offered: the whole text is the answer)."""
    if not tools:
        return Reply(text, text)
    p = parse(text, tool_names(tools))
    malformed = [e for e in p.errors if not e.startswith("call to unknown tool")]
    return Reply(text, p.content, p.calls, p.unknown, malformed)


def tool_message(call_id: str, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
