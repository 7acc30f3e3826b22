"""Verify functions of the agent-notes example (scenarios name them as {"function": "verify.py:note_has"}).

A verify function is called as function(final_answer, state_path, scenario) and returns true/false or a score in
[0, 1]; the scenario's own fields (here "expect") tell it what to look for.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


def note_has(answer: str, state: Path | None, scenario: dict) -> float:
    """Partial credit for an added note: it exists (0.5), its body is right (0.25), it has every tag (0.25)."""
    expect = scenario["expect"]
    if state is None:
        return 0.0
    con = sqlite3.connect(Path(state).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        row = con.execute("SELECT body, tags FROM notes WHERE title = ?", (expect["title"],)).fetchone()
    finally:
        con.close()
    if row is None:
        return 0.0
    body, tags = row
    score = 0.5
    if body.strip(" .").lower() == expect["body"].strip(" .").lower():
        score += 0.25
    have = {t.strip().lower() for t in tags.split(",")}
    if all(t.lower() in have for t in expect.get("tags", [])):
        score += 0.25
    return score
