"""A run's context: the configuration, the trainable model (quantized GGUF + LoRA + engine), its
tokenizer and chat format, the run directory and the notes to show at the start. Every recipe
is built from one, and `open_model` is the one place that assembles it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from retrograd import native
from retrograd.config import Config, ConfigError
from retrograd.data import chat as chat_mod
from retrograd.data import tokenizer as tok_mod
from retrograd.data.batching import train_and_eval
from retrograd.data.formats import Example, load_examples
from retrograd.engine import LoraSpec, Trainable
from retrograd.errors import RetrogradError
from retrograd.run_setup import config_label, resolve_model, resolve_threads, run_dir


@dataclass
class RunContext:
    cfg: Config
    out: Path
    trainable: Trainable
    tokenizer: tok_mod.Tokenizer
    chat: chat_mod.ChatFormat
    train_examples: list[Example] = field(default_factory=list)
    eval_examples: list[Example] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def require_train_data(self) -> Path:
        """[data].train, or the same configuration error for every algorithm that needs it."""
        if self.cfg.data.train is None:
            raise ConfigError(f"{config_label(self.cfg)}: [data].train is required for {self.cfg.run.algorithm}")
        return Path(self.cfg.data.train)


def open_model(cfg: Config, *, need_data: bool = True) -> RunContext:
    """Model, adapter, tokenizer, chat format and (for sft and distill) the examples of a configuration."""
    model_path = resolve_model(cfg)
    spec = LoraSpec(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.targets), cfg.lora.scaling, cfg.lora.variant)
    trainable = Trainable(model_path, spec, device=cfg.model.device, threads=resolve_threads(cfg), seed=cfg.run.seed)
    trainable.engine.set_recompute(cfg.training.activation_checkpointing)
    try:
        trainable.engine.set_matmul_mode(cfg.training.matmul_precision)
    except native.NativeError as exc:       # a route forced that this CPU cannot run
        trainable.close()
        raise ConfigError(f"{config_label(cfg)}: [training].matmul_precision = "
                          f"{cfg.training.matmul_precision!r}: {exc}") from exc
    cache_note = weight_cache(trainable, cfg.training.weight_cache_mb, cfg.training.matmul_precision)
    if cfg.lora.init_adapter:
        trainable.load_adapter(Path(cfg.lora.init_adapter), reference=True)
    tok = tok_mod.load(str(model_path))
    chat = chat_mod.format_for(tok, cfg.model.chat_template)
    ctx = RunContext(cfg, run_dir(cfg), trainable, tok, chat)
    if cache_note:
        ctx.notes.append(cache_note)
    if chat.origin.startswith("fallback"):
        ctx.notes.append(f"{model_path.name} has no chat template; using the built-in {chat.origin[9:]} format")
    if cfg.lora.dropout > 0 and cfg.run.algorithm not in ("sft", "distill"):
        ctx.notes.append(f"[lora].dropout applies to sft and distill; {cfg.run.algorithm} trains without it (its "
                         "log-prob ratios must compare one network with itself, as TRL's default)")
    if need_data and cfg.run.algorithm in ("sft", "distill"):   # the others read prompts or pairs themselves
        load_data(ctx)
    return ctx


def weight_cache(trainable: Trainable, mib: int, matmul: str = "auto") -> str | None:
    """[training].weight_cache_mb: the 16-bit copies, on the CPU; a line for the run's notes."""
    if mib <= 0:
        return None
    try:
        used = trainable.model.set_weight_cache(mib, matmul)
    except native.NativeError as exc:       # another device: it converts with ggml's own ops
        return f"[training].weight_cache_mb is not used: {exc}"
    if used == 0:
        return f"[training].weight_cache_mb is not used: matmul_precision = {matmul!r} converts no weight"
    return f"weight cache: {used:.1f} MiB of {native.conv_type(matmul)} weights (budget {mib} MiB)"


def load_data(ctx: RunContext) -> None:
    d, cfg = ctx.cfg.data, ctx.cfg
    ctx.require_train_data()
    ctx.train_examples, ctx.eval_examples = train_and_eval(
        cfg, lambda path: load_examples(path, ctx.tokenizer, ctx.chat, fmt=d.format,
                                        max_length=min(d.max_length, cfg.model.ctx), skip_bad=d.skip_bad_lines),
        "data", ctx.notes)


def preflight_check(ctx: RunContext, note) -> None:
    """Ops of the training graph the device cannot run: a warning, or an error when the run must
    stay on the device ([training].require_gpu_resident or RETRO_REQUIRE_GPU_RESIDENT=1)."""
    cfg = ctx.cfg
    unsupported = ctx.trainable.engine.preflight(ctx.trainable.lora, cfg.training.micro_batch_tokens)
    slow = ctx.trainable.engine.slow_paths()
    if slow:
        note("slow paths on this device (retrograd preflight says why): "
             + ", ".join(f"{what} x{n}" for what, n, _ in slow))
    if not unsupported:
        return
    listing = ", ".join(f"{op} x{n}" for op, n in unsupported.items())
    strict = cfg.training.require_gpu_resident or os.environ.get("RETRO_REQUIRE_GPU_RESIDENT") == "1"
    msg = (f"{ctx.trainable.info.device_name} cannot run these ops of the training graph "
           f"(they fall back to the CPU): {listing}")
    if strict:
        raise RetrogradError(msg + " (require_gpu_resident is set)")
    note("warning: " + msg)
