"""Write retrograd's example data sets (synthetic and checkable; nothing is copied from elsewhere).

    python scripts/make_examples.py      # rewrites examples/*/ *.jsonl deterministically

sft-extract: read a one-sentence news item and answer with a JSON object holding the person,
the city and the year. The answer is checkable (exact JSON), the base model answers in prose.
grpo-arith: "What is A + B? Reply with only the number." with A, B in 2..20 and the answer; the
base model is right 8% of the time and never replies with only the number.
pref-arith: the grpo-arith questions as preference pairs: chosen is the right number alone;
rejected is either right but wordy ("The answer is 17.") or only a number but wrong (off by 1, 2-3
or 10). The base model prefers the wordy answers every time and the wrong number 40% of the time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FIRST = ["Maria", "Jonas", "Aiko", "Tomas", "Leila", "Omar", "Greta", "Ravi", "Chloe", "Mateo", "Ingrid", "Kwame",
         "Sofia", "Dmitri", "Amara", "Lucas", "Hana", "Pedro", "Zara", "Felix", "Nadia", "Tariq", "Elena", "Bruno",
         "Yuki", "Astrid", "Diego", "Fatima", "Henrik", "Priya"]
LAST = ["Lopez", "Berg", "Tanaka", "Novak", "Haddad", "Farouk", "Lindqvist", "Sharma", "Dubois", "Rossi",
        "Olsen", "Mensah", "Costa", "Volkov", "Okafor", "Moreau", "Kim", "Alves", "Hussain", "Weber",
        "Petrova", "Aziz", "Ionescu", "Ferraz", "Sato", "Nilsen", "Ramos", "Karimi", "Strand", "Iyer"]
CITIES = ["Lisbon", "Oslo", "Kyoto", "Prague", "Beirut", "Cairo", "Uppsala", "Pune", "Lyon", "Turin", "Bergen",
          "Accra", "Porto", "Kazan", "Lagos", "Nantes", "Busan", "Recife", "Lahore", "Leipzig", "Sofia", "Tunis",
          "Cluj", "Braga", "Osaka", "Aarhus", "Bilbao", "Shiraz", "Malmo", "Mysore"]
EVENTS = [
    "In {year}, {person} moved to {city} to open a small bakery.",
    "{person} won the {city} chess open in {year}.",
    "The {city} city council hired {person} as chief engineer in {year}.",
    "{person} published a book about the history of {city} in {year}.",
    "Back in {year}, {person} ran the {city} marathon in under three hours.",
    "{person} founded a music school in {city} in {year}.",
    "In {year} the museum of {city} bought a painting by {person}.",
    "{person} was born in {city} in {year} and still lives there.",
    "A bridge in {city} was designed by {person} and opened in {year}.",
    "{person} became the first woman to captain the {city} rowing club in {year}.",
    "During {year}, {person} taught mathematics at a school in {city}.",
    "{person} opened a bike repair shop in {city} in {year}.",
]
ASK = [
    "Extract the person, city and year as JSON: {s}",
    "Return JSON with keys person, city, year for this sentence: {s}",
    "{s}\nGive me the person, the city and the year as a JSON object.",
]


def make(rng: random.Random) -> dict:
    person = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    city, year = rng.choice(CITIES), rng.randint(1950, 2024)
    sentence = rng.choice(EVENTS).format(person=person, city=city, year=year)
    answer = json.dumps({"person": person, "city": city, "year": year})
    return {"messages": [{"role": "user", "content": rng.choice(ASK).format(s=sentence)},
                         {"role": "assistant", "content": answer}]}


def arith(rng: random.Random) -> dict:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    return {"prompt": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)}


def pref(rng: random.Random) -> dict:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    kind = rng.randrange(6)
    if kind < 3:       # right, but not what was asked for
        rejected = [f"The answer is {a + b}.", f"{a} + {b} = {a + b}", f"Sure! {a} plus {b} equals {a + b}."][kind]
    else:              # what was asked for, but wrong
        rejected = str(a + b + rng.choice([[-1, 1], [-3, -2, 2, 3], [-10, 10]][kind - 3]))
    return {"prompt": f"What is {a} + {b}? Reply with only the number.", "chosen": str(a + b),
            "rejected": rejected}


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    rng = random.Random(20261202)
    d = ROOT / "examples" / "sft-extract"
    d.mkdir(parents=True, exist_ok=True)
    records = [make(rng) for _ in range(480)]
    write(d / "train.jsonl", records[:400])
    write(d / "eval.jsonl", records[400:])
    print(f"wrote {d}/train.jsonl (400) and eval.jsonl (80)")
    rng = random.Random(20261203)
    d = ROOT / "examples" / "grpo-arith"
    d.mkdir(parents=True, exist_ok=True)
    records = [arith(rng) for _ in range(560)]
    write(d / "train.jsonl", records[:500])
    write(d / "eval.jsonl", records[500:])
    print(f"wrote {d}/train.jsonl (500) and eval.jsonl (60)")
    rng = random.Random(20261204)
    d = ROOT / "examples" / "pref-arith"
    d.mkdir(parents=True, exist_ok=True)
    records = [pref(rng) for _ in range(400)]
    write(d / "train.jsonl", records[:320])
    write(d / "eval.jsonl", records[320:])
    print(f"wrote {d}/train.jsonl (320) and eval.jsonl (80)")


if __name__ == "__main__":
    main()
