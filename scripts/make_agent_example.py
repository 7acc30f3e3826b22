"""Write the agentic GRPO example's data (synthetic; deterministic for one SQLite version).

    python scripts/make_agent_example.py     # rewrites examples/agent-notes/{seed.db,scenarios.jsonl,eval_scenarios.jsonl}

    python scripts/make_agent_example.py --demos   # also rewrites demos.jsonl (runs the example's MCP server)

seed.db: the notes store every rollout starts from (16 notes; the schema is notes_server.SCHEMA).
scenarios.jsonl (40, training) and eval_scenarios.jsonl (12, held out: other notes, other new titles): short
requests a 135M model can sometimes complete with one or two tool calls: read a note, look something up,
count tagged notes, add / change / delete a note, and a few two-step tasks. Each has a verify spec: SQL over the
rollout's final database for changes, answer checks for questions, and verify.py:note_has (partial credit) for
notes with tags.
demos.jsonl: one worked conversation per training scenario (the tool calls that solve it, the real server's
answers, a short final answer) for the SFT bootstrap (sft.toml): a 135M model does not call tools on its own, so
GRPO has no successful rollout to reinforce until it has seen a few. Held-out scenarios get no demonstration.
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "examples" / "agent-notes"
sys.path.insert(0, str(ROOT))

from retrograd.fsutil import atomic_copy, atomic_write  # noqa: E402

# the same as examples/agent-notes/notes_server.py SCHEMA (a test checks that they agree)
SCHEMA = ("CREATE TABLE IF NOT EXISTS notes (title TEXT PRIMARY KEY COLLATE NOCASE, body TEXT NOT NULL, "
          "tags TEXT NOT NULL DEFAULT '')")

NOTES = [
    ("dentist", "Appointment with Dr. Lee on Tuesday at 3pm.", "health"),
    ("wifi", "The guest network password is sunflower42.", "home"),
    ("groceries", "Eggs, bread, apples and coffee.", "shopping, home"),
    ("gym", "Workout on Monday and Thursday at 7am.", "health"),
    ("car", "Oil change is due in June at Fast Lube.", "car"),
    ("plumber", "Call Mario at 555-0142 about the kitchen sink.", "home"),
    ("book club", "Next book: The Hobbit. We meet on the first Friday.", "social"),
    ("passport", "The passport expires on 2027-03-01.", "travel"),
    ("meeting", "Project sync every Friday at 10am in room 4.", "work"),
    ("deadline", "The quarterly report is due on 30 September.", "work"),
    ("anna", "Anna's birthday is on 12 May. She likes tulips.", "family"),
    ("garden", "Water the tomatoes every morning.", "home"),
    ("pancakes", "2 eggs, 1 cup of flour and 1 cup of milk.", "cooking"),
    ("flight", "Flight LH 452 to Berlin leaves at 9:40 on Saturday.", "travel"),
    ("vet", "Take Max the cat to the vet on Wednesday.", "pets"),
    ("laptop", "The laptop warranty ends in November.", "work"),
]
BODY = {t: b for t, b, _ in NOTES}


def q(text: str) -> str:
    """An SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def read(title: str, fact: str) -> dict:
    return {"task": f"What does the note titled '{title}' say?", "verify": {"answer_contains": fact},
            "answer": BODY[title], "kind": "read"}


def ask(task: str, title: str, spec: dict) -> dict:
    return {"task": task, "verify": spec, "answer": BODY[title], "kind": "lookup"}


def add(title: str, body: str) -> dict:
    return {"task": f"Add a note titled '{title}' with body '{body}'.",
            "verify": {"sql": f"SELECT COUNT(*) = 1 FROM notes WHERE title = {q(title)} "
                              f"AND lower(trim(body, ' .')) = {q(body.lower().strip(' .'))}"},
            "kind": "add"}


def add_tagged(title: str, body: str, tags: list[str]) -> dict:
    tag_text = " and ".join(f"'{t}'" for t in tags)
    return {"task": f"Add a note titled '{title}' with body '{body}' and the tag{'s' if len(tags) > 1 else ''} "
                    f"{tag_text}.",
            "verify": {"function": "verify.py:note_has"}, "expect": {"title": title, "body": body, "tags": tags},
            "kind": "add_tagged"}


def update(title: str, body: str) -> dict:
    return {"task": f"Change the note '{title}' to say '{body}'",
            "verify": {"sql": f"SELECT lower(trim(body, ' .')) = {q(body.lower().strip(' .'))} FROM notes "
                              f"WHERE title = {q(title)}"},
            "kind": "update"}


def delete(title: str) -> dict:
    return {"task": f"Delete the note titled '{title}'.",
            "verify": [{"sql": f"SELECT COUNT(*) = 0 FROM notes WHERE title = {q(title)}"},
                       {"sql": f"SELECT COUNT(*) = {len(NOTES) - 1} FROM notes"}],
            "kind": "delete"}


def copy(task: str, source: str, title: str, value: str) -> dict:
    return {"task": task, "verify": {"sql": f"SELECT instr(lower(body), {q(value.lower())}) > 0 FROM notes "
                                            f"WHERE title = {q(title)}"},
            "kind": "two_step", "source": source}


TRAIN = [
    read("dentist", "Tuesday"), read("wifi", "sunflower42"), read("gym", "Monday"), read("car", "June"),
    read("plumber", "555-0142"), read("passport", "2027-03-01"), read("meeting", "10am"),
    read("deadline", "30 September"), read("pancakes", "flour"),
    ask("When is my dentist appointment?", "dentist", {"answer_contains": "Tuesday"}),
    ask("What is the phone number of the plumber?", "plumber", {"answer_contains": "555-0142"}),
    ask("When does my passport expire?", "passport", {"answer_contains": "2027"}),
    ask("Which book is the book club reading?", "book club", {"answer_contains": "Hobbit"}),
    ask("When is Anna's birthday?", "anna", {"answer_contains": "12 May"}),
    ask("How many eggs go in the pancakes?", "pancakes", {"answer_matches": r"(?i)\b(2|two)\b"}),
    {"task": "Which note mentions the kitchen sink? Answer with its title only.", "verify": {"answer_equals": "plumber"},
     "answer": "plumber", "kind": "search"},
    {"task": "Which note mentions coffee? Answer with its title only.", "verify": {"answer_equals": "groceries"},
     "answer": "groceries", "kind": "search"},
    {"task": "How many notes are tagged 'work'?", "verify": {"answer_matches": r"(?i)\b(3|three)\b"}, "answer": "3",
     "kind": "count"},
    {"task": "How many notes are tagged 'health'?", "verify": {"answer_matches": r"(?i)\b(2|two)\b"}, "answer": "2",
     "kind": "count"},
    add("milk", "buy 2 litres"), add("keys", "The spare key is under the mat"), add("bus", "Bus 42 leaves at 8:15"),
    add("tea", "buy green tea"), add("mom", "Call mom on Sunday"), add("bike", "Fix the back tyre"),
    add("rent", "Pay the rent on the 1st"), add("paint", "The living room is painted sky blue"),
    add_tagged("pharmacy", "pick up vitamins", ["health"]),
    add_tagged("train", "Buy tickets to Lyon", ["travel"]),
    add_tagged("printer", "Order black ink", ["work", "shopping"]),
    update("gym", "Workout on Tuesday at 6pm."), update("car", "Oil change is due in July."),
    update("meeting", "Project sync every Monday at 9am."), update("garden", "Water the tomatoes every evening."),
    delete("car"), delete("groceries"), delete("book club"), delete("deadline"),
    copy("Read the note 'wifi' and add a note titled 'guest' whose body is the wifi password.", "wifi", "guest",
         "sunflower42"),
    copy("Find the plumber's phone number and add a note titled 'mario' with that number as its body.", "plumber",
         "mario", "555-0142"),
]

EVAL = [
    read("flight", "9:40"), read("vet", "Wednesday"),
    ask("What is the name of my cat?", "vet", {"answer_contains": "Max"}),
    ask("What flowers does Anna like?", "anna", {"answer_contains": "tulip"}),
    {"task": "Which note mentions tomatoes? Answer with its title only.", "verify": {"answer_equals": "garden"},
     "answer": "garden", "kind": "search"},
    {"task": "How many notes are tagged 'travel'?", "verify": {"answer_matches": r"(?i)\b(2|two)\b"}, "answer": "2",
     "kind": "count"},
    add("bread", "bake rye bread on Friday"), add("plants", "Repot the cactus"),
    add_tagged("concert", "Tickets for Saturday at 8pm", ["social"]),
    update("laptop", "The laptop warranty ends in December."),
    delete("vet"),
    copy("Read the note 'flight' and add a note titled 'berlin' whose body is the flight number.", "flight", "berlin",
         "LH 452"),
]


# RL's own scenarios (rl_scenarios.jsonl, [agent].scenarios of config.toml): the skills the held-out set needs
# (copy the fact that answers the question, search when the title is not in the question, answer with a title,
# count by tag, carry a value from one note to another) asked in words the SFT demonstrations never used. GRPO on
# the demonstrations' own 40 tasks learns nothing: the bootstrap has memorised them, so most groups all pass.
# Only the notes the held-out set does not ask about (flight, vet, anna, garden, laptop are left out) and new
# titles for notes it adds.


def search(term: str, title: str) -> dict:
    return {"task": f"Which note mentions {term}? Answer with its title only.", "verify": {"answer_equals": title},
            "answer": title, "kind": "search"}


def count(tag: str, n: int, task: str = "How many notes are tagged '{}'?") -> dict:
    words = {1: "one", 2: "two", 3: "three", 4: "four"}
    return {"task": task.format(tag), "verify": {"answer_matches": rf"(?i)\b({n}|{words[n]})\b"}, "answer": str(n),
            "kind": "count"}


RL = [
    *[read(t, f) for t, f in [("groceries", "apples"), ("book club", "Hobbit")]],
    *[{**read(t, f), "task": p.format(t)} for p, (t, f) in zip(
        ["Show me the note '{}'.", "What is written in the note '{}'?", "Open my '{}' note and tell me what it says.",
         "Read me the note called '{}'.", "What is in the note '{}'?", "Tell me what my note '{}' says.",
         "What does my '{}' note say?", "Show me what the '{}' note says."],
        [("dentist", "3pm"), ("wifi", "sunflower42"), ("gym", "7am"), ("car", "Fast Lube"), ("plumber", "Mario"),
         ("meeting", "room 4"), ("deadline", "September"), ("pancakes", "milk")])],
    ask("Who is my dentist?", "dentist", {"answer_contains": "Lee"}),
    ask("What time is my dentist appointment?", "dentist", {"answer_contains": "3pm"}),
    ask("What is the guest wifi password?", "wifi", {"answer_contains": "sunflower42"}),
    ask("What do I need to buy at the shop?", "groceries", {"answer_contains": "apples"}),
    ask("At what time do I work out?", "gym", {"answer_contains": "7am"}),
    ask("On which days do I go to the gym?", "gym", {"answer_contains": "Thursday"}),
    ask("When is the oil change of my car due?", "car", {"answer_contains": "June"}),
    ask("Where do I get the oil change done?", "car", {"answer_contains": "Fast Lube"}),
    ask("What is the name of the plumber?", "plumber", {"answer_contains": "Mario"}),
    ask("Who do I call about the kitchen sink?", "plumber", {"answer_contains": "Mario"}),
    ask("When does the book club meet?", "book club", {"answer_contains": "first Friday"}),
    ask("What is the expiry date of my passport?", "passport", {"answer_contains": "2027-03-01"}),
    ask("In which room is the project sync?", "meeting", {"answer_contains": "room 4"}),
    ask("At what time is the project sync?", "meeting", {"answer_contains": "10am"}),
    ask("When is the quarterly report due?", "deadline", {"answer_contains": "30 September"}),
    ask("How much flour goes in the pancakes?", "pancakes", {"answer_contains": "1 cup"}),
    ask("What is the password of the guest network?", "wifi", {"answer_contains": "sunflower42"}),
    ask("Who is the doctor for my appointment?", "dentist", {"answer_contains": "Lee"}),
    search("the Hobbit", "book club"), search("Fast Lube", "car"), search("Mario", "plumber"),
    search("room 4", "meeting"), search("the quarterly report", "deadline"), search("flour", "pancakes"),
    search("sunflower42", "wifi"), search("Dr. Lee", "dentist"), search("apples", "groceries"),
    search("the passport", "passport"),
    count("home", 4), count("social", 1), count("cooking", 1), count("shopping", 1),
    count("family", 1), count("car", 1, "How many of my notes have the tag '{}'?"),
    copy("Read the note 'dentist' and add a note titled 'doctor' whose body is the doctor's name.", "dentist",
         "doctor", "Lee"),
    copy("Read the note 'passport' and add a note titled 'expiry' whose body is the expiry date.", "passport",
         "expiry", "2027-03-01"),
    copy("Read the note 'book club' and add a note titled 'reading' whose body is the book's title.", "book club",
         "reading", "Hobbit"),
    copy("Read the note 'car' and add a note titled 'garage' whose body is the garage's name.", "car", "garage",
         "Fast Lube"),
    copy("Read the note 'gym' and add a note titled 'workout' whose body is the time of the workout.", "gym",
         "workout", "7am"),
    copy("Read the note 'deadline' and add a note titled 'report' whose body is the due date.", "deadline",
         "report", "30 September"),
    copy("Read the note 'meeting' and add a note titled 'sync' whose body is the room of the meeting.", "meeting",
         "sync", "room 4"),
    add("shoes", "Take the boots to the cobbler"), add("library", "Return the books by Monday"),
    add("cinema", "See the new film on Sunday"), add("water", "Drink two litres a day"),
    add_tagged("swim", "Swimming on Wednesday at 6pm", ["health"]),
    add_tagged("hotel", "Book a room in Lisbon", ["travel"]),
    update("wifi", "The guest network password is moonlight7."), update("deadline", "The report is due on 15 October."),
    delete("pancakes"), delete("passport"),
]

def write_db(path: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "seed.db"
        con = sqlite3.connect(db)
        try:
            con.execute("PRAGMA journal_mode = DELETE")
            with con:
                con.execute(SCHEMA)
                con.executemany("INSERT INTO notes (title, body, tags) VALUES (?, ?, ?)", NOTES)
            con.execute("VACUUM")
        finally:
            con.close()
        atomic_copy(db, path)


def write_jsonl(path: Path, rows: list[dict], prefix: str) -> None:
    lines = [json.dumps({"id": f"{prefix}-{i:02d}", **r}, ensure_ascii=False) for i, r in enumerate(rows)]
    atomic_write(path, "\n".join(lines) + "\n")


#: the example's system prompt (config.toml [agent].system_prompt; a test checks that they agree)
SYSTEM = ("You manage the user's notes with the tools. Call a tool when you need to read or change a note, then give "
          "a short final answer.")


def solution(s: dict) -> list[tuple[str, dict]]:
    """The tool calls that solve a training scenario."""
    kind, task = s["kind"], s["task"]
    quoted = re.findall(r"'([^']*)'", task)
    if kind in ("read", "lookup"):
        title = quoted[0] if kind == "read" else next(t for t, b, _ in NOTES if b == s["answer"])
        return [("get_note", {"title": title})]
    if kind == "search":
        return [("search_notes", {"query": re.search(r"mentions (?:the )?([\w ]+)\?", task).group(1)})]
    if kind == "count":
        return [("search_notes", {"query": quoted[0]})]
    if kind == "add":
        return [("add_note", {"title": quoted[0], "body": quoted[1]})]
    if kind == "add_tagged":
        e = s["expect"]
        return [("add_note", {"title": e["title"], "body": e["body"], "tags": ", ".join(e["tags"])})]
    if kind == "update":
        return [("update_note", {"title": quoted[0], "body": quoted[1]})]
    if kind == "delete":
        return [("delete_note", {"title": quoted[0]})]
    if kind == "two_step":
        title = re.search(r"titled '([^']*)'", task).group(1)
        value = {"wifi": "sunflower42", "plumber": "555-0142"}[s["source"]]
        return [("get_note", {"title": s["source"]}), ("add_note", {"title": title, "body": value})]
    raise ValueError(f"no solution for kind {kind!r}")


def final_answer(s: dict, last: str) -> str:
    """The short answer after the calls (`last` is the last tool result)."""
    kind = s["kind"]
    if kind in ("read", "lookup"):
        return s["answer"]
    if kind == "search":
        return s["answer"]
    if kind == "count":
        tag = re.findall(r"'([^']*)'", s["task"])[0]
        # the search also matches words in bodies ("work" in "Workout"): count the notes whose [tags] hold it
        n = sum(1 for line in last.splitlines() if re.search(rf"\[[^\]]*\b{re.escape(tag)}\b[^\]]*\]", line))
        return f"{n} notes are tagged '{tag}'."
    return "Done: " + last + "."


def demos(rows: list[dict]) -> list[dict]:
    """Worked conversations for the training scenarios, with the real server's results on a fresh database."""
    from retrograd.agent.tools import ToolBox
    from retrograd.agent.verify import evaluate, fresh_state

    recs = []
    with tempfile.TemporaryDirectory() as tmp, \
            ToolBox([{"name": "notes", "command": ["{python}", "notes_server.py"], "cwd": str(OUT)}]) as box:
        tools = box.openai_tools()
        for i, s in enumerate(rows):
            state = fresh_state(OUT / "seed.db", Path(tmp), i)
            msgs: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": s["task"]}]
            result = ""
            for name, args in solution(s):
                r = box.call(name, args, state)
                if r.is_error:
                    raise SystemExit(f"{s['task']}: {name}({args}) failed: {r.text}")
                result = r.text
                msgs.append({"role": "assistant", "content": None,
                             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
                msgs.append({"role": "tool", "content": result})
            answer = final_answer(s, result)
            verdict = evaluate(s["verify"], answer, state, s, base=OUT)
            if not verdict.passed:     # a demonstration that fails its own scenario would teach the wrong thing
                raise SystemExit(f"{s['task']}: the demonstration does not pass its verify: {verdict.detail}")
            msgs.append({"role": "assistant", "content": answer})
            recs.append({"tools": tools, "messages": msgs})
    return recs


def main(argv: list[str]) -> None:
    assert len(TRAIN) == 40 and len(EVAL) == 12, (len(TRAIN), len(EVAL))
    write_db(OUT / "seed.db")
    write_jsonl(OUT / "scenarios.jsonl", TRAIN, "train")
    write_jsonl(OUT / "eval_scenarios.jsonl", EVAL, "eval")
    write_jsonl(OUT / "rl_scenarios.jsonl", RL, "rl")
    print(f"wrote {OUT / 'seed.db'} ({len(NOTES)} notes), {len(TRAIN)} training, {len(RL)} RL and {len(EVAL)} eval "
          "scenarios")
    if "--demos" in argv:
        recs = demos(TRAIN)
        atomic_write(OUT / "demos.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
        print(f"wrote {OUT / 'demos.jsonl'} ({len(recs)} worked conversations)")


if __name__ == "__main__":
    main(sys.argv[1:])
