"""Training throughput and memory, side by side with PyTorch + PEFT on the same GGUF.

Runs LoRA training steps (rank 16, all seven targets, 4 sequences x 256 tokens, loss on every
token) on the default model with retrograd, and in the same run a PyTorch + PEFT baseline script
(the tool a CPU user would otherwise pick: it dequantizes the GGUF to fp32 and trains the same
LoRA; called as `PYTHON BASELINE MODEL SEQ BATCH STEPS`, printing "... N tokens/s ... peak_rss M MiB"),
then prints both and the ratio. Each side runs in its own process, so peak RSS is its own.

The machines this runs on drift in speed by a third within minutes, so with `--rounds N` the two
sides alternate N times (ours, theirs, ours, ...) and the report gives each side's median and the
median of the per-round ratios.

With `--weight-cache-mb N` each round also runs retrograd with `[training].weight_cache_mb = N`
(F16 copies of the base weights kept between micro-batches) and reports it beside the others.
`--matmul-precision R` runs retrograd with `[training].matmul_precision = R`: a route forced by its
kernel's name (e.g. avx2-f16, ggml-f16) measures it beside the one auto picks, in separate runs.

    python scripts/bench_train.py [--model M] [--steps 5] [--rounds 3] [--baseline torch_lora_sft.py]
                                  [--torch-python .venv-torch/bin/python] [--weight-cache-mb 1024]
                                  [--matmul-precision auto]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the embedded default model)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two sides this many times (default 1)")
    ap.add_argument("--micro-batch-tokens", type=int, default=256)
    ap.add_argument("--torch-python", default=str(ROOT / ".venv-torch" / "bin" / "python"),
                    help="a Python with torch, transformers, peft and gguf")
    ap.add_argument("--baseline", default=os.environ.get("RETRO_TORCH_BASELINE", ""),
                    help="the PyTorch + PEFT baseline script (default: $RETRO_TORCH_BASELINE; without it the "
                         "comparison is skipped)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--weight-cache-mb", type=int, default=0,
                    help="also run retrograd with this F16 weight cache each round (0: not)")
    from retrograd.sections import MATMUL_PRECISIONS

    ap.add_argument("--matmul-precision", default="auto", choices=MATMUL_PRECISIONS,
                    help="retrograd's [training].matmul_precision (default auto; a kernel's name forces that route)")
    args = ap.parse_args()
    from retrograd.models import default_model_path

    model = args.model or str(default_model_path())
    env = {**os.environ, "RETRO_THREADS": str(args.threads), "THREADS": str(args.threads)}
    bench = Path(args.baseline) if args.baseline else None
    skip = None
    if bench is None or not bench.is_file() or not Path(args.torch_python).exists():
        skip = "--baseline not given" if bench is None else (
            f"{bench} missing" if not bench.is_file() else f"{args.torch_python} missing")
    ours_runs, theirs_runs, cached_runs = [], [], []

    def retrograd(cache_mb: int) -> dict:
        out = subprocess.run([sys.executable, "-m", "retrograd.commands.profile_sft", model, str(args.seq),
                              str(args.batch), str(args.steps), str(args.micro_batch_tokens), str(cache_mb),
                              args.matmul_precision],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            sys.exit(f"retrograd run failed:\n{out.stderr}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    for r in range(args.rounds):
        for cache_mb, runs, label in ((0, ours_runs, "retrograd  "), (args.weight_cache_mb, cached_runs, "+ cache    ")):
            if runs is cached_runs and not cache_mb:
                continue
            ours = retrograd(cache_mb)
            runs.append(ours)
            print(f"round {r + 1}: {label}{ours['tokens_s']:7.1f} tokens/s  step {ours['step_s']:.2f} s "
                  f"(median of {args.steps})  peak RSS {ours['rss_mb']:.0f} MiB  ({ours['matmul']}: kernel "
                  f"{ours['kernel']})", flush=True)
            print("                     per step: " + ", ".join(f"{k} {v:.2f} s" for k, v in ours["phases_s"].items()))
        if skip:
            continue
        out = subprocess.run([args.torch_python, str(bench), model, str(args.seq), str(args.batch), str(args.steps)],
                             capture_output=True, text=True, env=env)
        m = re.search(r"([\d.]+) tokens/s.*peak_rss (\d+) MiB", out.stdout)
        if out.returncode != 0 or not m:
            print(f"torch+peft  failed:\n{out.stderr[-2000:]}")
            skip = "failed"
            continue
        theirs_runs.append({"tokens_s": float(m.group(1)), "rss_mb": float(m.group(2))})
        print(f"round {r + 1}: torch+peft  {theirs_runs[-1]['tokens_s']:7.1f} tokens/s  peak RSS "
              f"{theirs_runs[-1]['rss_mb']:.0f} MiB", flush=True)
    med = statistics.median
    ours_tps, ours_rss = med(o["tokens_s"] for o in ours_runs), max(o["rss_mb"] for o in ours_runs)
    print(f"retrograd   {ours_tps:7.1f} tokens/s (median of {len(ours_runs)} runs)  peak RSS {ours_rss:.0f} MiB")
    if cached_runs:
        gain = [c["tokens_s"] / o["tokens_s"] for c, o in zip(cached_runs, ours_runs)]
        print(f"+ cache     {med(c['tokens_s'] for c in cached_runs):7.1f} tokens/s  peak RSS "
              f"{max(c['rss_mb'] for c in cached_runs):.0f} MiB  ({med(gain):.2f}x without: "
              f"{', '.join(f'{x:.2f}' for x in gain)})")
    if skip:
        print(f"torch+peft  skipped: {skip}")
        return
    tps, rss = med(t["tokens_s"] for t in theirs_runs), max(t["rss_mb"] for t in theirs_runs)
    ratios = [o["tokens_s"] / t["tokens_s"] for o, t in zip(ours_runs, theirs_runs)]
    print(f"torch+peft  {tps:7.1f} tokens/s (median of {len(theirs_runs)} runs)  peak RSS {rss:.0f} MiB")
    print(f"ratio       {med(ratios):.2f}x the tokens/s (median of the rounds' ratios: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}) at {ours_rss / rss:.2f}x the memory")


if __name__ == "__main__":
    main()
