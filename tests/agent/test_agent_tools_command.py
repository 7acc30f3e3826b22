"""`retrograd tools list CONFIG [--json] [--no-connect]` (called as retrograd.commands.tools.run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from retrograd.commands import tools
from retrograd.errors import ConfigError

from .agent_support import EXAMPLE, FAKE


def run(config: Path, *, as_json: bool = False, no_connect: bool = False) -> int:
    return tools.run(argparse.Namespace(config=str(config), json=as_json, no_connect=no_connect))


def config(tmp_path: Path, servers: str, algorithm: str = "agent_grpo") -> Path:
    p = tmp_path / "cfg.toml"
    p.write_text(f'[run]\nalgorithm = "{algorithm}"\n\n[agent]\ntool_timeout_seconds = 4\n\n{servers}')
    return p


def test_list_example_without_connecting(capsys):
    assert run(EXAMPLE / "config.toml", no_connect=True) == 0
    out = capsys.readouterr().out
    assert f"config {EXAMPLE / 'config.toml'}" in out
    assert "server notes  stdio  " in out and "notes_server.py" in out and "[timeout 10 s]" in out
    assert "search_notes" not in out
    assert run(EXAMPLE / "config.toml", as_json=True, no_connect=True) == 0
    data = json.loads(capsys.readouterr().out)
    (s,) = data["servers"]
    assert s["name"] == "notes" and s["transport"] == "stdio" and s["command"][1] == "notes_server.py"
    assert s["cwd"] == str(EXAMPLE) and "tools" not in s


def test_list_example_tools_with_schemas(capsys):
    assert run(EXAMPLE / "config.toml", as_json=True) == 0
    (s,) = json.loads(capsys.readouterr().out)["servers"]
    names = [t["name"] for t in s["tools"]]
    assert names == ["search_notes", "get_note", "add_note", "update_note", "delete_note"]
    add = s["tools"][2]
    assert add["description"] == "Add a new note." and add["input_schema"]["required"] == ["title", "body"]
    assert run(EXAMPLE / "config.toml") == 0
    out = capsys.readouterr().out
    assert "  5 tools" in out and "  add_note(title: string, body: string, tags?: string)" in out
    assert '      schema {"properties": {"title": ' in out


def test_broken_server_is_reported_and_others_still_listed(tmp_path, capsys):
    cfg = config(tmp_path, f'[[agent.servers]]\nname = "bad"\ncommand = ["{{python}}", "{FAKE}", "exit-start"]\n\n'
                           f'[[agent.servers]]\nname = "good"\ncommand = ["{{python}}", "{FAKE}"]\n'
                           f'env = {{ TOKEN = "secret" }}\n')
    assert run(cfg) == 1
    out = capsys.readouterr().out
    assert "server bad  stdio" in out and "error: tool server 'bad'" in out and "cannot open its configuration" in out
    assert "server good  stdio" in out and "  echo(text: string)" in out and "env TOKEN" in out
    assert "secret" not in out
    assert run(cfg, as_json=True) == 1
    bad, good = json.loads(capsys.readouterr().out)["servers"]
    assert "exited during start-up" in bad["error"] and "tools" not in bad
    assert good["env"] == ["TOKEN"] and "echo" in [t["name"] for t in good["tools"]]


def test_clashing_tool_names_exit_2(tmp_path, capsys):
    table = f'[[agent.servers]]\nname = "{{}}"\ncommand = ["{{{{python}}}}", "{FAKE}"]\n\n'
    cfg = config(tmp_path, table.format("one") + table.format("two"))
    assert run(cfg, as_json=True) == 2
    assert json.loads(capsys.readouterr().out)["clashes"]["echo"] == ["one", "two"]
    assert run(cfg) == 2
    assert "tool 'echo' is offered by several servers: one, two" in capsys.readouterr().err


def test_no_servers_and_bad_tables(tmp_path, capsys):
    assert run(config(tmp_path, "", algorithm="sft")) == 0
    assert "no tool servers" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"cfg.toml: \[agent.servers\]\[0\].command: expected a list of strings"):
        run(config(tmp_path, '[[agent.servers]]\nname = "x"\ncommand = "python server.py"\n'))
    with pytest.raises(ConfigError, match="no such configuration file"):
        run(tmp_path / "missing.toml")
    p = tmp_path / "cfg.toml"
    p.write_text('[run]\nalgorithm = "nope"\n')
    with pytest.raises(ConfigError, match=r"\[run\].algorithm"):
        run(p)
