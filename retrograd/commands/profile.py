"""`retrograd-profile CONFIG.toml [--steps N] [--threads N] [--json]`: run a few steps of a
configuration (any algorithm; GRPO and agentic GRPO are what it was made for) and report the time
and memory of each phase of a step: generation (llama.cpp, adapter swapped in from memory),
reference log-probs (base model, our graph), forward, LM head, backward, optimizer, adapter swap,
and the total, as medians over the timed steps (the first step warms up and is not counted).
Memory is the process's peak resident size as each phase ends. With [distributed], each Ray
worker's gradient time, the communication time and the time sampling on the workers too.

Nothing is written to the run's directory: the workload trains a throw-away adapter in a
temporary one. The steps are the trainer's own (`Trainer.run`, timed through its StepHook), so
what is timed is what `train` runs, the one adapter swap that starts each rollout included.
Agentic workloads (agent_grpo) report the time their tool calls took as a phase of its own, apart
from generation.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from retrograd.errors import UsageError, reported
from retrograd.memory import peak_rss_mib
from retrograd.sections import MATMUL_PRECISIONS

if TYPE_CHECKING:
    from retrograd.algorithms.base import StepWork
    from retrograd.context import RunContext
    from retrograd.engine import Trainable

PHASES = ("generation", "tool calls", "reference", "forward", "head", "backward", "optimizer", "adapter swap")


def profile_steps(ctx: RunContext, steps: int) -> list[dict]:
    """Run steps + 1 steps of the configured algorithm through the trainer (on the run's Ray workers
    with [distributed]); per-step seconds and peak memory per phase, and per worker. The steps alone:
    no evaluation, no checkpoints."""
    from retrograd.distributed import workers_for
    from retrograd.report import Progress
    from retrograd.trainer import Trainer

    ctx.cfg.evaluation.every_steps = ctx.cfg.checkpoint.every_steps = 0
    timer = PhaseTimer(ctx.trainable)
    with workers_for(ctx) as cluster:
        trainer = Trainer(ctx, cluster, hook=timer)
        try:
            trainer.run(steps + 1, Progress(steps + 1, stream=io.StringIO()))     # the table is the output
        finally:
            trainer.recipe.close()
    return timer.rows[1:]


class PhaseTimer:
    """The trainer's StepHook here: it times each phase of a step and notes the peak memory as the
    phase ends, one row per step."""

    def __init__(self, trainable: Trainable) -> None:
        self.tr = trainable
        self.rows: list[dict] = []
        self.row: dict = {}
        self.t0 = 0.0
        self.before = trainable.engine.timings()

    def started(self) -> None:
        self.row, self.t0 = {}, time.perf_counter()

    def prepared(self, work: StepWork) -> None:
        row, info = self.row, work.info
        # the rollout's gen_s counts the adapter swap that starts it: a phase of its own here
        row["generation"] = info.get("gen_s", 0.0) - (work.swap_s or 0.0)
        if "tool_s" in info:                      # agentic workloads: tool calls are their own phase
            row["tool calls"] = info["tool_s"]
        row["reference"] = info.get("ref_s", 0.0)
        row["mem generation+reference"] = peak_rss_mib()
        self.before = self.tr.engine.timings()

    def gradients_done(self) -> None:
        self.row["mem forward+head+backward"] = peak_rss_mib()

    def finished(self, work: StepWork) -> None:
        row = self.row
        t1 = time.perf_counter()
        after = self.tr.engine.timings()
        row.setdefault("mem forward+head+backward", peak_rss_mib())     # a skipped step has no gradients
        for name, key in (("forward", "forward_ms"), ("head", "head_ms"), ("backward", "backward_ms"),
                          ("optimizer", "optimizer_ms")):
            row[name] = (getattr(after, key) - getattr(self.before, key)) / 1000
        # [distributed]: each worker's gradient time, the slowest, the communication, the sampling
        row.update({k: v for k, v in work.info.items() if k.startswith("dist_")})
        if work.swap_s is not None:              # recipes that sample: the swap before the rollout
            row["adapter swap"] = work.swap_s
        row["mem optimizer+swap"] = peak_rss_mib()
        row["total"] = t1 - self.t0
        row["tokens"] = work.n_tokens
        self.rows.append(row)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="retrograd-profile",
        description="Run a few steps of a configuration (in a throw-away run directory) and report "
                    "the median time of each phase of a step (generation, reference log-probs, forward, LM head, "
                    "backward, optimizer, adapter swap, total) and the peak resident memory as each phase ends; "
                    "with [distributed], each Ray worker's gradient time and the communication time per step. "
                    "The first step warms up and is not counted.")
    ap.add_argument("config", nargs="?", help="a run configuration (TOML), e.g. grpo or agent_grpo; not with --sft")
    ap.add_argument("--steps", type=int, help="timed steps after one warm-up step (default 4; "
                    "--sft: 3)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: as the configuration says; --sft: "
                    "$RETRO_THREADS or every core)")
    ap.add_argument("--json", action="store_true", help="print the medians as one JSON object")
    sft = ap.add_argument_group("--sft: the per-op profile of a LoRA training step")
    sft.add_argument("--sft", action="store_true",
                     help="profile an SFT step instead (the workload of scripts/bench_train.py): time and "
                          "FLOP/s per phase, ggml op and weight kind, the LM head, and the step's effective "
                          "FLOP/s against ggml's product of the 16-bit type the weights are multiplied in "
                          "(F16 or BF16), measured in the same run")
    sft.add_argument("--model", help="GGUF to profile (default: the embedded default model)")
    sft.add_argument("--batch", type=int, default=4, help="sequences a step (default 4)")
    sft.add_argument("--seq", type=int, default=256, help="tokens a sequence (default 256)")
    sft.add_argument("--micro-batch-tokens", type=int, default=256, help="tokens a micro-batch (default 256)")
    sft.add_argument("--rank", type=int, default=16, help="LoRA rank, alpha = 2 x rank (default 16)")
    sft.add_argument("--exact-ops", action="store_true",
                     help="ggml's own ops only (none of retrograd's fused kernels): the comparison point")
    sft.add_argument("--weight-cache-mb", type=int, default=0,
                     help="weight cache in MiB, as [training].weight_cache_mb (default 0: none)")
    sft.add_argument("--matmul-precision", default="auto", choices=MATMUL_PRECISIONS,
                     help="how the frozen weights are multiplied, as [training].matmul_precision (default auto; "
                          "a route forced by its kernel's name, e.g. avx2-f16 or ggml-f16, to compare routes)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from retrograd import logs

    logs.setup()
    args = parser().parse_args(argv)
    return reported(lambda: _profile_sft(args) if args.sft else _profile(args))


def _profile_sft(args: argparse.Namespace) -> int:
    from retrograd import native
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
    tr.engine.set_matmul_mode(args.matmul_precision)
    if args.weight_cache_mb < 0:
        raise UsageError(f"--weight-cache-mb must be >= 0, got {args.weight_cache_mb}")
    cached = tr.model.set_weight_cache(args.weight_cache_mb, args.matmul_precision) if args.weight_cache_mb else 0.0
    report = profile_sft(tr, batch=args.batch, seq=args.seq, micro_batch_tokens=args.micro_batch_tokens,
                         steps=steps, threads=threads, matmul=args.matmul_precision)
    report["exact_ops"] = args.exact_ops
    report["weight_cache_mib"] = cached
    report["matmul_precision"] = f"{args.matmul_precision} ({native.conv_type(args.matmul_precision)})"
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def _profile(args: argparse.Namespace) -> int:
    from retrograd.commands import positive

    if not args.config:
        raise UsageError("give a run configuration (e.g. grpo or agent_grpo), or --sft")
    from retrograd.config import load
    from retrograd.context import open_model
    from retrograd.run_setup import resolve_threads

    positive(args, "steps", "threads")
    args.steps = args.steps or 4
    if args.threads:
        os.environ["RETRO_THREADS"] = str(args.threads)
    cfg = load(Path(args.config))
    cfg.run.output = Path(tempfile.mkdtemp(prefix="retrograd-profile-"))
    cfg.checkpoint.directory = cfg.run.output / "checkpoints"
    ctx = open_model(cfg)
    rows = profile_steps(ctx, args.steps)
    keys = dict.fromkeys(k for r in rows for k in r)      # a worker replaced mid-profile has rows of its own
    med = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
    g, t, d = cfg.grpo, cfg.training, cfg.distributed
    rl = cfg.run.algorithm in ("grpo", "agent_grpo", "ppo")
    head = {"model": ctx.trainable.model_path.name, "algorithm": cfg.run.algorithm, "threads": resolve_threads(cfg),
            "steps": len(rows)}
    agent = cfg.run.algorithm == "agent_grpo"
    new_tokens = cfg.agent.max_new_tokens if agent else g.max_new_tokens      # agent: per turn
    if rl:
        head.update(prompts=g.prompts_per_step, group_size=g.group_size, max_new_tokens=new_tokens, beta=g.beta)
        if agent:
            head.update(max_turns=cfg.agent.max_turns)
    else:
        head.update(batch_size=t.batch_size, micro_batch_tokens=t.micro_batch_tokens)
    if d.backend == "ray":
        head.update(workers=d.workers, threads_per_worker=d.threads_per_worker)
    if args.json:
        print(json.dumps({**head, "median": med}))
        return 0
    turns = f" a turn, <= {cfg.agent.max_turns} turns" if agent else ""
    what = (f"{g.prompts_per_step} prompts x {g.group_size} completions x <= {new_tokens} new tokens{turns}, beta {g.beta}"
            if rl else f"{t.batch_size} examples, micro-batches of {t.micro_batch_tokens} tokens")
    print(f"{cfg.run.algorithm} step on {head['model']}: {what}, {head['threads']} threads, median of {len(rows)} steps")
    for k in (*PHASES, "total"):
        if k in med:
            print(f"  {k:<13} {med[k]:7.2f} s")
    if d.backend == "ray":
        workers = ", ".join(f"{k[5:-2]} {v:.2f} s (peak {med.get(k[:-2] + '_peak_mib', 0):.0f} MiB)"
                            for k, v in med.items() if k.startswith("dist_w") and k.endswith("_s"))
        print(f"  on {d.workers} Ray workers x {d.threads_per_worker} threads: gradient per worker: {workers or 'none'}; "
              f"slowest {med.get('dist_compute_s', 0):.2f} s; communication {med.get('dist_comm_s', 0):.2f} s"
              + (f"; sampling {med['dist_gen_s']:.2f} s" if "dist_gen_s" in med else ""))
    print(f"  tokens trained per step: {med['tokens']:.0f}" + (" (each prompt once per group, and the completions)"
                                                              if rl else ""))
    print("  peak resident memory as each phase ends: " + ", ".join(
        f"{k[4:]} {med[k]:.0f} MiB" for k in med if k.startswith("mem ")))
    return 0

if __name__ == "__main__":
    sys.exit(main())
