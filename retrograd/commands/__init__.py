"""Command implementations behind retrograd.cli, and the mapping of known failures to one clear
message and an exit code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrograd.config import Config, ConfigError, check_paths, load


def load_config(args: argparse.Namespace, writes: tuple[str, ...] = ()) -> Config:
    """The TOML file with the common command-line overrides applied (CLI paths resolve against
    the current directory)."""
    cfg = load(Path(args.config))
    if getattr(args, "model", None):
        cfg.model.path = Path(args.model).resolve()
    if getattr(args, "device", None):
        cfg.model.device = args.device
    if getattr(args, "ctx", None):
        if args.ctx < 16:
            raise ConfigError(f"--ctx must be >= 16, got {args.ctx}")
        cfg.model.ctx = args.ctx
    check_paths(cfg, skip=writes)
    return cfg


class ExitStatus:
    code = 0


@contextmanager
def dispatch_errors(config: str = "") -> Iterator[ExitStatus]:
    """Turns every known failure inside the block into one `error:` line and status.code (2 for
    configuration errors, 1 for the rest, 130 for Ctrl-C); anything else propagates."""
    from retrograd.adapter import AdapterError
    from retrograd.algorithms.distill import DistillError
    from retrograd.algorithms.rewards import RewardError
    from retrograd.checkpoint import CheckpointError
    from retrograd.data.chat import ChatTemplateError
    from retrograd.data.formats import DataError
    from retrograd.data.topk_file import TopkFileError
    from retrograd.models import ModelNotFound
    from retrograd.native import NativeError
    from retrograd.trainer import TrainError

    status = ExitStatus()
    try:
        yield status
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        status.code = 2
    except RewardError as exc:
        print(f"error: {config}: {exc}", file=sys.stderr)
        status.code = 2
    except (DataError, ModelNotFound, AdapterError, CheckpointError, ChatTemplateError, TrainError,
            NativeError, DistillError, TopkFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        status.code = 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        status.code = 130


def dispatch(args: argparse.Namespace) -> int:
    with dispatch_errors(getattr(args, "config", "")) as status:
        if args.command in ("inspect", "preflight"):
            from retrograd.commands import inspect as cmd
        elif args.command == "train":
            from retrograd.commands import train as cmd
        elif args.command == "bench":
            from retrograd.eval import bench as cmd
        elif args.command == "chat":
            from retrograd.commands import chat as cmd
        elif args.command == "serve":
            from retrograd.commands import serve as cmd
        elif args.command == "distill-teacher":
            from retrograd.commands import distill_teacher as cmd
        else:  # pragma: no cover - the parser knows every command
            raise SystemExit(f"unknown command {args.command}")
        return cmd.run(args)
    return status.code
