"""`retrograd-profile --sft`: where the time of one LoRA training step goes, op by op.

The workload is the SFT benchmark's (`scripts/bench_train.py`): random tokens, `batch` sequences of
`seq` tokens, the loss on every token, LoRA on all seven targets, micro-batches of
`micro_batch_tokens`. It reports

- the step time (median of the timed steps, profiling off) and the tokens per second;
- the profile of one more step, profiling on (each node timed on its own, so the sum runs a little
  over the step): milliseconds, share and FLOP/s per phase (forward, backward), ggml op and what
  the node works on (a target's base weight q ... down, lora, attention, other), then the same
  summed by kind;
- the LM head (log-probs and their gradient, outside the graph) with its FLOP/s;
- the effective FLOP/s of the whole step, against ggml's own product in the 16-bit type the frozen
  weights are multiplied in (F16, or BF16 on CPUs with AVX512-BF16), measured in the same run (the
  machine's matmul peak for this kind of work).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from retrograd import native
from retrograd.memory import peak_rss_mib

if TYPE_CHECKING:
    from retrograd.engine import Trainable


def sft_step(tr: Trainable, tokens: np.ndarray, micro_batch_tokens: int, step: int) -> None:
    """One SFT step on `tokens` [batch, seq]: mean next-token loss over every token, AdamW."""
    batch, seq = tokens.shape
    n_targets = batch * (seq - 1)
    per = max(1, micro_batch_tokens // seq)
    for s in range(0, batch, per):
        part = tokens[s:s + per]
        b = native.Batch.next_token(part.reshape(-1), np.repeat(np.arange(len(part)), seq).astype(np.int32))
        tr.accumulate(b, lambda inp: native.LossOutputs(np.full(len(inp.logp), -1.0 / n_targets, np.float32)))
    tr.optimizer_step(lr=2e-4, step=step)


def random_tokens(tr: Trainable, batch: int, seq: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, tr.info.n_vocab, (batch, seq)).astype(np.int32)


def profile_sft(tr: Trainable, *, batch: int, seq: int, micro_batch_tokens: int, steps: int,
                threads: int, matmul: str = "auto") -> dict:
    """Time `steps` steps (after one warm-up), then profile one; everything the report prints. `matmul`
    is the engine's matmul mode: the yardsticks are ggml's product of its 16-bit type and its packed
    kernel, where it has one."""
    peak_type, kernel = native.conv_type(matmul), native.matmul_kernel(matmul)
    tokens = random_tokens(tr, batch, seq)
    sft_step(tr, tokens, micro_batch_tokens, 1)
    times = []
    t_before = tr.engine.timings()
    for i in range(steps):
        t = time.perf_counter()
        sft_step(tr, tokens, micro_batch_tokens, i + 2)
        times.append(time.perf_counter() - t)
    t_after = tr.engine.timings()
    head_s = (t_after.head_ms - t_before.head_ms) / steps / 1000
    tr.engine.set_profiling(True)
    sft_step(tr, tokens, micro_batch_tokens, steps + 2)
    tr.engine.set_profiling(False)
    entries = tr.engine.profile()
    info = tr.info
    n_rows = batch * seq
    head_flops = 4.0 * info.n_embd * info.n_vocab * n_rows       # logits forward, d(hidden) backward
    step_s = statistics.median(times)
    graph_flops = sum(e.flops for e in entries)
    peak = native.matmul_bench(peak_type, 2048, micro_batch_tokens, 2048, threads=threads, reps=5)
    packed = 0.0 if kernel == "ggml" else native.gemm_bench(2048, micro_batch_tokens, 2048, kernel=kernel,
                                                             threads=threads, reps=5)
    return {
        "model": tr.model_path.name, "batch": batch, "seq": seq, "micro_batch_tokens": micro_batch_tokens,
        "rank": tr.spec.rank, "threads": threads, "steps": steps, "step_s": step_s, "step_times": times,
        "tokens_s": n_rows / step_s, "head_s": head_s, "head_flops": head_flops,
        "graph_flops": graph_flops, "effective_flops": (graph_flops + head_flops) / step_s,
        "peak_flops": peak, "peak_type": peak_type, "packed_flops": packed, "packed_kernel": kernel,
        "entries": [e.__dict__ for e in entries],
    }


def print_report(r: dict, top: int = 30) -> None:
    print(f"SFT step on {r['model']}: {r['batch']} x {r['seq']} tokens, micro-batches of {r['micro_batch_tokens']}, "
          f"LoRA r{r['rank']} on 7 targets, {r['threads']} threads")
    print(f"  step {r['step_s']:.2f} s (median of {r['steps']}), {r['tokens_s']:.1f} tokens/s; "
          f"{(r['graph_flops'] + r['head_flops']) / 1e9:.0f} GFLOP a step: {r['effective_flops'] / 1e9:.1f} GFLOP/s "
          f"effective = {100 * r['effective_flops'] / r['peak_flops']:.0f}% of ggml's {r['peak_type'].upper()} product "
          f"on this machine now ({r['peak_flops'] / 1e9:.1f} GFLOP/s, 2048 x {r['micro_batch_tokens']} x 2048)")
    if r.get("packed_flops"):
        print(f"  = {100 * r['effective_flops'] / r['packed_flops']:.0f}% of retrograd's packed product, the fastest "
              f"on this machine ({r['packed_kernel']} kernel, {r['packed_flops'] / 1e9:.1f} GFLOP/s on the same shape, "
              f"operands packed beforehand)")
    if r.get("matmul_precision"):
        print(f"  base weights multiplied in: {r['matmul_precision']}")
    entries = r["entries"]
    total = sum(e["ms"] for e in entries) + r["head_s"] * 1000
    print(f"\n  profiled step, each node on its own ({total / 1000:.2f} s in all):")
    print(f"  {'phase':<9} {'op':<14} {'kind':<10} {'ms':>8} {'share':>6} {'GFLOP/s':>8}")
    rows = [(e["phase"], e["op"], e["kind"], e["ms"], e["flops"]) for e in entries]
    rows.append(("both", "LM head", "head.c", r["head_s"] * 1000, r["head_flops"]))
    rows.sort(key=lambda x: -x[3])
    for phase, op, kind, ms, fl in rows[:top]:
        rate = f"{fl / ms / 1e6:8.1f}" if fl and ms else f"{'':>8}"
        print(f"  {phase:<9} {op:<14} {kind:<10} {ms:8.1f} {100 * ms / total:5.1f}% {rate}")
    if len(rows) > top:
        rest = sum(x[3] for x in rows[top:])
        print(f"  ({len(rows) - top} more entries: {rest:.1f} ms, {100 * rest / total:.1f}%)")
    kinds: dict = defaultdict(lambda: [0.0, 0.0])
    for phase, _op, kind, ms, fl in rows:
        group = "base weights" if kind in ("q", "k", "v", "o", "gate", "up", "down") else kind
        kinds[(phase, group)][0] += ms
        kinds[(phase, group)][1] += fl
    print("\n  by kind:")
    for (phase, group), (ms, fl) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        rate = f"{fl / ms / 1e6:8.1f} GFLOP/s" if fl and ms else ""
        print(f"  {phase:<9} {group:<14} {ms:8.1f} ms {100 * ms / total:5.1f}% {rate}")


def timed_run(model: str, *, seq: int, batch: int, steps: int, micro_batch_tokens: int, rank: int = 16,
              weight_cache_mb: int = 0, matmul: str = "auto") -> dict:
    """The benchmark scripts' side of a comparison, run in a process of its own so its peak RSS is
    its own: load, one warm-up step, `steps` timed steps; medians, per-phase seconds, peak RSS.
    `matmul` is [training].matmul_precision (a route may be forced to compare it)."""
    from retrograd.engine import LoraSpec, Trainable

    t_load = time.perf_counter()
    tr = Trainable(model, LoraSpec(rank, 2.0 * rank), seed=0)
    tr.engine.set_matmul_mode(matmul)
    if weight_cache_mb:
        tr.model.set_weight_cache(weight_cache_mb, matmul)
    load_s = time.perf_counter() - t_load
    tokens = random_tokens(tr, batch, seq)
    sft_step(tr, tokens, micro_batch_tokens, 1)
    t0, times = tr.engine.timings(), []
    for i in range(steps):
        t = time.perf_counter()
        sft_step(tr, tokens, micro_batch_tokens, i + 2)
        times.append(time.perf_counter() - t)
    t1 = tr.engine.timings()
    phases = {k[:-3]: (getattr(t1, k) - getattr(t0, k)) / steps / 1000
              for k in ("forward_ms", "head_ms", "backward_ms", "optimizer_ms", "build_ms", "alloc_ms")}
    med = statistics.median(times)
    return {"tokens_s": batch * seq / med, "step_s": med, "steps": times, "phases_s": phases, "load_s": load_s,
            "rss_mb": peak_rss_mib(), "graph_mib": t1.graph_mib, "matmul": matmul,
            "kernel": native.matmul_kernel(matmul)}



# python -m retrograd.commands.profile_sft MODEL SEQ BATCH STEPS MB [CACHE_MB [MATMUL]]: one JSON line
if __name__ == "__main__":
    import json
    import sys

    m, seq_, batch_, steps_, mb_ = sys.argv[1], *map(int, sys.argv[2:6])
    cache_ = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    matmul_ = sys.argv[7] if len(sys.argv) > 7 else "auto"
    print(json.dumps(timed_run(m, seq=seq_, batch=batch_, steps=steps_, micro_batch_tokens=mb_, weight_cache_mb=cache_,
                               matmul=matmul_)))
