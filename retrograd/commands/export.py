"""`retrograd export CONFIG [--adapter A | --checkpoint best|latest|step-N] --out FILE.gguf
[--type T] [--force] [--ollama NAME]`: the adapter merged into the base model and written as one
GGUF (generation/export.py), optionally an Ollama Modelfile beside it, and the held-out perplexity
of the file against base + adapter, both scored by llama.cpp, when the run has evaluation data."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from retrograd.commands import Subparsers, load_config
from retrograd.config import Config
from retrograd.errors import RetrogradError, UsageError
from retrograd.fsutil import atomic_write
from retrograd.run_setup import checkpoint_dir, resolve_model, resolve_threads, run_dir

PPL_TOKENS = 300          # held-out tokens the closing perplexity check scores


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("export", help="merge the adapter into the base model and write one quantized GGUF",
                       description="Merge the adapter (LoRA or DoRA; --adapter, --checkpoint, else the run's "
                                   "adapter.gguf) into the base model's weights in F32 and write one GGUF that any "
                                   "llama.cpp-based runtime loads alone, quantized by llama.cpp's own quantizer; the "
                                   "base's metadata, tokenizer and chat template are kept. The file is written under a "
                                   "temporary name and renamed when complete. When the configuration has evaluation "
                                   "data, the end prints the file's held-out perplexity against base + adapter "
                                   "(docs/export.md).")
    p.add_argument("config", help="run configuration (TOML)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--adapter", metavar="A", help="the adapter to merge (a GGUF, or a checkpoint's .state directory)")
    g.add_argument("--checkpoint", metavar="best|latest|step-N", help="the adapter of this checkpoint of the run")
    p.add_argument("--out", required=True, metavar="FILE.gguf", help="the GGUF to write")
    p.add_argument("--type", default="q8_0", metavar="TYPE",
                   help="q4_k_m, q5_k_m, q6_k, q8_0 (default), f16, or same (each tensor keeps the base's type)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--ollama", metavar="NAME", help="also write FILE.Modelfile for Ollama and print the "
                                                   "`ollama create NAME` command")
    p.add_argument("--model", metavar="M", help="use this GGUF instead of [model].path")
    p.set_defaults(run=run)


def find_adapter(args: argparse.Namespace, cfg: Config) -> Path:
    """--adapter (a GGUF or a .state directory), --checkpoint best|latest|step-N, else the run's adapter."""
    from retrograd import checkpoint as ckpt

    if args.adapter:
        p = Path(args.adapter).resolve()
        if p.is_dir():
            return ckpt.adapter_of(p)
        if not p.is_file():
            raise RetrogradError(f"--adapter: {p}: no such adapter file")
        return p
    if args.checkpoint:
        d = checkpoint_dir(cfg)
        name = args.checkpoint
        ref = ckpt.parse_ref(name)
        if ref is None:
            raise UsageError(f"--checkpoint {name!r}: expected best, latest or step-N")
        state = ckpt.find(d, ref)
        if state is None:
            have = sorted(p.name.removesuffix(".state") for p in d.glob("*.state")) if d.is_dir() else []
            raise RetrogradError(f"--checkpoint {name}: no such checkpoint in {d} "
                                 f"({'there: ' + ', '.join(have) if have else 'it holds none'})")
        return ckpt.adapter_of(state)
    p = run_dir(cfg) / "adapter.gguf"
    if not p.is_file():
        raise RetrogradError(f"no adapter: {p} does not exist yet (train first, or pass --adapter or --checkpoint)")
    return p


def _bar(phase: str, done: int, total: int) -> None:
    width = 24
    filled = int(width * done / max(total, 1))
    line = f"{phase:<8} [{'#' * filled}{'-' * (width - filled)}] {100 * done / max(total, 1):3.0f}%"
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + line + ("\n" if done >= total else ""))
    elif done >= total:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def eval_examples(cfg: Config, model: Path) -> tuple[list, str] | None:
    """The run's held-out examples ([evaluation].data, else the [data].eval_split), or None."""
    from retrograd.data import chat as chat_mod
    from retrograd.data import tokenizer as tok_mod
    from retrograd.data.batching import split_holdout
    from retrograd.data.formats import load_examples

    tok = tok_mod.Tokenizer(model)
    chat = chat_mod.format_for(tok, cfg.model.chat_template)
    max_len = min(cfg.data.max_length, cfg.model.ctx)

    def load(path: Path) -> list:
        return load_examples(path, tok, chat, fmt=cfg.data.format, max_length=max_len, skip_bad=cfg.data.skip_bad_lines)[0]

    if cfg.evaluation.data and Path(cfg.evaluation.data).is_file():
        return load(Path(cfg.evaluation.data)), str(cfg.evaluation.data)
    if cfg.data.train and cfg.data.eval_split > 0 and Path(cfg.data.train).is_file():
        examples = load(Path(cfg.data.train))
        return split_holdout(examples, cfg.data.eval_split, cfg.run.seed)[1], f"{cfg.data.train} (held-out split)"
    return None


def perplexity_line(cfg: Config, model: Path, adapter: Path, out: Path, kind: str) -> str | None:
    """The exported file's held-out perplexity against base + adapter (llama.cpp on both)."""
    from retrograd import adapter as adapter_io
    from retrograd.eval.llama_ppl import score, take_tokens
    from retrograd.generation.merge import merged_model

    found = eval_examples(cfg, model)
    if found is None or not found[0]:
        return None
    examples, source = take_tokens(found[0], PPL_TOKENS), found[1]
    threads = resolve_threads(cfg)
    data = adapter.read_bytes()
    if adapter_io.kind_of(data) == "dora":      # llama.cpp cannot apply DoRA: its faithful F16 merge is the reference
        ref = score(merged_model(model, data), examples, n_ctx=cfg.model.ctx, threads=threads)
    else:
        ref = score(model, examples, lora=adapter, n_ctx=cfg.model.ctx, threads=threads)
    got = score(out, examples, n_ctx=cfg.model.ctx, threads=threads)
    change = 100.0 * (got.ppl / ref.ppl - 1.0)
    return (f"held-out perplexity on {got.tokens} tokens of {source} (llama.cpp): base + adapter {ref.ppl:.4f}, "
            f"{out.name} ({kind}) {got.ppl:.4f} ({change:+.2f}%)")


def run(args: argparse.Namespace) -> int:
    from retrograd import adapter as adapter_io
    from retrograd.data import tokenizer as tok_mod
    from retrograd.generation.export import TYPES, export
    from retrograd.generation.modelfile import modelfile

    cfg = load_config(args, reads=("model.path",))
    kind = args.type.lower()
    if kind not in TYPES:
        raise UsageError(f"--type {args.type!r}: expected one of {', '.join(TYPES)}")
    if args.adapter and args.checkpoint:
        raise UsageError("--adapter and --checkpoint: give one of them")
    out = Path(args.out).resolve()
    if out.exists() and not args.force:
        raise RetrogradError(f"--out {out}: the file exists (--force overwrites it)")
    if out.is_dir():
        raise UsageError(f"--out {out}: is a directory; name the GGUF file to write")
    adapter = find_adapter(args, cfg)
    model = resolve_model(cfg)
    ad = adapter_io.read(adapter)
    t0 = time.monotonic()
    result = export(model, ad, out, kind, threads=resolve_threads(cfg), progress=_bar)
    print(f"{out}: {model.name} with {adapter.name} ({ad.kind}, {result.merged} weights) merged in, {kind}, "
          f"{result.nbytes / 2**20:.1f} MiB in {time.monotonic() - t0:.1f} s")
    if result.fallbacks and result.fallbacks.count:
        print(result.fallbacks.summary() + " (llama.cpp's fallback, as llama-quantize does)")
    if args.ollama:
        tok = tok_mod.Tokenizer(out)
        eos = tok.token_text(tok.eos_id) if tok.eos_id >= 0 else None
        text, shape = modelfile(out, tok.chat_template, eos)
        mf = out.with_suffix(".Modelfile")
        atomic_write(mf, text)
        what = f"chat template translated from {shape}" if shape else "chat template NOT translated (see the file)"
        print(f"{mf}: Ollama Modelfile ({what}); load it with:\n  ollama create {args.ollama} -f {mf}")
    line = perplexity_line(cfg, model, adapter, out, kind)
    print(line or "no held-out data in the configuration ([evaluation].data or [data].eval_split): the perplexity "
                  "change was not measured")
    return 0
