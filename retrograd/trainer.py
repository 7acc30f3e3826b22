"""The one training loop, shared by every algorithm: learning-rate schedule, gradient accumulation
over the recipe's micro-batches, AdamW, evaluation, checkpoints with exact resume, metrics, plots.
What sees it from outside: a step callback (StepRecord after every step; retrograd-server) and a
StepHook at the phases of each step (retrograd-profile times them).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from retrograd import checkpoint as ckpt
from retrograd import native
from retrograd.algorithms import recipe_for
from retrograd.algorithms.base import StepWork
from retrograd.batch import Tally
from retrograd.config import Config, best_metric
from retrograd.context import RunContext, preflight_check
from retrograd.distributed import workers_for
from retrograd.engine import Trainable
from retrograd.errors import RetrogradError
from retrograd.fsutil import atomic_write
from retrograd.logs import log
from retrograd.report import MetricsLog, Progress, plot_run
from retrograd.run_setup import checkpoint_dir
from retrograd.trackers import Trackers, check_installed

if TYPE_CHECKING:
    from retrograd.distributed import Cluster

MAX_NONFINITE = 5


class TrainError(RetrogradError):
    pass


class RunStopped(Exception):
    """The step callback asked the run to stop; a checkpoint of `step` was written first."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped at step {step}")
        self.step = step


@dataclass(frozen=True)
class StepRecord:
    """What a step callback sees of the optimizer step just taken."""

    step: int                  # optimizer steps taken so far in the run
    total: int                 # the run's length in steps
    metrics: dict              # the step's record, as metrics.jsonl has it
    trainable: Trainable       # the model, its adapter as this step left it (live weights)


#: called after every optimizer step with its record; True asks to stop
StepCallback = Callable[[StepRecord], bool]


class StepHook(Protocol):
    """What sees the phases of every optimizer step the trainer takes (retrograd-profile times them)."""

    def started(self) -> None:
        """A step begins: the recipe is about to sample (RL) and build its micro-batches."""

    def prepared(self, work: StepWork) -> None:
        """The recipe's work is ready: its rollout and reference log-probs are done (their times in
        work.info, the adapter swap in work.swap_s)."""

    def gradients_done(self) -> None:
        """Forward, LM head and backward are done and the optimizer comes next; with [distributed],
        the workers' step is done, the driver's optimizer included. Not called for a step whose loss
        or gradient was not finite."""

    def finished(self, work: StepWork) -> None:
        """The update is applied (or the step skipped); with [distributed], work.info has the
        workers' times."""


class Unwatched:
    """The StepHook of a trainer nobody watches."""

    def started(self) -> None:
        pass

    def prepared(self, work: StepWork) -> None:
        pass

    def gradients_done(self) -> None:
        pass

    def finished(self, work: StepWork) -> None:
        pass


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


def _due(every: int, step: int, total: int) -> bool:
    """An every-N-steps event at this step (the last step has its own, after the loop)."""
    return bool(every) and step % every == 0 and step < total


class Trainer:
    def __init__(self, ctx: RunContext, cluster: Cluster | None = None, hook: StepHook | None = None) -> None:
        """cluster: the run's Ray workers with [distributed] (distributed.workers_for), else None;
        hook: what sees the phases of each step."""
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.cluster = cluster
        self.hook: StepHook = hook or Unwatched()
        # [distributed].rollouts: the recipe's generators sample on the workers
        sampling = cluster.generator if cluster is not None and self.cfg.distributed.rollouts else None
        self.recipe = recipe_for(self.cfg.run.algorithm)(ctx, sampling)
        # the workers compute the step's gradients unless the recipe keeps them in this process
        self.grad_workers = cluster if cluster is not None and self.recipe.distributed_gradients else None
        self.ckpt_dir = checkpoint_dir(self.cfg)
        self.metrics = MetricsLog(ctx.out / "metrics.jsonl")
        self.best_key, self.higher_is_better = best_metric(self.cfg)
        self.global_step = 0
        self.best: float | None = None
        self.nonfinite = 0
        self.on_step: StepCallback | None = None
        self.trackers: Trackers | None = None      # [run].report_to, fed by self.metrics

    # ---- state -------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"recipe": self.recipe.state_dict(), "best": self.best, "nonfinite": self.nonfinite}

    def resume(self, state_dir: Path) -> None:
        st = ckpt.load(state_dir, self.ctx.trainable)
        self.global_step = int(st["step"])
        self.best = st.get("best")
        self.nonfinite = int(st.get("nonfinite", 0))
        self.recipe.load_state_dict(st.get("recipe", {}))
        self.metrics.truncate_after(self.global_step)

    def save(self) -> Path:
        path = ckpt.save(self.ckpt_dir, self.global_step, self.ctx.trainable, self.state(), self.cfg.to_dict())
        self.crash_note(path)           # before the prune removes the checkpoint the note named
        ckpt.prune(self.ckpt_dir, self.cfg.checkpoint.keep)
        plot_run(self.ctx.out)          # the curves so far, refreshed with every checkpoint
        return path

    def crash_note(self, last: Path | None) -> None:
        """Off the CPU, what the process says if a device driver kills it (issue 38: Mesa 22's
        lavapipe): that the run can go on, from which checkpoint, with which command."""
        dev = self.ctx.trainable.model.device
        if dev.kind == "cpu":
            return
        where = (f"its last checkpoint, {last}, is intact" if last is not None
                 else "no checkpoint was written yet ([checkpoint].every_steps sets how often)")
        cmd = f"retrograd train {self.cfg.source or 'CONFIG'} --resume"
        native.set_crash_note(
            f"retrograd: the process died of a fatal signal while training on {dev.name} ({dev.description}). "
            "A fault inside the device's driver ends a run this way (Mesa's lavapipe before 25.0 does now "
            f"and then; retrograd's docs/building.md). The run can go on: {where}; continue with: {cmd}")

    # ---- one optimizer step --------------------------------------------------------------------
    def step(self, work: StepWork, lr: float) -> tuple[float, dict[str, float], str | None]:
        """Accumulate the gradients of the step's micro-batches and apply AdamW. Returns the gradient
        norm, the step's metrics and, when a loss or gradient was not finite (the step is then
        skipped and the adapter untouched), the reason."""
        tr, t = self.ctx.trainable, self.cfg.training
        tally = Tally()
        hp = {"lr": lr, "step": self.global_step + 1, "beta1": t.beta1, "beta2": t.beta2, "eps": t.eps,
              "weight_decay": t.weight_decay, "grad_clip": t.grad_clip, "lr_b_ratio": t.lora_plus_ratio}
        try:
            if self.grad_workers is not None:       # the workers compute, this process sums and steps
                gnorm = self.grad_workers.train_step(work.micro, tally, hp)
                self.hook.gradients_done()
            else:
                for mb in work.micro:
                    tr.accumulate(mb.batch, mb.coefficients(tally),
                                  entropy=mb.want_entropy, hidden=mb.want_hidden)
                self.hook.gradients_done()
                gnorm = tr.optimizer_step(**hp)
        except native.NativeError as exc:
            if exc.status != native.STATUS_NONFINITE:
                raise
            tr.lora.zero(native.SLOT_GRAD)
            return float("nan"), tally.result(), str(exc)
        if self.cluster is not None:
            work.info.update(self.cluster.step_timings())
        if work.on_kept:
            work.on_kept(tally.kept)
        if work.after_update:
            work.after_update()
        return gnorm, tally.result(), None

    # ---- loop --------------------------------------------------------------------------------
    def run(self, total: int, progress: Progress) -> dict:
        cfg = self.cfg
        last: dict = {}
        while self.global_step < total:
            t0 = time.monotonic()
            self.hook.started()
            work = self.recipe.next_step()
            self.hook.prepared(work)
            lr = learning_rate(cfg, self.global_step, total)
            gnorm, stats, failure = self.step(work, lr)
            self.hook.finished(work)
            if failure:
                self.nonfinite += 1
                progress.note(f"step {self.global_step + 1}: {failure}; the step is skipped")
                if self.nonfinite >= MAX_NONFINITE:
                    raise TrainError(f"{MAX_NONFINITE} steps had non-finite losses or gradients; stopping (the last "
                                     "good checkpoint is intact). Lower the learning rate or check the data.")
            self.global_step += 1
            dt = time.monotonic() - t0
            rec = {"step": self.global_step, "lr": lr, "grad_norm": gnorm, "tokens": work.n_tokens,
                   "tok_s": work.n_tokens / dt if dt > 0 else 0.0, "time": time.time(), **stats, **work.info}
            if _due(cfg.evaluation.every_steps, self.global_step, total):
                rec.update(self.evaluate(progress))
            self.metrics.append(rec)
            log.debug("step %d: %s", self.global_step, {k: v for k, v in rec.items() if isinstance(v, (int, float))})
            last = rec
            shown = {k: rec[k] for k in ("loss", "reward_mean", "eval_loss", "eval_reward") if k in rec}
            shown["lr"] = lr
            progress.update(self.global_step, work.n_tokens, shown)
            saved = _due(cfg.checkpoint.every_steps, self.global_step, total)
            if saved:
                self.checkpoint_with_best(rec)
            if self.on_step is not None and self.on_step(StepRecord(self.global_step, total, rec, self.ctx.trainable)):
                if not saved:           # resume continues exactly where the run stopped
                    self.checkpoint_with_best(rec)
                raise RunStopped(self.global_step)
        return last

    def evaluate(self, progress: Progress) -> dict:
        m = self.recipe.evaluate()
        if m:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in m.items() if not k.endswith(("_tokens", "_examples")))
            progress.note(f"eval at step {self.global_step}: {shown}")
        return m

    def is_better(self, value: float | None) -> bool:
        if value is None or not np.isfinite(value):
            return False
        if self.best is None:
            return True
        return value > self.best if self.higher_is_better else value < self.best

    def checkpoint_with_best(self, rec: dict) -> Path:
        value = rec.get(self.best_key)
        improved = self.is_better(value)
        if improved and value is not None:       # is_better is False for None
            self.best = float(value)
        path = self.save()
        if improved:
            ckpt.mark_best(self.ckpt_dir, path)
        return path


def train(ctx: RunContext, resume: Path | bool | None = None, on_step: StepCallback | None = None) -> dict:
    """Run the configured algorithm to completion; returns a summary. `on_step` sees every step's
    StepRecord (retrograd-server: live weights, stop requests) and may stop the run (RunStopped)."""
    cfg = ctx.cfg
    ctx.out.mkdir(parents=True, exist_ok=True)
    if not resume:
        moved = ckpt.set_aside_previous_run(ctx.out, checkpoint_dir(cfg))
        if moved is not None:
            ctx.notes.append(f"{ctx.out} held an earlier run: its metrics, adapter and checkpoints are now in {moved} "
                             "(--resume continues a run instead)")
    atomic_write(ctx.out / "config.json", json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    with workers_for(ctx) as cluster:       # [distributed]: Ray workers for the run's lifetime
        trainer = Trainer(ctx, cluster)
        trainer.on_step = on_step
        trainer.crash_note(ckpt.latest(trainer.ckpt_dir) if resume else None)
        try:
            return _train(ctx, trainer, resume)
        except BaseException as exc:
            if trainer.trackers is not None:    # a stopped run continues with --resume
                trainer.trackers.finish(ok=isinstance(exc, RunStopped))
            raise
        finally:
            native.set_crash_note(None)
            trainer.recipe.close()          # tool servers, teachers, generators


def _train(ctx: RunContext, trainer: Trainer, resume: Path | bool | None) -> dict:
    cfg = ctx.cfg
    if resume:
        state_dir = Path(resume) if isinstance(resume, (str, Path)) else ckpt.latest(trainer.ckpt_dir)
        if state_dir is None:
            raise TrainError(f"--resume: no checkpoint in {trainer.ckpt_dir}")
        trainer.resume(state_dir)
    total = cfg.training.max_steps or trainer.recipe.estimate_steps()
    progress = Progress(total, trainer.global_step, every=cfg.training.log_every)
    for note in ctx.notes:
        progress.note(note)
    if cfg.run.report_to:
        check_installed(cfg.run.report_to, str(cfg.source or "<config>"))
        trainer.trackers = Trackers(cfg.run.report_to, ctx.out, cfg.run.name or ctx.out.name, cfg.to_dict(),
                                    resume=bool(resume), already=len(trainer.metrics.read()), warn=progress.note)
        trainer.metrics.on_append = trainer.trackers
    if trainer.cluster is not None:
        trainer.cluster.note = progress.note      # worker deaths and replacements, as they happen
    preflight_check(ctx, progress.note)
    if resume:
        progress.note(f"resumed at step {trainer.global_step} from {state_dir}")
    if trainer.global_step >= total:
        progress.note(f"nothing to do: the run already reached step {total}")
    if not resume and cfg.evaluation.every_steps and trainer.global_step < total:
        base_eval = trainer.evaluate(progress)     # the starting point of the eval curve
        if base_eval:
            trainer.metrics.append({"step": 0, **base_eval, "time": time.time()})
    t0 = time.monotonic()
    last = trainer.run(total, progress)
    final_eval = trainer.evaluate(progress)
    if final_eval:
        last = {**last, **final_eval}
        rec = {"step": trainer.global_step, **final_eval, "time": time.time(), "final": True}
        trainer.metrics.append(rec)
    trainer.checkpoint_with_best(last)
    ctx.trainable.save_adapter(ctx.out / "adapter.gguf")
    merged = export_merged(ctx, progress) if ctx.trainable.spec.dora else {}
    png = plot_run(ctx.out)
    if trainer.trackers is not None:
        trainer.trackers.artifacts([ctx.out / "adapter.gguf", *([Path(merged["merged"])] if merged else [])])
        merged["tracker_errors"] = trainer.trackers.finish()
    return {"steps": trainer.global_step, "adapter": str(ctx.out / "adapter.gguf"), "metrics": str(trainer.metrics.path),
            "plot": str(png) if png else None, "seconds": time.monotonic() - t0, **merged,
            **{k: v for k, v in last.items() if isinstance(v, float) and not np.isnan(v)}}


def export_merged(ctx: RunContext, progress: Progress) -> dict:
    """DoRA: llama.cpp cannot load the adapter, so the run also leaves the model with it merged in
    ([lora].merged_format) and says how much of the trained change that format kept."""
    from retrograd import adapter as adapter_io
    from retrograd.generation.merge import write_merged

    out = ctx.out / "merged.gguf"
    fmt = ctx.cfg.lora.merged_format
    report = write_merged(ctx.trainable.model_path, adapter_io.read(ctx.out / "adapter.gguf"), out, fmt)
    progress.note(f"{out}: the model with the DoRA adapter merged in, for llama.cpp; {report.line(fmt)}")
    return {"merged": str(out), "merged_kept": report.kept}
