"""`retrograd train CONFIG [--resume [CHECKPOINT.state]]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from retrograd.commands import load_config
from retrograd.trainer import open_model, train


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    resume = args.resume
    if isinstance(resume, str):
        resume = Path(resume).resolve()
    ctx = open_model(cfg)
    summary = train(ctx, resume)
    print(f"done: {summary['steps']} steps in {summary['seconds']:.0f} s; adapter {summary['adapter']}")
    if "eval_reward" in summary:
        print(f"eval reward {summary['eval_reward']:.4f}")
    elif "eval_loss" in summary:
        print(f"eval loss {summary['eval_loss']:.4f} (perplexity {summary.get('eval_ppl', float('nan')):.2f})")
    if summary.get("plot"):
        print(f"curves {summary['plot']}; metrics {summary['metrics']}")
    return 0
