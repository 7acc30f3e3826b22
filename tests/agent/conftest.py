"""Fixtures of the agent tests: the shipped notes example (stdio and HTTP) and its seed database."""

from __future__ import annotations

from pathlib import Path

import pytest

from .agent_support import EXAMPLE, notes_table, start_http_notes, stop_proc

#: the example's system prompt (examples/agent-notes/config.toml)
SYSTEM = ("You manage the user's notes with the tools. Call a tool when you need to read or change a note, then give "
          "a short final answer.")


@pytest.fixture(scope="module")
def http_notes():
    proc, url = start_http_notes()
    yield url
    stop_proc(proc)


@pytest.fixture(scope="module")
def notes_box():
    from retrograd.agent.tools import ToolBox

    with ToolBox([notes_table()]) as box:
        yield box


@pytest.fixture()
def seed_db() -> Path:
    return EXAMPLE / "seed.db"


@pytest.fixture(scope="session")
def notes_adapter(smollm, tmp_path_factory) -> Path:
    """An adapter taught by SFT to read a note with get_note and answer with its body: the default
    model does not call tools on its own, and the rollout, collect and agent_grpo tests need
    conversations that do. The tool results in the records are the real server's answers."""
    import sqlite3

    from conftest import train_sft

    from retrograd.agent.tools import ToolBox
    from retrograd.agent.verify import fresh_state

    d = tmp_path_factory.mktemp("notes-sft")
    con = sqlite3.connect(EXAMPLE / "seed.db")
    titles = [r[0] for r in con.execute("SELECT title FROM notes ORDER BY title")][:12]
    con.close()
    recs = []
    with ToolBox([notes_table()]) as box:
        tools = box.openai_tools()
        state = fresh_state(EXAMPLE / "seed.db", d, "sft")
        for t in titles:
            result = box.call("get_note", {"title": t}, state).text
            body = result.split(": ", 1)[1]
            recs.append({"tools": tools, "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What does the note titled '{t}' say?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "get_note", "arguments": {"title": t}}}]},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": body}]})
    train_sft(d, recs, smollm, name="sft", ctx=1024, steps=12)
    return d / "runs" / "sft" / "adapter.gguf"
