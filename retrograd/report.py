"""What a run shows and leaves behind: a progress line (redrawn on a terminal, one line per log
interval otherwise), metrics appended as JSON lines, and curves drawn as PNG."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TextIO

from retrograd.fsutil import atomic_open, atomic_write


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "--:--"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """step/total, the given metrics, tokens/s and ETA on one line."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None, every: int = 1,
                 label: str = "step") -> None:
        self.total = total
        self.label = label
        self.start_step = start
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every
        self.t0 = time.monotonic()
        self.tokens = 0

    def update(self, step: int, tokens: int, metrics: dict) -> None:
        self.tokens += tokens
        elapsed = time.monotonic() - self.t0
        done = step - self.start_step
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        eta = elapsed / done * (self.total - step) if done else float("nan")
        width = 24
        filled = int(width * step / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        parts = [f"{self.label} {step}/{self.total} [{bar}]"]
        for k, v in metrics.items():
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
        parts += [f"{rate:.0f} tok/s", f"ETA {fmt_duration(eta)}"]
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if step >= self.total:
                self.stream.write("\n")
        elif step % self.every == 0 or step >= self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A message that must not be overwritten by the next redraw."""
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.on_append: Callable[[dict], None] | None = None     # the experiment trackers (trackers.py)

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
        if self.on_append is not None:
            self.on_append(record)

    def truncate_after(self, step: int) -> None:
        """On resume, forget lines logged after the checkpoint (they will be redone)."""
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        atomic_write(self.path, "".join(line + "\n" for line in keep))

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot(records: Iterable[dict], keys: list[str], path: Path, title: str = "") -> Path | None:
    """One panel per key that has values, against the step."""
    records = list(records)
    series = {k: [(r["step"], r[k]) for r in records if k in r and r[k] is not None] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.6 * len(series)), squeeze=False)
    for ax, (k, pts) in zip(axes[:, 0], series.items()):
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, linewidth=1.4)
        ax.set_ylabel(k)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    with atomic_open(path) as fh:
        fig.savefig(fh, dpi=110, format="png")
    plt.close(fig)
    return Path(path)


CURVES = ["loss", "reward_mean", "eval_loss", "eval_reward", "eval_top1", "eval_pref_accuracy", "reward_margin", "kl",
          "grad_norm", "lr"]


def plot_run(out: Path) -> Path | None:
    """Draw RUN/loss.png from RUN/metrics.jsonl (also: python scripts/plot_run.py RUN)."""
    records = MetricsLog(Path(out) / "metrics.jsonl").read()
    return plot(records, CURVES, Path(out) / "loss.png", title=Path(out).name)
