"""`retrograd-profile CONFIG.toml [--steps N] [--threads N] [--json]`: run a short GRPO or agentic
GRPO workload from a configuration and report the time and memory of each phase of a step: generation (llama.cpp,
adapter swapped in from memory), reference log-probs (base model, our graph), forward, LM head,
backward, optimizer, adapter swap, and the total, as medians over the timed steps (the first step
warms up and is not counted). Memory is the process's peak resident size as each phase ends.

Nothing is written to the run's directory: the workload trains a throw-away adapter in a
temporary one. Each step is the trainer's own (`Trainer.step`), so what is timed is what `train`
runs. Agentic workloads (agent_grpo) report the time their tool calls took as a phase of its own,
apart from generation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from retrograd.commands.profile_sft import peak_rss_mib
from retrograd.errors import UsageError, reported

if TYPE_CHECKING:
    from retrograd.context import RunContext

PHASES = ("generation", "tool calls", "reference", "forward", "head", "backward", "optimizer", "adapter swap")


def profile_grpo(ctx: RunContext, steps: int) -> list[dict]:
    """Run steps + 1 GRPO steps through the trainer; per-step seconds and peak memory per phase."""
    from retrograd.trainer import Trainer

    cfg, tr = ctx.cfg, ctx.trainable
    trainer = Trainer(ctx)
    recipe = trainer.recipe
    rows = []
    for _ in range(steps + 1):
        row: dict = {}
        t0 = time.perf_counter()
        work = recipe.next_step()                      # generation and the reference pass
        row["generation"] = work.info.get("gen_s", 0.0)
        if "tool_s" in work.info:                      # agentic workloads: tool calls are their own phase
            row["tool calls"] = work.info["tool_s"]
        row["reference"] = work.info.get("ref_s", 0.0)
        row["mem generation+reference"] = peak_rss_mib()
        before = tr.engine.timings()
        trainer.step(work, cfg.training.learning_rate)
        trainer.global_step += 1
        row["mem forward+head+backward"] = peak_rss_mib()
        t1 = time.perf_counter()
        after = tr.engine.timings()
        for name, key in (("forward", "forward_ms"), ("head", "head_ms"), ("backward", "backward_ms"),
                          ("optimizer", "optimizer_ms")):
            row[name] = (getattr(after, key) - getattr(before, key)) / 1000
        s = time.perf_counter()
        recipe.sync_adapter()
        row["adapter swap"] = time.perf_counter() - s
        row["mem optimizer+swap"] = peak_rss_mib()
        row["total"] = (t1 - t0) + row["adapter swap"]
        row["tokens"] = work.n_tokens
        rows.append(row)
    return rows[1:]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="retrograd-profile",
        description="Run a short GRPO or agentic GRPO workload from a configuration (in a throw-away run "
                    "directory) and report "
                    "the median time of each phase of a step (generation, reference log-probs, forward, LM head, "
                    "backward, optimizer, adapter swap, total) and the peak resident memory as each phase ends. "
                    "The first step warms up and is not counted.")
    ap.add_argument("config", nargs="?", help="a grpo or agent_grpo configuration (TOML); not with --sft")
    ap.add_argument("--steps", type=int, help="timed steps after one warm-up step (default 4; "
                    "--sft: 3)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: as the configuration says; --sft: "
                    "$RETRO_THREADS or every core)")
    ap.add_argument("--json", action="store_true", help="print the medians as one JSON object")
    sft = ap.add_argument_group("--sft: the per-op profile of a LoRA training step")
    sft.add_argument("--sft", action="store_true",
                     help="profile an SFT step instead (the workload of scripts/bench_train.py): time and "
                          "FLOP/s per phase, ggml op and weight kind, the LM head, and the step's effective "
                          "FLOP/s against ggml's F16 product measured in the same run")
    sft.add_argument("--model", help="GGUF to profile (default: the embedded default model)")
    sft.add_argument("--batch", type=int, default=4, help="sequences a step (default 4)")
    sft.add_argument("--seq", type=int, default=256, help="tokens a sequence (default 256)")
    sft.add_argument("--micro-batch-tokens", type=int, default=256, help="tokens a micro-batch (default 256)")
    sft.add_argument("--rank", type=int, default=16, help="LoRA rank, alpha = 2 x rank (default 16)")
    sft.add_argument("--exact-ops", action="store_true",
                     help="ggml's own ops only (none of retrograd's fused kernels): the comparison point")
    return ap


def main(argv: list[str] | None = None) -> int:
    from retrograd import logs

    logs.setup()
    args = parser().parse_args(argv)
    return reported(lambda: _profile_sft(args) if args.sft else _profile(args))


def _profile_sft(args: argparse.Namespace) -> int:
    from retrograd.commands import positive
    from retrograd.commands.profile_sft import print_report, profile_sft
    from retrograd.engine import LoraSpec, Trainable
    from retrograd.models import default_model_path
    from retrograd.run_setup import resolve_threads

    if args.config:
        raise UsageError("--sft profiles a built-in SFT workload and takes no configuration file")
    positive(args, "steps", "threads", "batch", "seq", "micro_batch_tokens", "rank")
    threads = args.threads or resolve_threads()
    model = args.model or str(default_model_path())
    if not Path(model).is_file():
        raise UsageError(f"--model: {model}: no such file")
    steps = args.steps or 3
    tr = Trainable(model, LoraSpec(args.rank, 2.0 * args.rank), threads=threads, seed=0)
    tr.engine.set_exact_ops(args.exact_ops)
    report = profile_sft(tr, batch=args.batch, seq=args.seq, micro_batch_tokens=args.micro_batch_tokens,
                         steps=steps, threads=threads)
    report["exact_ops"] = args.exact_ops
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def _profile(args: argparse.Namespace) -> int:
    from retrograd.commands import positive

    if not args.config:
        raise UsageError("give a grpo or agent_grpo configuration, or --sft")
    from retrograd.config import load
    from retrograd.context import open_model
    from retrograd.run_setup import resolve_threads

    positive(args, "steps", "threads")
    args.steps = args.steps or 4
    if args.threads:
        os.environ["RETRO_THREADS"] = str(args.threads)
    cfg = load(Path(args.config))
    if cfg.run.algorithm not in ("grpo", "agent_grpo"):
        raise UsageError(f"{args.config}: retrograd-profile runs grpo workloads (grpo or agent_grpo); "
                         f"[run].algorithm is {cfg.run.algorithm!r}")
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
    print(f"{cfg.run.algorithm} step on {head['model']}: {g.prompts_per_step} prompts x {g.group_size} completions x <= "
          f"{g.max_new_tokens} new tokens, beta {g.beta}, {head['threads']} threads, median of {len(rows)} steps")
    for k in (*PHASES, "total"):
        if k in med:
            print(f"  {k:<13} {med[k]:7.2f} s")
    print(f"  tokens trained per step: {med['tokens']:.0f} (each prompt once per group, and the completions)")
    print("  peak resident memory as each phase ends: " + ", ".join(
        f"{k[4:]} {med[k]:.0f} MiB" for k in med if k.startswith("mem ")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
