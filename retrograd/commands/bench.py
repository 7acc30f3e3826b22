"""`retrograd bench`: evaluate without training, the base model and, with --adapter, the adapter on
the same examples. sft: loss and perplexity on the trained tokens; distill: KL to the teacher on
its top-k, top-1 agreement and perplexity (loads the teacher); grpo/ppo: reward distributions
(run_rewards); preference and agent_grpo: not supported (a message says what to use instead)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from retrograd.commands import Subparsers, common_flags, load_config, positive
from retrograd.config import Config, tomllib
from retrograd.errors import UsageError
from retrograd.run_setup import config_dir, config_label, resolve_model, resolve_threads

UNSUPPORTED = {
    "agent_grpo": "bench does not support agent_grpo; use `retrograd collect --report` to measure pass rates.",
    "preference": "bench does not support preference; a run with [evaluation] reports its preference accuracy "
                  "at each evaluation (metrics.jsonl).",
}


class Unsupported(UsageError):
    pass


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("bench", help="evaluate the base model (and an adapter) without training",
                       description="Evaluate without training. sft: loss and perplexity on the trained tokens; "
                                   "grpo/ppo: the reward distribution of sampled answers; distill: KL to the teacher, "
                                   "top-1 agreement and perplexity (loads the teacher); preference and agent_grpo: not "
                                   "supported. Without --adapter it measures the base model; with it, base and adapter "
                                   "on the same examples.")
    common_flags(p)
    p.add_argument("--data", metavar="FILE", help="evaluation data (default: [evaluation].data or the held-out split)")
    p.add_argument("--adapter", metavar="ADAPTER.gguf", help="also measure this adapter")
    p.add_argument("--limit", type=int, metavar="N", help="at most N examples")
    p.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                   help="report as a table (text), as JSON (jsonl) or by terminal (auto)")
    p.add_argument("--ctx", type=int, metavar="N", help="longest sequence (overrides [model].ctx)")
    p.set_defaults(run=run)


def eval_examples(ctx, args):
    from retrograd.data.batching import split_holdout
    from retrograd.data.formats import load_examples

    cfg = ctx.cfg
    max_len = min(cfg.data.max_length, cfg.model.ctx)
    if args.data:
        path = Path(args.data).resolve()
    elif cfg.evaluation.data:
        path = Path(cfg.evaluation.data)
    elif cfg.data.train and cfg.data.eval_split > 0:
        examples, _ = load_examples(Path(cfg.data.train), ctx.tokenizer, ctx.chat, fmt=cfg.data.format,
                                    max_length=max_len, skip_bad=cfg.data.skip_bad_lines)
        return split_holdout(examples, cfg.data.eval_split, cfg.run.seed)[1], f"{cfg.data.train} (held-out split)"
    else:
        raise UsageError(f"{config_label(cfg)}: no evaluation data: pass --data, or set [evaluation].data "
                         "or [data].eval_split")
    examples, _ = load_examples(path, ctx.tokenizer, ctx.chat, fmt=cfg.data.format, max_length=max_len,
                                skip_bad=cfg.data.skip_bad_lines)
    return examples, str(path)


def _algorithm_of(path: str) -> str | None:
    """[run].algorithm as written, read before validation (agent_grpo configurations do not load)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh).get("run", {}).get("algorithm")
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return None


def run(args: argparse.Namespace) -> int:
    from retrograd import adapter as adapter_io
    from retrograd.context import open_model
    from retrograd.data.formats import DataError
    from retrograd.eval.distill import evaluate_distill
    from retrograd.eval.nll import evaluate_nll
    from retrograd.teacher import OnlineTeacher, load_teacher

    algorithm = _algorithm_of(args.config)
    if algorithm in UNSUPPORTED:       # before validation: agent_grpo configurations may not load
        raise Unsupported(UNSUPPORTED[algorithm])
    cfg = load_config(args)
    positive(args, "limit")
    if cfg.run.algorithm in ("grpo", "ppo"):
        return run_rewards(args, cfg)
    if args.adapter and Path(args.adapter).is_file():       # LoRA or DoRA: as the file says
        with open(args.adapter, "rb") as fh:
            cfg.lora.variant = adapter_io.kind_of(fh.read(65536))
    ctx = open_model(cfg, need_data=False)
    examples, source = eval_examples(ctx, args)
    if args.limit is not None:
        examples = examples[: args.limit]
    if not examples:
        raise DataError(f"{source}: no examples to evaluate")
    budget = cfg.training.micro_batch_tokens
    extra: dict[str, Any]
    if cfg.run.algorithm == "distill":
        teacher = OnlineTeacher(load_teacher(cfg, ctx.tokenizer, ctx.trainable.model_path), cfg.distill.k)

        def measure(adapter: bool) -> dict:
            return evaluate_distill(ctx.trainable, teacher, examples, budget, adapter=adapter)
        columns = [("eval_kl", "KL to teacher"), ("eval_top1", "top-1 agree"), ("eval_ppl", "perplexity")]
        extra = {"teacher": str(teacher.teacher.model_path), "k": cfg.distill.k}
    else:
        def measure(adapter: bool) -> dict:
            return evaluate_nll(ctx.trainable, examples, budget, adapter=adapter)
        columns = [("eval_loss", "loss"), ("eval_ppl", "perplexity")]
        extra = {}
    results = {"base": measure(False)}
    if args.adapter:
        ctx.trainable.load_adapter(Path(args.adapter).resolve())
        results["adapter"] = measure(True)
    report = {"algorithm": cfg.run.algorithm, "model": str(ctx.trainable.model_path), "data": source,
              "examples": len(examples), "adapter": str(Path(args.adapter).resolve()) if args.adapter else None,
              **extra, "results": results}
    fmt = args.format
    if fmt == "auto":
        fmt = "text" if sys.stdout.isatty() else "jsonl"
    if fmt == "jsonl":
        print(json.dumps(report))
        return 0
    print(f"{len(examples)} examples from {source}, {int(results['base']['eval_tokens'])} scored tokens"
          + (f"; teacher {Path(extra['teacher']).name}, top-{extra['k']}" if extra else ""))
    print(f"{'':<10}" + "".join(f"{label:>15}" for _, label in columns))
    for name, r in results.items():
        print(f"{name:<10}" + "".join(f"{r[key]:>15.4f}" for key, _ in columns))
    if "adapter" in results:
        print(f"{'change':<10}" + "".join(f"{results['adapter'][key] - results['base'][key]:>+15.4f}"
                                          for key, _ in columns))
    return 0


def run_rewards(args: argparse.Namespace, cfg: Config) -> int:
    """grpo / ppo: the reward distribution of sampled answers, base and adapter on the same draws."""
    from retrograd import rewards as rw
    from retrograd.data import chat as chat_mod
    from retrograd.data import tokenizer as tok_mod
    from retrograd.data.prompts import load_prompts
    from retrograd.eval.rewards import sample_rewards
    from retrograd.generation.llama import Generator

    section = cfg.run.algorithm
    g = getattr(cfg, section)
    n = g.group_size if section == "grpo" else g.bench_samples
    rewards = rw.build(g.rewards, config_dir(cfg), section, config_label(cfg))
    model = resolve_model(cfg)
    tok = tok_mod.load(str(model))
    chat = chat_mod.format_for(tok, cfg.model.chat_template)
    if args.data:
        path = Path(args.data).resolve()
    elif cfg.evaluation.data:
        path = Path(cfg.evaluation.data)
    else:
        raise UsageError(f"{config_label(cfg)}: no evaluation prompts: pass --data or set [evaluation].data")
    prompts, _ = load_prompts(path, tok, chat, max_tokens=g.max_prompt_tokens, skip_bad=cfg.data.skip_bad_lines)
    prompts = prompts[: args.limit or len(prompts)]
    gen = Generator(model, n_ctx=min(cfg.model.ctx, g.max_prompt_tokens + g.max_new_tokens + 8), n_seq=n,
                    threads=resolve_threads(cfg), device=cfg.model.device)
    kw = dict(n=n, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
              max_new_tokens=g.max_new_tokens, stop=tuple(g.stop), seed=cfg.run.seed, on_error=g.reward_errors)
    results = {"base": sample_rewards(gen, prompts, rewards, **kw)}
    if args.adapter:
        gen.load_adapter(Path(args.adapter).resolve())
        results["adapter"] = sample_rewards(gen, prompts, rewards, **kw)
    report = {"algorithm": cfg.run.algorithm, "model": str(model), "data": str(path), "prompts": len(prompts),
              "samples_per_prompt": n, "temperature": g.temperature,
              "adapter": str(Path(args.adapter).resolve()) if args.adapter else None, "results": results}
    fmt = args.format if args.format != "auto" else ("text" if sys.stdout.isatty() else "jsonl")
    if fmt == "jsonl":
        print(json.dumps(report))
        return 0
    print(f"{len(prompts)} prompts x {n} samples (temperature {g.temperature}) from {path}")
    keys = ["reward_mean", "reward_std", "reward_p10", "reward_p50", "reward_p90", "completion_len"]
    keys += [k for k in results["base"] if k.startswith("pass/")]
    print(f"{'':<22}" + "".join(f"{name:>12}" for name in results))
    for k in keys:
        print(f"{k:<22}" + "".join(f"{r[k]:>12.4f}" for r in results.values()))
    return 0
