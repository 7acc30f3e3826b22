"""The F16 weight cache ([training].weight_cache_mb) against converting per micro-batch, in one
process: SFT steps alternate between the two (the cache filled or freed between steps, outside
the timing), so the machine's drift hits both sides alike; prints each side's median step and the
median of the paired ratios.

    RETRO_THREADS=2 python scripts/bench_weight_cache.py [--pairs 8] [--cache-mb 1024] [--model M]
"""

from __future__ import annotations

import argparse
import statistics
import time

from retrograd.commands.profile_sft import random_tokens, sft_step
from retrograd.engine import LoraSpec, Trainable
from retrograd.models import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--cache-mb", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro-batch-tokens", type=int, default=256)
    args = ap.parse_args()
    tr = Trainable(args.model or default_model_path(), LoraSpec(16, 32.0), seed=0)
    tokens = random_tokens(tr, args.batch, args.seq)
    sft_step(tr, tokens, args.micro_batch_tokens, 1)                  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    step = 2
    for pair in range(args.pairs):
        for cached in ((False, True) if pair % 2 == 0 else (True, False)):
            used = tr.model.set_weight_cache(args.cache_mb if cached else 0)
            t = time.perf_counter()
            sft_step(tr, tokens, args.micro_batch_tokens, step)
            times[cached].append(time.perf_counter() - t)
            step += 1
            if cached:
                cache_mib = used
    med = statistics.median
    ratios = [a / b for a, b in zip(times[False], times[True])]
    n = args.batch * args.seq
    print(f"SFT step, {args.batch} x {args.seq} tokens, micro-batches of {args.micro_batch_tokens}, {args.pairs} pairs")
    print(f"  converting per micro-batch: {med(times[False]):.2f} s ({n / med(times[False]):.1f} tokens/s)")
    print(f"  weight cache ({cache_mib:.0f} MiB):  {med(times[True]):.2f} s ({n / med(times[True]):.1f} tokens/s)")
    print(f"  speed-up: {med(ratios):.3f}x (median of the pairs: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
