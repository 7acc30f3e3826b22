"""`retrograd train CONFIG [--resume [CHECKPOINT.state]]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from retrograd.commands import Subparsers, common_flags, load_config
from retrograd.run_setup import config_label


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("train", help="run [run].algorithm on the configuration",
                       description="Train the configured algorithm. --resume continues from the given checkpoint, "
                                   "or from the latest one in [checkpoint].directory.")
    common_flags(p)
    p.add_argument("--resume", nargs="?", const=True, metavar="CHECKPOINT.state",
                   help="continue from this checkpoint, or from the latest one when no path is given")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from retrograd.context import open_model
    from retrograd.trackers import check_installed
    from retrograd.trainer import train

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
