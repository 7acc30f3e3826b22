"""What every command derives from a configuration before it loads anything: the model file (the
configured one or the embedded default), the thread count (RETRO_THREADS, then the config, then
all cores), the run's directory and name, and the directory that relative paths resolve against.
One place, so `train`, `chat`, `serve`, `bench`, generation and the agentic commands agree.
"""

from __future__ import annotations

import os
from pathlib import Path

from retrograd.config import Config
from retrograd.errors import ConfigError
from retrograd.models import default_model_path


def config_dir(cfg: Config) -> Path:
    """Where paths written in the configuration resolve (its file's directory, else the cwd)."""
    if cfg.base_dir:
        return cfg.base_dir
    return cfg.source.parent if cfg.source else Path.cwd()


def config_label(cfg: Config) -> str:
    return str(cfg.source) if cfg.source else "<config>"


def resolve_model(cfg: Config) -> Path:
    """[model].path, or the embedded default model (ModelNotFound names the fetch command)."""
    return Path(cfg.model.path) if cfg.model.path else default_model_path()


def env_threads() -> int | None:
    """RETRO_THREADS when set (validated), else None."""
    env = os.environ.get("RETRO_THREADS", "").strip()
    if not env:
        return None
    if not env.isdigit() or int(env) < 1:
        raise ConfigError(f"RETRO_THREADS must be a positive integer, got {env!r}")
    return int(env)


def resolve_threads(cfg: Config | None = None) -> int:
    """RETRO_THREADS, else [training].threads, else [model].threads, else every core."""
    env = env_threads()
    if env is not None:
        return env
    if cfg is not None and (cfg.training.threads or cfg.model.threads):
        return cfg.training.threads or cfg.model.threads
    return os.cpu_count() or 1


def run_name(cfg: Config) -> str:
    return cfg.run.name or (cfg.source.stem if cfg.source else "run")


def run_dir(cfg: Config) -> Path:
    """[run].output, else runs/<name> beside the configuration."""
    if cfg.run.output:
        return Path(cfg.run.output)
    return config_dir(cfg) / "runs" / run_name(cfg)


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.directory) if cfg.checkpoint.directory else run_dir(cfg) / "checkpoints"
