"""Peak memory and speed of one SFT step on one long sequence, 512 to 8192 tokens, with and
without activation checkpointing ([training].activation_checkpointing), on the default model,
with tiled attention (the default) and, when asked, the dense score matrices it replaced.

    .venv/bin/python scripts/bench_long_context.py [--lengths 512 1024 2048 4096 8192] [--limit-gib 20]
                                                   [--attention tiled dense] [--checkpointing off on]

Each (length, setting) runs in a fresh process (so its peak resident memory is its own) under an
address-space limit: a setting that needs more memory than the limit fails its allocation and is
reported as not fitting, instead of driving the machine into swap or the OOM killer. One timed
step (LoRA r16 on the seven targets, loss on every token) after a warm-up step for lengths up to
2048; the longer ones are timed on their first step (minutes each).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def one(length: int, recompute: bool, attention: str, threads: int, warmup: bool) -> dict:
    import numpy as np

    from retrograd import native
    from retrograd.engine import LoraSpec, Trainable
    from retrograd.memory import peak_rss_mib
    from retrograd.models import default_model_path

    tr = Trainable(default_model_path(), LoraSpec(16, 32.0), threads=threads, seed=0)
    tr.engine.set_recompute(recompute)
    tr.engine.set_attention(attention)
    toks = np.random.default_rng(0).integers(100, 40000, length).astype(np.int32)
    batch = native.Batch.next_token(toks)
    coeff = np.full(batch.n_targets, -1.0 / batch.n_targets, np.float32)

    def step(k: int) -> float:
        t0 = time.perf_counter()
        tr.lora.zero(native.SLOT_GRAD)
        tr.accumulate(batch, lambda inp: native.LossOutputs(coeff))
        tr.optimizer_step(lr=1e-4, step=k, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_clip=1.0)
        return time.perf_counter() - t0

    if warmup:
        step(1)
    seconds = step(2)
    return {"length": length, "checkpointing": recompute, "attention": attention, "seconds": seconds,
            "tok_s": length / seconds, "peak_mib": peak_rss_mib(), "graph_mib": tr.engine.timings().graph_mib}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("RETRO_THREADS", "0")) or os.cpu_count())
    ap.add_argument("--limit-gib", type=float, default=20.0, help="address-space limit of each run (default 20)")
    ap.add_argument("--attention", nargs="+", choices=["tiled", "dense"], default=["tiled"],
                    help="attention paths to run (default: tiled; dense is the [T, T] path it replaced)")
    ap.add_argument("--checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"],
                    help="activation checkpointing settings to run (default both)")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)     # LENGTH 0|1 ATTENTION: the child process
    args = ap.parse_args()
    if args.one:
        length, recompute = int(args.one[0]), args.one[1] == "1"
        print(json.dumps(one(length, recompute, args.one[2], args.threads, warmup=length <= 2048)))
        return 0
    limit = int(args.limit_gib * (1 << 30))

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    rows = []
    print(f"one SFT step on one sequence, default model, LoRA r16 x 7 targets, {args.threads} threads, "
          f"{args.limit_gib:g} GiB address-space limit per run")
    print(f"{'tokens':>7} {'attention':>9} {'checkpointing':>14} {'step s':>8} {'tok/s':>7} {'peak MiB':>9} "
          f"{'graph MiB':>10}")
    for length in args.lengths:
        for attention in args.attention:
            for recompute in [c == "on" for c in args.checkpointing]:
                out = subprocess.run([sys.executable, __file__, "--one", str(length), "1" if recompute else "0",
                                      attention, "--threads", str(args.threads)],
                                     capture_output=True, text=True, preexec_fn=limited)
                mode = "on" if recompute else "off"
                if out.returncode != 0:
                    why = (out.stderr.strip().splitlines() or ["failed"])[-1][:90]
                    print(f"{length:>7} {attention:>9} {mode:>14}   does not fit in {args.limit_gib:g} GiB ({why})",
                          flush=True)
                    rows.append({"length": length, "attention": attention, "checkpointing": recompute, "error": why})
                    continue
                r = json.loads(out.stdout)
                rows.append(r)
                print(f"{length:>7} {attention:>9} {mode:>14} {r['seconds']:8.2f} {r['tok_s']:7.1f} "
                      f"{r['peak_mib']:9.0f} {r['graph_mib']:10.0f}", flush=True)
    # near-linear time: seconds a token at each length against the shortest, per setting
    for attention in args.attention:
        for recompute in (False, True):
            done = {r["length"]: r["seconds"] / r["length"] for r in rows
                    if "error" not in r and r["attention"] == attention and r["checkpointing"] == recompute}
            if len(done) > 1:
                base = done[min(done)]
                ratios = ", ".join(f"{n}: {t / base:.2f}x" for n, t in sorted(done.items()))
                print(f"time a token against {min(done)} tokens ({attention}, checkpointing "
                      f"{'on' if recompute else 'off'}): {ratios}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
