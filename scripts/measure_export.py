"""The table of docs/export.md: for each --type, the held-out perplexity (llama.cpp scoring) of the
exported file against base + adapter, and its size.

    python scripts/measure_export.py CONFIG.toml ADAPTER.gguf [--tokens 300] [--types q4_k_m,f16,...]

--tokens counts trained tokens (the first examples adding up to it; prompts count toward a cap of
ten times as many tokens in all).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from retrograd import adapter as adapter_io
from retrograd.commands.export import eval_examples
from retrograd.config import load
from retrograd.eval.llama_ppl import score, take_tokens
from retrograd.generation.export import TYPES, export
from retrograd.run_setup import resolve_model, resolve_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("adapter")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--types", default=",".join(TYPES))
    args = ap.parse_args()
    cfg = load(Path(args.config))
    model, threads = resolve_model(cfg), resolve_threads(cfg)
    examples, source = eval_examples(cfg, model)
    examples = take_tokens(examples, args.tokens, most=max(2000, 10 * args.tokens))
    base = score(model, examples, n_ctx=cfg.model.ctx, threads=threads)
    ref = score(model, examples, lora=Path(args.adapter), n_ctx=cfg.model.ctx, threads=threads)
    print(f"{ref.tokens} held-out tokens of {source}; base alone {base.ppl:.4f}; base + adapter {ref.ppl:.4f} "
          f"({model.name}, {model.stat().st_size / 2**20:.1f} MiB)")
    print("| --type | size MiB | perplexity | vs base + adapter | export s |\n|---|---|---|---|---|")
    ad = adapter_io.read(Path(args.adapter))
    notes = []
    with tempfile.TemporaryDirectory() as d:
        for kind in args.types.split(","):
            out = Path(d) / f"{kind}.gguf"
            t0 = time.monotonic()
            res = export(model, ad, out, kind, threads=threads)
            secs = time.monotonic() - t0
            got = score(out, examples, n_ctx=cfg.model.ctx, threads=threads)
            print(f"| {kind} | {res.nbytes / 2**20:.1f} | {got.ppl:.4f} | {100 * (got.ppl / ref.ppl - 1):+.2f}% | "
                  f"{secs:.1f} |", flush=True)
            out.unlink()
            if res.fallbacks and res.fallbacks.count:
                notes.append(f"{kind}: {res.fallbacks.summary()}")
    print("\n".join(notes))


if __name__ == "__main__":
    main()
