"""Scenario files (FILE:LINE errors), verify specs of every kind, fresh per-rollout state, and the shipped
example's data: every scenario is solvable and not already solved by the seed database."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from retrograd.agent import scenarios, verify
from retrograd.agent.scenarios import ScenarioError
from retrograd.agent.verify import Verdict, discard_state, evaluate, fresh_state
from retrograd.errors import RetrogradError

from .agent_support import EXAMPLE, ROOT


def write(tmp_path: Path, *lines: str, name: str = "s.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


# --- scenario files ------------------------------------------------------------------------------------------


def test_scenarios_load_with_extras_defaults_and_comments(tmp_path):
    p = write(tmp_path,
              '# a comment',
              '{"task": "Say hi.", "verify": {"answer_contains": "hi"}, "answer": "hi", "level": 1}',
              '',
              '{"task": "Count.", "answer": 3, "id": 7}')
    a, b = scenarios.load(p)
    assert a.task == "Say hi." and a.verify == {"answer_contains": "hi"} and a.answer == "hi"
    assert a.id == "s.jsonl:2" and a.line == 2 and a.extra == {"level": 1} and a.base == tmp_path.resolve()
    assert b.id == "7" and b.answer == "3" and b.verify is None and b.line == 4
    assert a.to_dict() == {"id": "s.jsonl:2", "task": "Say hi.", "verify": {"answer_contains": "hi"}, "answer": "hi",
                           "level": 1}
    assert a.check("Hi there", None).passed and not a.check("hello", None).passed
    assert len(scenarios.load(p, limit=1)) == 1


@pytest.mark.parametrize("line, what", [
    ('{"task": "x"', "not valid JSON"),
    ('["task"]', "expected a JSON object"),
    ('{"verify": {"sql": "SELECT 1"}}', 'missing "task"'),
    ('{"task": "  "}', '"task" must be a non-empty string'),
    ('{"task": "x", "verify": {"regex": "a"}}', "verify: unknown kind 'regex'"),
    ('{"task": "x", "verify": {"sql": "SELECT 1", "answer_equals": "1"}}', "exactly one of"),
    ('{"task": "x", "verify": {"answer_matches": "(unclosed"}}', "not a valid regular expression"),
    ('{"task": "x", "verify": {"sql": "SELECT (1"}}', "not a complete SQL statement"),
    ('{"task": "x", "verify": {"function": "nofile.py:check"}}', "no such file"),
    ('{"task": "x", "verify": {"function": "check"}}', 'expected "file.py:function"'),
    ('{"task": "x", "verify": []}', "an empty list"),
    ('{"task": "x", "verify": [{"answer_contains": "a"}, {"answer_contains": 3}]}', "[1]: answer_contains"),
    ('{"task": "x", "verify": "yes"}', "expected a table"),
    ('{"task": "x", "answer": ["a"]}', '"answer" must be a string or a number'),
    ('{"task": "x", "id": ""}', '"id" must be'),
])
def test_scenario_errors_name_file_and_line(tmp_path, line, what):
    p = write(tmp_path, '{"task": "fine"}', line)
    with pytest.raises(ScenarioError) as e:
        scenarios.load(p)
    assert str(e.value).startswith(f"{p}:2: ") and what in str(e.value), str(e.value)
    assert isinstance(e.value, RetrogradError)


def test_scenario_file_level_errors(tmp_path):
    with pytest.raises(ScenarioError, match="no such scenarios file"):
        scenarios.load(tmp_path / "none.jsonl")
    with pytest.raises(ScenarioError, match="no scenarios"):
        scenarios.load(write(tmp_path, "", "# only a comment"))
    with pytest.raises(ScenarioError, match=r":3: id 'a' is used again \(first on line 1\)"):
        scenarios.load(write(tmp_path, '{"task": "x", "id": "a"}', '{"task": "y"}', '{"task": "z", "id": "a"}'))


# --- verify specs ----------------------------------------------------------------------------------------------


@pytest.fixture()
def db(tmp_path) -> Path:
    p = tmp_path / "state.db"
    con = sqlite3.connect(p)
    with con:
        con.execute("CREATE TABLE t (k TEXT, v INTEGER)")
        con.execute("INSERT INTO t VALUES ('a', 1), ('b', 0)")
    con.close()
    return p


def test_answer_checks():
    assert evaluate({"answer_equals": "Plumber"}, '  "plumber." ', None).passed
    assert not evaluate({"answer_equals": "plumber"}, "the plumber", None).passed
    assert evaluate({"answer_contains": "TUESDAY"}, "On tuesday at 3", None).passed
    assert not evaluate({"answer_contains": "friday"}, "On tuesday", None).passed
    assert evaluate({"answer_matches": r"\b3\b"}, "There are 3 notes", None).passed
    assert not evaluate({"answer_matches": r"\b3\b"}, "There are 33 notes", None).passed
    v = evaluate({"answer_contains": "x"}, None, None)
    assert not v.passed and "no final answer" in v.detail and v.score == 0.0
    passed, detail = evaluate({"answer_contains": "x"}, "x", None)  # unpacks as (passed, detail)
    assert passed and "found" in detail


def test_sql_checks(db):
    assert evaluate({"sql": "SELECT v = 1 FROM t WHERE k = 'a'"}, "", db).passed
    v = evaluate({"sql": "SELECT v FROM t WHERE k = 'b'"}, "", db)
    assert not v.passed and "false" in v.detail
    v = evaluate({"sql": "SELECT v FROM t WHERE k = 'zz'"}, "", db)
    assert not v.passed and "no row" in v.detail
    v = evaluate({"sql": "SELECT nope FROM t"}, "", db)
    assert not v.passed and "sql error" in v.detail and "no such column" in v.detail
    v = evaluate({"sql": "DELETE FROM t"}, "", db)  # the state is opened read-only
    assert not v.passed and "readonly" in v.detail.replace("-", "")
    assert evaluate({"sql": "SELECT COUNT(*) = 2 FROM t"}, "", db).passed
    v = evaluate({"sql": "SELECT 1"}, "", None)
    assert not v.passed and "no state database" in v.detail
    assert not evaluate({"sql": "SELECT 1"}, "", db.parent / "missing.db").passed


def test_function_checks(tmp_path, db):
    (tmp_path / "checks.py").write_text(
        "def exact(answer, state, scenario):\n    return answer == scenario['want']\n"
        "def half(answer, state, scenario):\n    return 0.5\n"
        "def boom(answer, state, scenario):\n    raise KeyError('want')\n"
        "def weird(answer, state, scenario):\n    return 'yes'\n"
        "def rows(answer, state, scenario):\n"
        "    import sqlite3\n    return sqlite3.connect(state).execute('SELECT COUNT(*) FROM t').fetchone()[0] == 2\n")
    sc = {"want": "42"}
    assert evaluate({"function": "checks.py:exact"}, "42", None, sc, tmp_path).passed
    assert not evaluate({"function": "checks.py:exact"}, "41", None, sc, tmp_path).passed
    v = evaluate({"function": "checks.py:half"}, "", None, sc, tmp_path)
    assert not v.passed and v.score == 0.5
    v = evaluate({"function": "checks.py:boom"}, "", None, sc, tmp_path)
    assert not v.passed and "raised KeyError" in v.detail
    v = evaluate({"function": "checks.py:weird"}, "", None, sc, tmp_path)
    assert not v.passed and "expected true/false or a number" in v.detail
    assert evaluate({"function": "checks.py:rows"}, "", db, sc, tmp_path).passed
    v = evaluate({"function": "checks.py:missing"}, "", None, sc, tmp_path)
    assert not v.passed and "has no function 'missing'" in v.detail
    v = evaluate({"function": "gone.py:f"}, "", None, sc, tmp_path)
    assert not v.passed and "no such file" in v.detail


def test_lists_need_every_check_and_average_the_score(tmp_path, db):
    (tmp_path / "c.py").write_text("def half(a, s, sc):\n    return 0.5\n")
    spec = [{"answer_contains": "done"}, {"sql": "SELECT COUNT(*) = 2 FROM t"}, {"function": "c.py:half"}]
    v = evaluate(spec, "done", db, {}, tmp_path)
    assert not v.passed and v.score == pytest.approx(2.5 / 3) and "1 of 3 checks failed" in v.detail
    v = evaluate(spec[:2], "done", db)
    assert v.passed and v.score == 1.0
    assert evaluate(None, "x", None) == Verdict(False, "the scenario has no verify spec", 0.0)
    assert "invalid verify spec" in evaluate({"nope": 1}, "x", None).detail


def test_fresh_state_copies_the_template(tmp_path, db):
    work = tmp_path / "rollouts"
    a, b = fresh_state(db, work, 0), fresh_state(db, work, "step 3/7")
    assert a.name == "state-0.db" and b.name == "state-step_3_7.db" and a.parent == work
    con = sqlite3.connect(a)
    with con:
        con.execute("DELETE FROM t")
    con.close()
    assert not evaluate({"sql": "SELECT COUNT(*) FROM t"}, "", a).passed
    assert evaluate({"sql": "SELECT COUNT(*) FROM t"}, "", b).passed
    assert evaluate({"sql": "SELECT COUNT(*) FROM t"}, "", fresh_state(db, work, 0)).passed  # fresh again
    (work / "state-0.db-journal").write_text("x")
    discard_state(a)
    assert not a.exists() and not (work / "state-0.db-journal").exists()
    discard_state(a)  # nothing left: fine
    assert fresh_state(None, work, 1) is None
    with pytest.raises(RetrogradError, match="state template not found"):
        fresh_state(tmp_path / "none.db", work, 1)


# --- the shipped example -------------------------------------------------------------------------------------


def _solve(sc: scenarios.Scenario, state: Path) -> str:
    """Do what the scenario asks directly on the database; the final answer for questions."""
    con = sqlite3.connect(state)
    title = None
    with con:
        if sc.extra["kind"] == "add":
            title, body = sc.task.split("'")[1], sc.task.split("'")[3]
            con.execute("INSERT INTO notes VALUES (?, ?, '')", (title, body))
        elif sc.extra["kind"] == "add_tagged":
            e = sc.extra["expect"]
            con.execute("INSERT INTO notes VALUES (?, ?, ?)", (e["title"], e["body"], ", ".join(e["tags"])))
        elif sc.extra["kind"] == "update":
            title, body = sc.task.split("'")[1], sc.task.split("'")[3]
            con.execute("UPDATE notes SET body = ? WHERE title = ?", (body, title))
        elif sc.extra["kind"] == "delete":
            con.execute("DELETE FROM notes WHERE title = ?", (sc.task.split("'")[1],))
        elif sc.extra["kind"] == "two_step":
            body = con.execute("SELECT body FROM notes WHERE title = ?", (sc.extra["source"],)).fetchone()[0]
            title = re.search(r"titled '([^']+)'", sc.task).group(1)
            con.execute("INSERT INTO notes VALUES (?, ?, '')", (title, body))
    con.close()
    return sc.answer or "Done."


@pytest.mark.parametrize("name, count", [("scenarios.jsonl", 40), ("eval_scenarios.jsonl", 12),
                                         ("rl_scenarios.jsonl", 61)])
def test_example_scenarios_are_solvable_and_not_presolved(tmp_path, name, count):
    scs = scenarios.load(EXAMPLE / name)
    assert len(scs) == count and all(sc.verify is not None for sc in scs)
    for i, sc in enumerate(scs):
        untouched = fresh_state(EXAMPLE / "seed.db", tmp_path, f"u{i}")
        assert not sc.check("I don't know.", untouched).passed, sc.id
        state = fresh_state(EXAMPLE / "seed.db", tmp_path, f"s{i}")
        answer = _solve(sc, state)
        v = sc.check(answer, state)
        assert v.passed and v.score == 1.0, (sc.id, v.detail)


def test_example_data_is_what_the_script_writes(tmp_path):
    before = {n: (EXAMPLE / n).read_bytes() for n in ("scenarios.jsonl", "eval_scenarios.jsonl", "rl_scenarios.jsonl")}
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_agent_example as m
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    m.write_jsonl(tmp_path / "a.jsonl", m.TRAIN, "train")
    m.write_jsonl(tmp_path / "b.jsonl", m.EVAL, "eval")
    m.write_jsonl(tmp_path / "c.jsonl", m.RL, "rl")
    assert (tmp_path / "a.jsonl").read_bytes() == before["scenarios.jsonl"]
    assert (tmp_path / "b.jsonl").read_bytes() == before["eval_scenarios.jsonl"]
    assert (tmp_path / "c.jsonl").read_bytes() == before["rl_scenarios.jsonl"]
    m.write_db(tmp_path / "seed.db")
    con = sqlite3.connect(tmp_path / "seed.db")
    shipped = sqlite3.connect(EXAMPLE / "seed.db")
    try:
        assert con.execute("SELECT * FROM notes").fetchall() == shipped.execute("SELECT * FROM notes").fetchall()
    finally:
        con.close()
        shipped.close()
    out = subprocess.run([sys.executable, "-c", "import notes_server as n; print(n.SCHEMA)"], cwd=EXAMPLE,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == m.SCHEMA
    assert json.loads((EXAMPLE / "scenarios.jsonl").read_text().splitlines()[0])["id"] == "train-00"
    assert verify.KINDS == ("sql", "answer_equals", "answer_contains", "answer_matches", "function")


def test_rl_scenarios_stay_clear_of_the_demonstrations_and_the_held_out_set():
    """agent_grpo's scenarios ask what the demonstrations never asked, and nothing about the notes or new titles
    the held-out scenarios use: a gain on the held-out set is not a memorised answer."""
    rl, train, held = (scenarios.load(EXAMPLE / n) for n in ("rl_scenarios.jsonl", "scenarios.jsonl",
                                                              "eval_scenarios.jsonl"))
    assert not {sc.task for sc in rl} & {sc.task for sc in [*train, *held]}
    held_notes = {"flight", "vet", "anna", "garden", "laptop", "bread", "plants", "concert", "berlin"}
    for sc in rl:
        quoted = set(re.findall(r"'([^']*)'", sc.task))
        assert not quoted & held_notes, (sc.id, quoted & held_notes)
        assert (sc.answer or "") not in {h.answer for h in held if h.answer}, sc.id
    kinds = [sc.extra["kind"] for sc in rl]
    # the skills the bootstrap fails most on the held-out set get the most scenarios
    assert min(kinds.count(k) for k in ("read", "lookup", "search", "count", "two_step")) >= 6


def test_shipped_demonstrations_solve_their_scenarios():
    """demos.jsonl is what the script writes: each conversation's calls, run on the real server against a fresh
    database, give the shipped tool results, and its final answer and state pass the scenario's verify."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_agent_example as m
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    shipped = [json.loads(line) for line in (EXAMPLE / "demos.jsonl").read_text().splitlines()]
    assert m.demos(m.TRAIN) == shipped and len(shipped) == len(m.TRAIN)
    assert shipped[0]["messages"][0]["content"] == m.SYSTEM
    cfg = tomllib.loads((EXAMPLE / "config.toml").read_text())
    assert cfg["agent"]["system_prompt"] == m.SYSTEM
