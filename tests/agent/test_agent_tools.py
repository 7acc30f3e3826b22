"""The tool layer: [[agent.servers]] validation, the ToolBox over the shipped MCP notes server (stdio and
streamable HTTP), misbehaving servers, Python function tools, limits, name clashes and per-rollout state."""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path

import pytest

from retrograd.agent import mcp_client
from retrograd.agent.tools import ToolBox, compact_schema, cut, function_schema, parse_servers
from retrograd.agent.verify import fresh_state
from retrograd.errors import ConfigError, RetrogradError

from .agent_support import EXAMPLE, FAKE, fake_table, notes_table, start_http_notes, stop_proc

NOTE_TOOLS = ["search_notes", "get_note", "add_note", "update_note", "delete_note"]


# --- configuration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tables, where, what", [
    ([{"name": "a", "command": ["x"], "colour": "red"}], "[agent.servers][0].colour", "unknown key"),
    ([{"command": ["x"]}], "[agent.servers][0].name", "missing"),
    ([{"name": "Bad Name", "command": ["x"]}], "[agent.servers][0].name", "lower-case"),
    ([{"name": "a", "command": ["x"]}, {"name": "a", "url": "http://h/mcp"}], "[agent.servers][1].name",
     "already the name of [agent.servers][0]"),
    ([{"name": "a"}], "[agent.servers][0]:", "exactly one of command"),
    ([{"name": "a", "command": ["x"], "url": "http://h/mcp"}], "[agent.servers][0]:", "got command and url"),
    ([{"name": "a", "command": "python server.py"}], "[agent.servers][0].command", "expected a list of strings"),
    ([{"name": "a", "command": []}], "[agent.servers][0].command", "expected a list of strings"),
    ([{"name": "a", "command": ["x"], "env": {"K": 1}}], "[agent.servers][0].env", "table of strings"),
    ([{"name": "a", "url": "http://h/mcp", "env": {"K": "v"}}], "[agent.servers][0].env", "only for command"),
    ([{"name": "a", "command": ["x"], "cwd": "no/such/dir"}], "[agent.servers][0].cwd", "not a directory"),
    ([{"name": "a", "url": "ftp://h/mcp"}], "[agent.servers][0].url", "http:// or https://"),
    ([{"name": "a", "functions": "tools.py:f"}], "[agent.servers][0].functions", "file.py:function"),
    ([{"name": "a", "functions": ["tools.py"]}], "[agent.servers][0].functions[0]", "file.py:function"),
    ([{"name": "a", "functions": ["missing.py:f"]}], "[agent.servers][0].functions[0]", "no such file"),
    ([{"name": "a", "command": ["x"], "timeout_seconds": 0}], "[agent.servers][0].timeout_seconds", "> 0"),
    (["notes"], "[agent.servers][0]:", "expected a table"),
])
def test_server_tables_are_validated(tmp_path, tables, where, what):
    with pytest.raises(ConfigError) as e:
        parse_servers(tables, tmp_path, "cfg.toml")
    msg = str(e.value)
    assert msg.startswith("cfg.toml: ") and where in msg and what in msg, msg


def test_server_tables_resolve_python_and_paths(tmp_path):
    (tmp_path / "tools.py").write_text("def f(x: int) -> int:\n    return x\n")
    specs = parse_servers([{"name": "s", "command": ["{python}", "server.py", "--py={python}"], "env": {"A": "1"},
                            "timeout_seconds": 3},
                           {"name": "h", "url": "http://127.0.0.1:1/mcp"},
                           {"name": "p", "functions": ["tools.py:f"]}], tmp_path)
    s, h, p = specs
    assert s.transport == "stdio" and s.command == [sys.executable, "server.py", f"--py={sys.executable}"]
    assert s.cwd == tmp_path.resolve() and s.env == {"A": "1"} and s.timeout_seconds == 3.0
    assert h.transport == "http" and h.url.endswith("/mcp") and h.cwd is None
    assert p.transport == "python" and p.functions == ["tools.py:f"]
    assert s.describe()["env"] == ["A"]  # names only: values may be secrets


# --- the shipped notes server --------------------------------------------------------------------------------


def _titles(db: Path) -> set[str]:
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT title FROM notes").fetchall()
    con.close()
    return {r[0] for r in rows}


def test_notes_server_over_stdio(notes_box, seed_db, tmp_path):
    assert [t.name for t in notes_box.tools()] == NOTE_TOOLS
    add = notes_box.spec("add_note")
    assert add.server == "notes" and add.input_schema["required"] == ["title", "body"]
    fn = notes_box.openai_tools()[2]["function"]
    assert fn["name"] == "add_note" and "title" not in fn["parameters"]  # pydantic's titles are dropped
    assert set(fn["parameters"]["properties"]) == {"title", "body", "tags"}
    state = fresh_state(seed_db, tmp_path, "r0")
    r = notes_box.call("get_note", {"title": "Dentist"}, state=state)
    assert not r.is_error and "Tuesday at 3pm" in r.text and r.server == "notes"
    r = notes_box.call("get_note", {"title": "nothing"}, state=state)
    assert r.is_error and r.cause == "tool_error" and "no note titled" in r.text
    r = notes_box.call("search_notes", '{"query": "password"}', state=state)  # JSON text arguments
    assert r.text.startswith("wifi [home]:")
    r = notes_box.call("search_notes", {"query": ""})  # no state and no --db: the server says so
    assert r.is_error and "no database" in r.text


def test_per_rollout_state_is_isolated(notes_box, seed_db, tmp_path):
    a, b = fresh_state(seed_db, tmp_path, "a"), fresh_state(seed_db, tmp_path, "b")
    results = notes_box.call_many([("add_note", {"title": "milk", "body": "buy 2 litres"}, a),
                                   ("delete_note", {"title": "wifi"}, b)])
    assert [r.is_error for r in results] == [False, False], results
    assert "milk" in _titles(a) and "wifi" in _titles(a)
    assert "milk" not in _titles(b) and "wifi" not in _titles(b)
    assert "milk" not in _titles(seed_db) and "wifi" in _titles(seed_db)
    assert notes_box.call("get_note", {"title": "milk"}, state=b).cause == "tool_error"
    assert fresh_state(seed_db, tmp_path, "a") == a and "milk" not in _titles(a)  # a fresh copy again


def test_notes_server_over_http(http_notes, seed_db, tmp_path):
    a, b = fresh_state(seed_db, tmp_path, "a"), fresh_state(seed_db, tmp_path, "b")
    with ToolBox([{"name": "notes", "url": http_notes}]) as box:
        assert [t.name for t in box.tools()] == NOTE_TOOLS
        assert not box.call("update_note", {"title": "gym", "body": "Tuesday 6pm"}, state=a).is_error
        assert "Tuesday 6pm" in box.call("get_note", {"title": "gym"}, state=a).text
        assert "Monday" in box.call("get_note", {"title": "gym"}, state=b).text
    assert box.closed


def test_http_server_that_dies_is_server_died(seed_db, tmp_path):
    proc, url = start_http_notes()
    try:
        box = ToolBox([{"name": "notes", "url": url}], timeout_seconds=5)
        state = fresh_state(seed_db, tmp_path, "x")
        assert not box.call("get_note", {"title": "car"}, state=state).is_error
    finally:
        stop_proc(proc)
    r = box.call("get_note", {"title": "car"}, state=state)
    assert r.cause == "server_died" and "'notes' died" in r.text
    r = box.call("get_note", {"title": "car"}, state=state)  # the one reconnect fails too
    assert r.cause == "server_died" and "cannot connect" in r.text
    assert box.counts["server_died"] == 2
    box.close()
    box.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        box.call("get_note", {"title": "car"})


# --- misbehaving servers -------------------------------------------------------------------------------------


def test_fake_server_basics_and_state_meta():
    with ToolBox([fake_table()], output_chars=200) as box:
        assert box.call("echo", {"text": "hi"}).text == "hi"
        assert box.call("state", {}, state=Path("/x/rollout-3.db")).text == "/x/rollout-3.db"
        assert box.call("state", {}).text == "None"
        r = box.call("big", {"n": 5000})
        assert r.truncated and len(r.text) <= 200 and r.text.endswith("more characters]") and r.text.startswith("xxx")
        assert box.counts["truncated"] == 1
        r = box.call("echo", {"txt": "hi"})
        assert r.cause == "bad_arguments" and "'text' is a required property" in r.text
        r = box.call("echo", {"text": 5})
        assert r.cause == "bad_arguments" and "text" in r.text
        assert box.call("echo", "[1, 2]").cause == "bad_arguments"
        assert box.call("echo", "{not json").cause == "bad_arguments"
        r = box.call("nope", {})
        assert r.cause == "unknown_tool" and "echo" in r.text
        assert box.counts["calls"] == 9 and box.counts["bad_arguments"] == 4 and box.counts["unknown_tool"] == 1


def test_server_that_hangs_times_out_and_is_restarted(monkeypatch):
    monkeypatch.setattr(mcp_client, "PING_SECONDS", 0.3)
    with ToolBox([fake_table()], timeout_seconds=0.5) as box:
        pid = box.call("whoami", {}).text
        t0 = time.monotonic()
        r = box.call("sleep", {"seconds": 1.5})
        assert r.is_error and r.cause == "timeout" and r.text == "tool 'sleep' timed out after 0.5 s"
        assert time.monotonic() - t0 < 1.4
        r = box.call("whoami", {})  # the ping finds it hung: it is restarted for this call
        assert not r.is_error and r.text != pid
        assert box.counts["timeout"] == 1 and box.counts["restarts"] == 1


def test_server_that_exits_mid_run_is_server_died_then_restarted_once():
    with ToolBox([fake_table()]) as box:
        pid = box.call("whoami", {}).text
        r = box.call("crash", {})
        assert r.cause == "server_died" and "'fake' died" in r.text and "crashing on purpose" in r.text
        pid2 = box.call("whoami", {}).text  # restarted
        assert pid2.isdigit() and pid2 != pid
        assert box.call("crash", {}).cause == "server_died"
        t0 = time.monotonic()
        r = box.call("whoami", {})
        assert r.cause == "server_died" and "already restarted once" in r.text
        assert time.monotonic() - t0 < 0.5
        assert box.counts["server_died"] == 3 and box.counts["restarts"] == 1


def test_garbage_answers_are_bad_response():
    with ToolBox([fake_table()], timeout_seconds=0.5) as box:
        r = box.call("garbage", {})
        assert r.cause == "bad_response" and "not JSON-RPC" in r.text and "this is not json" in r.text
        r = box.call("bad_result", {})
        assert r.cause == "bad_response" and "not a valid tool result" in r.text
        assert box.call("echo", {"text": "still here"}).text == "still here"
        assert box.counts["bad_response"] == 2


@pytest.mark.parametrize("mode, expect", [
    ("garbage-start", "not JSON-RPC on stdout: 'Hello from a server that prints to stdout'"),
    ("exit-start", "exited during start-up; its stderr ended with:\nfake server: cannot open its configuration"),
    ("silent", "did not complete the MCP handshake within 1 s"),
])
def test_server_that_cannot_start(mode, expect):
    t0 = time.monotonic()
    with pytest.raises(RetrogradError) as e:
        ToolBox([fake_table("broken", mode)], start_timeout_seconds=1)
    assert "tool server 'broken'" in str(e.value) and expect in str(e.value), str(e.value)
    assert not isinstance(e.value, ConfigError)
    assert time.monotonic() - t0 < 8


def test_missing_program_and_unreachable_url():
    with pytest.raises(RetrogradError, match="cannot run 'no-such-program-xyz'"):
        ToolBox([{"name": "x", "command": ["no-such-program-xyz"]}])
    with pytest.raises(RetrogradError, match="cannot connect to http://127.0.0.1:9/mcp"):
        ToolBox([{"name": "x", "url": "http://127.0.0.1:9/mcp"}])


def test_tool_name_clash_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="'echo' is offered by both \\[agent.servers\\] 'one' and 'two'"):
        ToolBox([fake_table("one"), fake_table("two")])
    (tmp_path / "t.py").write_text("def whoami() -> str:\n    return 'me'\n")
    with pytest.raises(ConfigError, match="'whoami' is offered by both"):
        ToolBox([fake_table("one", env={"FAKE_PREFIX": "a_"}), fake_table("two"),
                 {"name": "py", "functions": ["t.py:whoami"]}], base=tmp_path)


def test_per_server_timeout_overrides_the_default():
    with ToolBox([fake_table(timeout_seconds=0.3)], timeout_seconds=30) as box:
        r = box.call("sleep", {"seconds": 1})
        assert r.cause == "timeout" and "after 0.3 s" in r.text


# --- Python function tools -----------------------------------------------------------------------------------

TOOLS_PY = '''
import time
from pathlib import Path
from typing import Literal, Optional


def lookup(word: str, limit: int = 3, mode: Literal["exact", "prefix"] = "exact", tags: Optional[list[str]] = None,
           state: Path | None = None) -> dict:
    """Look a word up in the rollout's word list.

    Args:
        word: the word to find
        limit (int): at most this many
            matches are returned
        mode: how to match
    """
    words = state.read_text().split() if state else []
    hits = [w for w in words if (w == word if mode == "exact" else w.startswith(word))]
    return {"hits": hits[:limit], "state": state.name if state else None}


def add_word(word: str, state: Path) -> str:
    """Append a word to the rollout's word list.

    :param word: the word to add
    """
    with open(state, "a") as f:
        f.write(" " + word)
    return "ok"


def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


async def twice(n: int) -> int:
    return 2 * n


def leave() -> None:
    raise SystemExit(3)
'''


@pytest.fixture()
def py_box(tmp_path):
    (tmp_path / "wordtools.py").write_text(TOOLS_PY)
    refs = [f"wordtools.py:{f}" for f in ("lookup", "add_word", "fail", "slow", "twice", "leave")]
    with ToolBox([{"name": "words", "functions": refs, "timeout_seconds": 0.5}], base=tmp_path) as box:
        yield box


def test_python_tool_schema_from_signature_and_docstring(py_box):
    spec = py_box.spec("lookup")
    assert spec.server == "words" and spec.description == "Look a word up in the rollout's word list."
    s = spec.input_schema
    assert s["required"] == ["word"] and s["additionalProperties"] is False
    assert set(s["properties"]) == {"word", "limit", "mode", "tags"}  # state is hidden
    assert s["properties"]["word"] == {"type": "string", "description": "the word to find"}
    assert s["properties"]["limit"] == {"type": "integer", "description": "at most this many matches are returned",
                                        "default": 3}
    assert s["properties"]["mode"]["enum"] == ["exact", "prefix"] and s["properties"]["mode"]["type"] == "string"
    assert s["properties"]["tags"]["type"] == "array" and s["properties"]["tags"]["items"] == {"type": "string"}
    assert py_box.spec("add_word").input_schema["properties"]["word"]["description"] == "the word to add"
    assert py_box.spec("twice").input_schema["properties"]["n"] == {"type": "integer"}


def test_python_tools_get_the_rollout_state(py_box, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("apple apricot")
    b.write_text("banana")
    r = py_box.call("lookup", {"word": "ap", "mode": "prefix"}, state=a)
    assert not r.is_error and r.text == '{"hits": ["apple", "apricot"], "state": "a.txt"}'
    assert py_box.call("add_word", {"word": "avocado"}, state=str(a)).text == "ok"
    assert a.read_text() == "apple apricot avocado" and b.read_text() == "banana"
    assert py_box.call("lookup", {"word": "x"}).text == '{"hits": [], "state": null}'
    assert py_box.call("lookup", {"word": "apple", "state": "/etc/passwd"}).cause == "bad_arguments"
    assert py_box.call("twice", {"n": 21}).text == "42"


def test_python_tool_errors_timeouts_and_concurrency(py_box):
    r = py_box.call("fail", {"reason": "no luck"})
    assert r.is_error and r.cause == "tool_error" and r.text == "ValueError: no luck"
    r = py_box.call("leave", {})
    assert r.cause == "tool_error" and "SystemExit(3)" in r.text
    r = py_box.call("lookup", {"word": "x", "limit": "3"})
    assert r.cause == "bad_arguments" and "limit" in r.text
    t0 = time.monotonic()
    r = py_box.call("slow", {"seconds": 5})
    assert r.cause == "timeout" and time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    rs = py_box.call_many([("slow", {"seconds": 0.3}), ("slow", {"seconds": 0.3}), ("twice", {"n": 1})])
    assert [r.text for r in rs] == ["done", "done", "2"]
    assert time.monotonic() - t0 < 0.55  # concurrent, not one after the other
    assert py_box.counts["tool_error"] == 2 and py_box.counts["timeout"] == 1


def test_python_tool_import_failure_is_a_config_error(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(ConfigError, match=r"\[agent.servers\]\[0\].functions\[0\].*importing it failed"):
        ToolBox([{"name": "b", "functions": ["broken.py:f"]}], base=tmp_path)
    (tmp_path / "ok.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="has no function 'f'"):
        ToolBox([{"name": "b", "functions": ["ok.py:f"]}], base=tmp_path)


# --- small pieces --------------------------------------------------------------------------------------------


def test_cut_keeps_within_the_limit():
    assert cut("abc", 10) == ("abc", False)
    for n in (64, 100, 4000):
        text, was_cut = cut("y" * 100_000, n)
        assert was_cut and len(text) <= n and text.endswith("more characters]")
        assert int(text.rsplit(": ", 1)[1].split()[0]) == 100_000 - text.index("\n")


def test_compact_schema_keeps_properties_named_title():
    s = {"title": "Args", "type": "object", "properties": {"title": {"title": "Title", "type": "string"}}}
    assert compact_schema(s) == {"type": "object", "properties": {"title": {"type": "string"}}}


def test_function_schema_numpy_docstring():
    def f(a: float, b: bool = False, *args, **kw) -> None:
        """Do a thing.

        Parameters
        ----------
        a : float
            the first
        b : bool
            the second
        """

    spec, wants_state = function_schema(f)
    assert not wants_state and spec.description == "Do a thing."
    assert spec.input_schema["properties"] == {"a": {"type": "number", "description": "the first"},
                                               "b": {"type": "boolean", "description": "the second", "default": False}}


def test_example_config_servers_parse():
    from retrograd.config import load
    from retrograd.run_setup import config_dir

    cfg = load(EXAMPLE / "config.toml")
    (spec,) = parse_servers(cfg.agent.servers, config_dir(cfg))
    assert spec.command == [sys.executable, "notes_server.py"] and spec.cwd == EXAMPLE
    assert notes_table()["command"][1] == "notes_server.py" and FAKE.is_file()


def test_toolbox_from_config_and_relative_state_paths(seed_db, tmp_path, monkeypatch):
    from retrograd.config import load

    cfg = load(EXAMPLE / "config.toml")
    monkeypatch.chdir(tmp_path)
    state = fresh_state(seed_db, Path("rollouts"), 1)
    assert state.is_absolute() and state.parent == tmp_path / "rollouts"
    with ToolBox.from_config(cfg) as box:
        assert box.timeout_seconds == 10.0 and box.output_chars == 1500 and box.label == str(EXAMPLE / "config.toml")
        relative = Path("rollouts") / state.name  # resolved here: the server runs in the example's directory
        assert not box.call("delete_note", {"title": "vet"}, state=relative).is_error
    assert "vet" not in _titles(state)
