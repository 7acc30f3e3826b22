"""The one training loop, shared by every algorithm: learning-rate schedule, gradient accumulation
over the recipe's micro-batches, AdamW, evaluation, checkpoints with exact resume, metrics, plots.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrograd import checkpoint as ckpt
from retrograd.algorithms import recipe_for
from retrograd.config import Config
from retrograd.data import chat as chat_mod
from retrograd.data import tokenizer as tok_mod
from retrograd.data.batching import train_and_eval
from retrograd.data.formats import DataError, load_examples
from retrograd.engine import LoraSpec, Trainable
from retrograd.models import default_model_path
from retrograd.native import NativeError
from retrograd.report import MetricsLog, Progress, plot


class TrainError(RuntimeError):
    pass


CURVES = ["loss", "reward_mean", "eval_loss", "eval_reward", "eval_top1", "eval_pref_accuracy", "reward_margin", "kl",
          "grad_norm", "lr"]


def plot_run(out: Path) -> Path | None:
    """Draw RUN/loss.png from RUN/metrics.jsonl (also: python scripts/plot_run.py RUN)."""
    records = MetricsLog(Path(out) / "metrics.jsonl").read()
    keys = CURVES
    if any("eval_reward" in r for r in records):      # RL's eval_loss is only -eval_reward
        keys = [k for k in CURVES if k != "eval_loss"]
    return plot(records, keys, Path(out) / "loss.png", title=Path(out).name)


@dataclass
class RunContext:
    cfg: Config
    out: Path
    trainable: Trainable
    tokenizer: tok_mod.Tokenizer
    chat: chat_mod.ChatFormat
    train_examples: list = field(default_factory=list)
    eval_examples: list = field(default_factory=list)
    notes: list = field(default_factory=list)


def resolve_model(cfg: Config) -> Path:
    return Path(cfg.model.path) if cfg.model.path else default_model_path()


def resolve_threads(cfg: Config) -> int:
    env = os.environ.get("RETRO_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise TrainError(f"RETRO_THREADS must be a positive integer, got {env!r}")
        return int(env)
    return cfg.training.threads or cfg.model.threads or (os.cpu_count() or 1)


def run_dir(cfg: Config) -> Path:
    if cfg.run.output:
        return Path(cfg.run.output)
    base = cfg.source.parent if cfg.source else Path.cwd()
    return base / "runs" / run_name(cfg)


def run_name(cfg: Config) -> str:
    return cfg.run.name or (cfg.source.stem if cfg.source else "run")


def open_model(cfg: Config, *, need_data: bool = True) -> RunContext:
    """Model, adapter, tokenizer, chat format and (optionally) the data of a configuration."""
    model_path = resolve_model(cfg)
    trainable = Trainable(model_path, LoraSpec(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.targets)),
                          device=cfg.model.device, threads=resolve_threads(cfg), seed=cfg.run.seed)
    if cfg.lora.init_adapter:
        trainable.load_adapter(Path(cfg.lora.init_adapter))
    tok = tok_mod.load(str(model_path))
    chat = chat_mod.format_for(tok, cfg.model.chat_template)
    ctx = RunContext(cfg, run_dir(cfg), trainable, tok, chat)
    if chat.origin.startswith("fallback"):
        ctx.notes.append(f"{model_path.name} has no chat template; using the built-in {chat.origin[9:]} format")
    if need_data and cfg.run.algorithm in ("sft", "distill"):   # the others read prompts or pairs themselves
        load_data(ctx)
    return ctx


def load_data(ctx: RunContext) -> None:
    d, cfg = ctx.cfg.data, ctx.cfg
    if d.train is None:
        raise DataError(f"{cfg.source or '<config>'}: [data].train is required for {cfg.run.algorithm}")
    ctx.train_examples, ctx.eval_examples = train_and_eval(
        cfg, lambda path: load_examples(path, ctx.tokenizer, ctx.chat, fmt=d.format,
                                        max_length=min(d.max_length, cfg.model.ctx), skip_bad=d.skip_bad_lines),
        "data", ctx.notes)


def learning_rate(cfg: Config, step: int, total: int) -> float:
    """Learning rate for 0-based optimizer step `step`: linear warm-up, then the chosen decay."""
    t = cfg.training
    peak = t.learning_rate
    if t.warmup_steps and step < t.warmup_steps:
        return peak * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return peak
    span = max(1, total - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    if t.lr_schedule == "linear":
        return peak * (1.0 - frac)
    return peak * 0.5 * (1.0 + math.cos(math.pi * frac))


def preflight_check(ctx: RunContext, progress_note) -> None:
    cfg = ctx.cfg
    unsupported = ctx.trainable.engine.preflight(ctx.trainable.lora, cfg.training.micro_batch_tokens)
    if not unsupported:
        return
    listing = ", ".join(f"{op} x{n}" for op, n in unsupported.items())
    strict = cfg.training.require_gpu_resident or os.environ.get("RETRO_REQUIRE_GPU_RESIDENT") == "1"
    msg = (f"{ctx.trainable.info.device_name} cannot run these ops of the training graph "
           f"(they fall back to the CPU): {listing}")
    if strict:
        raise TrainError(msg + " (require_gpu_resident is set)")
    progress_note("warning: " + msg)


class Trainer:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.recipe = recipe_for(self.cfg.run.algorithm)(ctx)
        self.ckpt_dir = Path(self.cfg.checkpoint.directory or ctx.out / "checkpoints")
        self.metrics = MetricsLog(ctx.out / "metrics.jsonl")
        self.step = 0
        self.best: float | None = None
        self.nonfinite = 0

    # ---- state -------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"recipe": self.recipe.state_dict(), "best": self.best, "nonfinite": self.nonfinite}

    def resume(self, state_dir: Path) -> None:
        st = ckpt.load(state_dir, self.ctx.trainable)
        self.step = int(st["step"])
        self.best = st.get("best")
        self.nonfinite = int(st.get("nonfinite", 0))
        self.recipe.load_state_dict(st.get("recipe", {}))
        self.metrics.truncate_after(self.step)

    def save(self) -> Path:
        path = ckpt.save(self.ckpt_dir, self.step, self.ctx.trainable, self.state(), self.cfg.to_dict())
        ckpt.prune(self.ckpt_dir, self.cfg.checkpoint.keep)
        plot_run(self.ctx.out)          # the curves so far, refreshed with every checkpoint
        return path

    # ---- loop --------------------------------------------------------------------------------
    def run(self, total: int, progress: Progress) -> dict:
        cfg, tr = self.cfg, self.ctx.trainable
        t = cfg.training
        last = {}
        while self.step < total:
            t0 = time.monotonic()
            work = self.recipe.next_step()
            sums: dict[str, float] = {}
            ok = True
            for mb in work.micro:
                def fn(inp, mb=mb, sums=sums):
                    out, m = mb.loss(inp)
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + v
                    return out
                try:
                    tr.accumulate(mb.batch, fn, entropy=mb.want_entropy, hidden=mb.want_hidden)
                except NativeError as exc:
                    if exc.kind != "non-finite value":
                        raise
                    ok = False
                    progress.note(f"step {self.step + 1}: {exc}; the step is skipped")
                    break
            lr = learning_rate(cfg, self.step, total)
            gnorm = float("nan")
            if ok:
                try:
                    gnorm = tr.optimizer_step(lr=lr, step=self.step + 1, beta1=t.beta1, beta2=t.beta2, eps=t.eps,
                                              weight_decay=t.weight_decay, grad_clip=t.grad_clip)
                except NativeError as exc:
                    if exc.kind != "non-finite value":
                        raise
                    ok = False
                    progress.note(f"step {self.step + 1}: {exc}")
            else:
                tr.lora.zero(1)
            if not ok:
                self.nonfinite += 1
                if self.nonfinite >= 5:
                    raise TrainError("5 steps had non-finite losses or gradients; stopping (the last good "
                                     "checkpoint is intact). Lower the learning rate or check the data.")
            self.step += 1
            if work.finalize:
                sums = work.finalize(sums)
            dt = time.monotonic() - t0
            rec = {"step": self.step, "lr": lr, "grad_norm": gnorm, "tokens": work.n_tokens,
                   "tok_s": work.n_tokens / dt if dt > 0 else 0.0, "time": time.time(), **sums, **work.info}
            if cfg.evaluation.every_steps and self.step % cfg.evaluation.every_steps == 0 and self.step < total:
                rec.update(self.evaluate(progress))
            self.metrics.append(rec)
            last = rec
            shown = {k: rec[k] for k in ("loss", "reward_mean", "eval_loss") if k in rec}
            shown["lr"] = lr
            progress.update(self.step, work.n_tokens, shown)
            if cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0 and self.step < total:
                self.checkpoint_with_best(rec)
        return last

    def evaluate(self, progress: Progress) -> dict:
        m = self.recipe.evaluate()
        if m:
            progress.note("eval at step {}: {}".format(
                self.step, ", ".join(f"{k} {v:.4g}" for k, v in m.items() if not k.endswith(("_tokens", "_examples")))))
        return m

    def checkpoint_with_best(self, rec: dict) -> Path:
        key = self.cfg.checkpoint.best_metric
        value = rec.get(key)
        improved = value is not None and np.isfinite(value) and (self.best is None or value < self.best)
        if improved:
            self.best = float(value)
        path = self.save()
        if improved:
            ckpt.mark_best(self.ckpt_dir, path)
        return path


def train(ctx: RunContext, resume: Path | bool | None = None) -> dict:
    """Run the configured algorithm to completion; returns a summary."""
    cfg = ctx.cfg
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    trainer = Trainer(ctx)
    if resume:
        state_dir = Path(resume) if isinstance(resume, (str, Path)) else ckpt.latest(trainer.ckpt_dir)
        if state_dir is None:
            raise TrainError(f"--resume: no checkpoint in {trainer.ckpt_dir}")
        trainer.resume(state_dir)
    total = cfg.training.max_steps or trainer.recipe.estimate_steps()
    progress = Progress(total, trainer.step, every=cfg.training.log_every)
    for note in ctx.notes:
        progress.note(note)
    preflight_check(ctx, progress.note)
    if resume:
        progress.note(f"resumed at step {trainer.step} from {state_dir}")
    if trainer.step >= total:
        progress.note(f"nothing to do: the run already reached step {total}")
    if not resume and cfg.evaluation.every_steps and trainer.step < total:
        base_eval = trainer.evaluate(progress)     # the starting point of the eval curve
        if base_eval:
            trainer.metrics.append({"step": 0, **base_eval, "time": time.time()})
    t0 = time.monotonic()
    last = trainer.run(total, progress)
    final_eval = trainer.evaluate(progress)
    if final_eval:
        last = {**last, **final_eval}
        rec = {"step": trainer.step, **final_eval, "time": time.time(), "final": True}
        trainer.metrics.append(rec)
    trainer.checkpoint_with_best(last)
    ctx.trainable.save_adapter(ctx.out / "adapter.gguf")
    png = plot_run(ctx.out)
    return {"steps": trainer.step, "adapter": str(ctx.out / "adapter.gguf"), "metrics": str(trainer.metrics.path),
            "plot": str(png) if png else None, "seconds": time.monotonic() - t0,
            **{k: v for k, v in last.items() if isinstance(v, float) and not np.isnan(v)}}
