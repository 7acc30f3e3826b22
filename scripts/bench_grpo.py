"""Time of each phase of a GRPO step on the default model: generation (llama.cpp, adapter swapped
in from memory), reference log-probs (base model, our graph), forward, LM head, backward,
optimizer, and the total, as medians over the timed steps.

    python scripts/bench_grpo.py [--config examples/grpo-arith/config.toml] [--steps 4] [--threads N]

The default workload is the grpo-arith example: 4 prompts x 8 completions x up to 24 new tokens,
beta 0.04 — the same work as the TRL anchor in ../shared/DESIGN.md (43.6 s per step there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "grpo-arith" / "config.toml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    os.environ["RETRO_THREADS"] = str(args.threads)
    from retrograd.config import load
    from retrograd.trainer import open_model

    cfg = load(Path(args.config))
    cfg.run.output = Path(tempfile.mkdtemp())
    ctx = open_model(cfg)
    from retrograd.algorithms import recipe_for

    recipe = recipe_for(cfg.run.algorithm)(ctx)
    tr = ctx.trainable
    rows = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        work = recipe.next_step()          # generation and the reference pass
        t1 = time.perf_counter()
        before = tr.engine.timings()
        for mb in work.micro:
            tr.accumulate(mb.batch, lambda inp, mb=mb: mb.loss(inp)[0], entropy=mb.want_entropy,
                          hidden=mb.want_hidden)
        tr.optimizer_step(lr=cfg.training.learning_rate, step=step + 1, grad_clip=cfg.training.grad_clip)
        t2 = time.perf_counter()
        after = tr.engine.timings()
        s = time.perf_counter()
        data = tr.adapter_bytes()
        recipe.gen.set_adapter(data)
        swap = time.perf_counter() - s
        d = {k: (getattr(after, k) - getattr(before, k)) / 1000 for k in
             ("forward_ms", "head_ms", "backward_ms", "optimizer_ms")}
        rows.append({"generation": work.info.get("gen_s", 0.0), "reference": work.info.get("ref_s", 0.0),
                     "forward": d["forward_ms"], "head": d["head_ms"], "backward": d["backward_ms"],
                     "optimizer": d["optimizer_ms"], "adapter swap": swap, "total": (t2 - t0) + swap,
                     "tokens": work.n_tokens, "train_s": t2 - t1})
    rows = rows[1:]     # the first step warms up
    print(f"GRPO step on {tr.model_path.name}: {cfg.grpo.prompts_per_step} prompts x {cfg.grpo.group_size} "
          f"completions x <= {cfg.grpo.max_new_tokens} new tokens, beta {cfg.grpo.beta}, {args.threads} threads, "
          f"median of {len(rows)} steps")
    for k in ("generation", "reference", "forward", "head", "backward", "optimizer", "adapter swap", "total"):
        print(f"  {k:<13} {statistics.median(r[k] for r in rows):7.2f} s")
    print(f"  tokens trained per step: {statistics.median(r['tokens'] for r in rows):.0f} "
          f"(prompt once per group + completions)")


if __name__ == "__main__":
    main()
