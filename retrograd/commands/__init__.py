"""The commands behind retrograd.cli, one module each: `add_parser(subparsers)` declares the
command's arguments and help and sets `run` (args -> exit code), which carries it out. What they
share lives here: the common flags, the configuration with the command-line overrides applied,
and the one rule that picks the adapter `chat` and `serve` use. Commands raise RetrogradError;
cli.py reports it.

A command module imports only the configuration layer at its top: cli.py imports every one of them
to build the parser, so `retrograd --help` must not load the engine, llama.cpp or the web server;
what `run` needs beyond that it imports when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from retrograd.config import PATH_KEYS, Config, check_paths, load
from retrograd.errors import RetrogradError, UsageError
from retrograd.run_setup import run_dir

#: the parser `add_parser` is given: what argparse's add_subparsers returns
Subparsers = argparse._SubParsersAction


def common_flags(p: argparse.ArgumentParser, config: bool = True) -> None:
    """CONFIG, --model and --device, as every command of the specification that loads a model has them."""
    if config:
        p.add_argument("config", help="run configuration (TOML)")
    p.add_argument("--model", metavar="M", help="use this GGUF instead of [model].path")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"),
                   help="auto: a GPU if available, else the CPU; cpu: force the CPU; gpu: require a GPU")


def one_action(sub: Subparsers, name: str, action: str, help: str, description: str, action_help: str,
               config_help: str) -> argparse.ArgumentParser:
    """`retrograd NAME ACTION CONFIG`: a command with one action that takes a configuration; the
    action's parser, for its flags (and `run`)."""
    p = sub.add_parser(name, help=help, description=description)
    t = p.add_subparsers(dest="action", metavar="ACTION", required=True).add_parser(action, help=action_help)
    t.add_argument("config", help=config_help)
    return t


def load_config(args: argparse.Namespace, skip: tuple[str, ...] = (), reads: tuple[str, ...] = PATH_KEYS) -> Config:
    """The TOML file with the common command-line overrides applied (CLI paths resolve against
    the current directory). The input files in `reads` ("section.key", default: all a run reads)
    must exist, except those in `skip`, which the command writes."""
    cfg = load(Path(args.config))
    if getattr(args, "model", None):
        cfg.model.path = Path(args.model).resolve()
    if getattr(args, "device", None):
        cfg.model.device = args.device
    if getattr(args, "ctx", None) is not None:
        if args.ctx < 16:
            raise UsageError(f"--ctx must be >= 16, got {args.ctx}")
        cfg.model.ctx = args.ctx
    check_paths(cfg, skip=skip, reads=reads)
    return cfg


def positive(args: argparse.Namespace, *names: str) -> None:
    """Flags that must be >= 1 when given."""
    for name in names:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def choose_adapter(args: argparse.Namespace, cfg: Config) -> Path | None:
    """The adapter chat and serve use: --base-only (none), --adapter (a GGUF, or a checkpoint's
    .state directory), --checkpoint (serve: the adapter exported beside a .state directory), else
    the adapter the configuration trains. A missing one is the same error everywhere."""
    from retrograd.checkpoint import adapter_of

    if getattr(args, "base_only", False):
        return None
    if getattr(args, "adapter", None):
        p = Path(args.adapter).resolve()
        if p.is_dir():
            return adapter_of(p)
        if not p.is_file():
            raise RetrogradError(f"--adapter: {p}: no such adapter file")
        return p
    if getattr(args, "checkpoint", None):
        state = Path(args.checkpoint).resolve()
        beside = state.with_suffix(".gguf")
        return beside if beside.is_file() else adapter_of(state)
    p = run_dir(cfg) / "adapter.gguf"
    if not p.is_file():
        other = ", --checkpoint" if hasattr(args, "checkpoint") else ""
        raise RetrogradError(f"no adapter: {p} does not exist yet (train first, or pass --adapter{other} "
                             "or --base-only)")
    return p
