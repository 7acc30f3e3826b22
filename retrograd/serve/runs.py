"""The runs of retrograd-server on disk: one directory per run under STATE/runs/, holding the
submitted configuration (config.toml), the run's record (run.json, rewritten atomically on every
change), the training log (log.txt) and the run's output directory (out/: metrics, checkpoints,
the final adapter). Everything the server knows about a run can be rebuilt from these files, which
is what makes a restart, even after SIGKILL, list every run with its true state.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from retrograd import checkpoint as ckpt
from retrograd.config import Config, ConfigError, check_paths, from_dict, tomllib
from retrograd.fsutil import atomic_write

#: queued -> running -> finished | failed | stopped | crashed; stopped, failed and crashed resume
STATES = ("queued", "running", "stopping", "stopped", "finished", "failed", "crashed")
ACTIVE = ("running", "stopping")
RESUMABLE = ("stopped", "failed", "crashed")


@dataclass
class RunRecord:
    id: str
    name: str
    algorithm: str
    state: str = "queued"
    seq: int = 0                      # submission order: queued runs start in this order
    created: float = field(default_factory=time.time)
    config_path: str | None = None    # the file it was submitted as, if any (labels errors)
    base_dir: str = ""                # where the configuration's relative paths resolve
    resume: bool = False              # start from the latest checkpoint
    step: int = 0
    total: int | None = None
    last: dict = field(default_factory=dict)      # the latest step's metrics
    pid: int | None = None
    started: float | None = None
    ended: float | None = None
    error: str | None = None
    serving: dict = field(default_factory=dict)   # the run's [serving] section

    def public(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("pid", "base_dir")}


def _slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")
    return (s or "run")[:40]


class RunStore:
    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "runs"
        self.root.mkdir(parents=True, exist_ok=True)

    def dir(self, run_id: str) -> Path:
        return self.root / run_id

    def out(self, run_id: str) -> Path:
        return self.dir(run_id) / "out"

    def checkpoints(self, run_id: str) -> Path:
        return self.out(run_id) / "checkpoints"

    def log_path(self, run_id: str) -> Path:
        return self.dir(run_id) / "log.txt"

    def save(self, rec: RunRecord) -> None:
        atomic_write(self.dir(rec.id) / "run.json", json.dumps(asdict(rec), indent=1, sort_keys=True))

    def load_all(self) -> list[RunRecord]:
        """Every run on disk, oldest first. A half-created directory (no run.json) is skipped."""
        out = []
        for d in sorted(self.root.iterdir()) if self.root.exists() else []:
            try:
                raw = json.loads((d / "run.json").read_text())
            except (OSError, json.JSONDecodeError):
                continue
            known = {k: v for k, v in raw.items() if k in RunRecord.__dataclass_fields__}
            out.append(RunRecord(**known))
        return sorted(out, key=lambda r: r.seq)

    def create(self, toml_text: str, *, config_path: Path | None, base_dir: Path, name: str | None,
               seq: int) -> RunRecord:
        """Validate a configuration and write the new run's directory (config.toml, run.json).
        A bad configuration raises ConfigError naming the key and writes nothing."""
        label = Path(config_path) if config_path else Path("<submitted TOML>")
        cfg = parse_config(toml_text, label, base_dir)
        stem = name or cfg.run.name or (config_path.stem if config_path else "run")
        run_id = f"{_slug(stem)}-{seq}"
        while self.dir(run_id).exists():
            seq += 1
            run_id = f"{_slug(stem)}-{seq}"
        rec = RunRecord(run_id, stem, cfg.run.algorithm, seq=seq,
                        config_path=str(config_path) if config_path else None, base_dir=str(base_dir),
                        serving=serving_dict(cfg))
        tmp = self.root / f".{run_id}.tmp"
        tmp.mkdir(parents=True, exist_ok=False)
        atomic_write(tmp / "config.toml", toml_text)
        atomic_write(tmp / "run.json", json.dumps(asdict(rec), indent=1, sort_keys=True))
        os.replace(tmp, self.dir(run_id))       # the run appears whole or not at all
        return rec

    def config(self, rec: RunRecord) -> Config:
        """The run's configuration as the worker trains it: output and checkpoints inside the run."""
        text = (self.dir(rec.id) / "config.toml").read_text()
        label = Path(rec.config_path) if rec.config_path else self.dir(rec.id) / "config.toml"
        cfg = parse_config(text, label, Path(rec.base_dir))
        cfg.run.output = self.out(rec.id)
        cfg.checkpoint.directory = None
        return cfg

    # ---- adapters on disk ------------------------------------------------------------------
    def steps(self, run_id: str) -> list[int]:
        """Steps with a saved adapter (checkpoints kept by [checkpoint].keep)."""
        return [s for p in ckpt.step_states(self.checkpoints(run_id))
                if (p / "adapter.gguf").exists() and (s := ckpt.step_of(p)) is not None]

    def adapter(self, run_id: str, which: str) -> Path | None:
        """final, best, latest or step-N: the adapter file, or None when the run has none (yet)."""
        cdir = self.checkpoints(run_id)
        p: Path | None
        if which == "final":
            p = self.out(run_id) / "adapter.gguf"
        elif which == "best":
            p = cdir / "best.gguf"
        else:                                   # latest or step-N
            state = ckpt.find(cdir, which)
            p = state / "adapter.gguf" if state else None
        return p if p is not None and p.is_file() else None


def parse_config(text: str, label: Path, base_dir: Path) -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: not valid TOML: {exc}") from None
    cfg = from_dict(raw, label, base=base_dir)
    check_paths(cfg)
    return cfg


def serving_dict(cfg: Config) -> dict:
    s = cfg.serving
    return {"enabled": s.enabled, "idle_seconds": s.idle_seconds, "device_wait_seconds": s.device_wait_seconds,
            "queue": s.queue, "parallel": s.parallel, "wait_seconds": s.wait_seconds, "max_body_bytes": s.max_body_bytes}
