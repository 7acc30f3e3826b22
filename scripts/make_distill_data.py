"""Write the distillation example's data: answers the teacher (the default model) writes itself
to short instructions composed here, so the student learns the teacher's behaviour on text the
teacher would produce. Deterministic for a given model and seed.

    python scripts/make_distill_data.py       # examples/distill-q2k/{train,eval}.jsonl
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TOPICS = ["the moon", "rain", "bicycles", "bread", "volcanoes", "honey bees", "the ocean", "trains", "libraries",
          "coffee", "winter", "maps", "music", "gardens", "bridges", "clocks", "mountains", "rivers", "owls",
          "paper", "chess", "the desert", "lighthouses", "tea", "salt", "kites", "glass", "snow", "forests", "wind"]
TASKS = ["Write one sentence about {t}.", "Give two facts about {t}.", "Describe {t} to a child.",
         "Why do people like {t}?", "Write a short poem about {t}.", "What is interesting about {t}?",
         "Explain {t} in simple words.", "Give a tip related to {t}."]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from retrograd.data import chat as chat_mod
    from retrograd.generation.llama import Generator, SamplingParams
    from retrograd.models import default_model_path

    pairs = list(itertools.product(TASKS, TOPICS))
    random.Random(20261205).shuffle(pairs)
    prompts = [task.format(t=topic) for task, topic in pairs[:200]]
    model = default_model_path()
    gen = Generator(model, n_ctx=512, n_seq=1)
    chat = chat_mod.format_for(gen.tokenizer, None)
    records = []
    for i, prompt in enumerate(prompts):
        msgs = [{"role": "user", "content": prompt}]
        ids = gen.tokenizer.encode(chat.render(msgs, add_generation_prompt=True), add_bos=gen.tokenizer.add_bos)
        [c] = gen.generate(ids, [SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=80, seed=i)])
        records.append({"messages": msgs + [{"role": "assistant", "content": c.text.strip()}]})
        print(f"\r{i + 1}/{len(prompts)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    d = ROOT / "examples" / "distill-q2k"
    d.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", records[:160]), ("eval.jsonl", records[160:])):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"wrote {d}/train.jsonl (160) and eval.jsonl (40), answers by {model.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
