"""`retrograd train CONFIG [--resume [CHECKPOINT.state]]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from retrograd.commands import load_config
from retrograd.context import open_model
from retrograd.run_setup import config_label
from retrograd.trackers import check_installed
from retrograd.trainer import train


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    check_installed(cfg.run.report_to, config_label(cfg))      # before the model loads
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
    if summary.get("tracker_errors"):
        print(f"trackers: {summary['tracker_errors']} failed calls ({', '.join(cfg.run.report_to)}; the warnings above "
              "say which), the training run is complete")
    if summary.get("plot"):
        print(f"curves {summary['plot']}; metrics {summary['metrics']}")
    return 0
