"""Write retrograd's example data sets (synthetic and checkable; nothing is copied from elsewhere).

    python scripts/make_examples.py      # rewrites examples/*/ *.jsonl deterministically

sft-extract: read a one-sentence news item and answer with a JSON object holding the person,
the city and the year. The answer is checkable (exact JSON), the base model answers in prose.
grpo-arith: "What is A + B? Reply with only the number." with A, B in 2..20 and the answer; the
base model is right 8% of the time and never replies with only the number.
pref-extract: the sft-extract questions as preference pairs: chosen is the faithful JSON answer,
rejected a plausible unfaithful one (a wrong year, a city or a person that is not in the sentence,
or a prose answer), so a model that prefers the chosen one must read the sentence.
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
    person = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    city, year = rng.choice(CITIES), rng.randint(1950, 2024)
    sentence = rng.choice(EVENTS).format(person=person, city=city, year=year)
    good = {"person": person, "city": city, "year": year}
    bad = dict(good)
    kind = rng.randrange(4)
    if kind == 0:
        bad["year"] = year + rng.choice([-11, -3, -1, 1, 2, 10])
    elif kind == 1:
        bad["city"] = rng.choice([c for c in CITIES if c != city])
    elif kind == 2:
        bad["person"] = f"{rng.choice(FIRST)} {rng.choice([x for x in LAST if x not in person])}"
    rejected = (json.dumps(bad) if kind < 3 else
                f"The sentence is about {person}, who is connected to {city}, and it happened in {year}.")
    return {"prompt": rng.choice(ASK).format(s=sentence), "chosen": json.dumps(good), "rejected": rejected}


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
    d = ROOT / "examples" / "pref-extract"
    d.mkdir(parents=True, exist_ok=True)
    records = [pref(rng) for _ in range(400)]
    write(d / "train.jsonl", records[:320])
    write(d / "eval.jsonl", records[320:])
    print(f"wrote {d}/train.jsonl (320) and eval.jsonl (80)")


if __name__ == "__main__":
    main()
