"""`retrograd-profile CONFIG.toml [--steps N] [--threads N] [--json]`: run a short GRPO workload
from a configuration and report the time and memory of each phase of a step: generation (llama.cpp,
adapter swapped in from memory), reference log-probs (base model, our graph), forward, LM head,
backward, optimizer, adapter swap, and the total, as medians over the timed steps (the first step
warms up and is not counted). Memory is the process's peak resident size as each phase ends.

Nothing is written to the run's directory: the workload trains a throw-away adapter in a
temporary one. Agentic GRPO workloads are not built yet in this version.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("generation", "reference", "forward", "head", "backward", "optimizer", "adapter swap")


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10      # bytes on macOS, KiB on Linux


def profile_grpo(ctx, steps: int) -> list[dict]:
    """Run steps + 1 GRPO steps through the recipe; per-step seconds and peak memory per phase."""
    from retrograd.algorithms import recipe_for

    cfg, tr = ctx.cfg, ctx.trainable
    recipe = recipe_for("grpo")(ctx)
    rows = []
    for step in range(steps + 1):
        row: dict = {}
        t0 = time.perf_counter()
        work = recipe.next_step()                      # generation and the reference pass
        row["generation"] = work.info.get("gen_s", 0.0)
        row["reference"] = work.info.get("ref_s", 0.0)
        row["mem generation+reference"] = peak_rss_mib()
        before = tr.engine.timings()
        for mb in work.micro:
            tr.accumulate(mb.batch, lambda inp, mb=mb: mb.loss(inp)[0], entropy=mb.want_entropy,
                          hidden=mb.want_hidden)
        row["mem forward+head+backward"] = peak_rss_mib()
        tr.optimizer_step(lr=cfg.training.learning_rate, step=step + 1, grad_clip=cfg.training.grad_clip)
        t1 = time.perf_counter()
        after = tr.engine.timings()
        for name, key in (("forward", "forward_ms"), ("head", "head_ms"), ("backward", "backward_ms"),
                          ("optimizer", "optimizer_ms")):
            row[name] = (getattr(after, key) - getattr(before, key)) / 1000
        s = time.perf_counter()
        recipe.gen.set_adapter(tr.adapter_bytes())
        row["adapter swap"] = time.perf_counter() - s
        row["mem optimizer+swap"] = peak_rss_mib()
        row["total"] = (t1 - t0) + row["adapter swap"]
        row["tokens"] = work.n_tokens
        rows.append(row)
    return rows[1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="retrograd-profile",
        description="Run a short GRPO workload from a configuration (in a throw-away run directory) and report "
                    "the median time of each phase of a step (generation, reference log-probs, forward, LM head, "
                    "backward, optimizer, adapter swap, total) and the peak resident memory as each phase ends. "
                    "The first step warms up and is not counted.")
    ap.add_argument("config", help="a grpo configuration (TOML)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step (default 4)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: as the configuration says)")
    ap.add_argument("--json", action="store_true", help="print the medians as one JSON object")
    args = ap.parse_args(argv)
    if args.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    if args.threads:
        os.environ["RETRO_THREADS"] = str(args.threads)
    from retrograd.commands import dispatch_errors
    from retrograd.config import load
    from retrograd.trainer import open_model, resolve_threads

    with dispatch_errors(args.config) as status:
        cfg = load(Path(args.config))
        if cfg.run.algorithm != "grpo":
            print(f"error: {args.config}: retrograd-profile runs grpo workloads; [run].algorithm is "
                  f"{cfg.run.algorithm!r}", file=sys.stderr)
            return 2
        cfg.run.output = Path(tempfile.mkdtemp(prefix="retrograd-profile-"))
        cfg.checkpoint.directory = cfg.run.output / "checkpoints"
        ctx = open_model(cfg)
        rows = profile_grpo(ctx, args.steps)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        g = cfg.grpo
        head = {"model": ctx.trainable.model_path.name, "prompts": g.prompts_per_step, "group_size": g.group_size,
                "max_new_tokens": g.max_new_tokens, "beta": g.beta, "threads": resolve_threads(cfg),
                "steps": len(rows)}
        if args.json:
            print(json.dumps({**head, "median": med}))
            return 0
        print(f"GRPO step on {head['model']}: {g.prompts_per_step} prompts x {g.group_size} completions x <= "
              f"{g.max_new_tokens} new tokens, beta {g.beta}, {head['threads']} threads, median of {len(rows)} steps")
        for k in (*PHASES, "total"):
            print(f"  {k:<13} {med[k]:7.2f} s")
        print(f"  tokens trained per step: {med['tokens']:.0f} (each prompt once per group, and the completions)")
        print("  peak resident memory as each phase ends: " + ", ".join(
            f"{k[4:]} {med[k]:.0f} MiB" for k in med if k.startswith("mem ")))
        return 0
    return status.code


if __name__ == "__main__":
    sys.exit(main())
