"""`retrograd train CONFIG [--resume [CHECKPOINT.state]]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from retrograd.commands import load_config
from retrograd.context import open_model
from retrograd.trainer import train


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    resume = args.resume
    if isinstance(resume, str):
        resume = Path(resume).resolve()
    ctx = open_model(cfg)
    summary = train(ctx, resume)
    print(f"done: {summary['steps']} steps in {summary['seconds']:.0f} s; adapter {summary['adapter']}")
    shown = [(k[5:], v) for k, v in summary.items()
             if k.startswith("eval_") and not k.endswith(("_tokens", "_examples", "_nll"))]
    if shown:
        print("final evaluation: " + ", ".join(f"{k} {v:.4g}" for k, v in shown))
    if summary.get("plot"):
        print(f"curves {summary['plot']}; metrics {summary['metrics']}")
    return 0
