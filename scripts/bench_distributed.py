"""Data-parallel SFT on a local Ray cluster against one process, in the same run, and a model of
the speed-up on N machines from the measured compute and communication times.

    .venv/bin/python scripts/bench_distributed.py [--steps 4] [--batch 16] [--micro-batch-tokens 256]

Each setting is `retrograd-profile CONFIG --steps N --json` on the SFT example's data with the
default model (the first step warms up and is not counted): one process with 1 and with 2 threads,
and Ray with 1 worker and with 2 workers of 1 thread each. Printed: median step time, tokens/s,
the slowest worker's gradient time and the communication time (gathering the workers' gradients
and sending the summed one back), and the speed-up of 2 workers over 1.

The model: a step on N workers takes compute(1) / N (the micro-batches split evenly) plus the
driver's fixed work (its AdamW step, the data) plus communication that grows with N (each worker's
gradient passes through the driver: N transfers of the adapter's gradient each way). Fitted from
the 1- and 2-worker runs; on real machines the network's bandwidth replaces the object store's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "sft-extract" / "train.jsonl"


def config(d: Path, name: str, batch: int, mbt: int, threads: int, workers: int) -> Path:
    text = f"""
[model]
ctx = 512
[lora]
rank = 16
alpha = 32.0
[run]
name = "{name}"
[data]
train = "{DATA}"
max_length = 256
[training]
max_steps = 100
batch_size = {batch}
micro_batch_tokens = {mbt}
learning_rate = 1e-3
threads = {threads}
[evaluation]
every_steps = 0
"""
    if workers:
        text += f'[distributed]\nbackend = "ray"\nworkers = {workers}\nthreads_per_worker = 1\ncheck_every = 0\n'
    path = d / f"{name}.toml"
    path.write_text(text)
    return path


def profile(cfg: Path, steps: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "retrograd.commands.profile", str(cfg), "--steps", str(steps),
                          "--threads", str(threads), "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{cfg.name}: retrograd-profile failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)["median"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per setting (after one warm-up step)")
    ap.add_argument("--batch", type=int, default=16, help="examples per step")
    ap.add_argument("--micro-batch-tokens", type=int, default=256, help="tokens per micro-batch")
    ap.add_argument("--bandwidth-gbit", type=float, default=1.0,
                    help="network bandwidth for the model of N machines (default 1 Gbit/s)")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON too")
    args = ap.parse_args()
    settings = [("one process, 1 thread", 1, 0), ("one process, 2 threads", 2, 0),
                ("Ray, 1 worker x 1 thread", 1, 1), ("Ray, 2 workers x 1 thread", 1, 2)]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        for i, (label, threads, workers) in enumerate(settings):
            cfg = config(Path(tmp), f"s{i}", args.batch, args.micro_batch_tokens, threads, workers)
            rows[label] = profile(cfg, args.steps, threads)
            print(f"measured: {label}", file=sys.stderr)
    print(f"SFT on the default model, {args.batch} examples a step, micro-batches of {args.micro_batch_tokens} "
          f"tokens, median of {args.steps} steps")
    print(f"{'setting':<28} {'step s':>7} {'tok/s':>7} {'slowest worker s':>17} {'comm s':>7} {'driver MiB':>11} "
          f"{'per worker MiB':>15}")
    for label, m in rows.items():
        tps = m["tokens"] / m["total"] if m["total"] else 0.0
        workers = "/".join(f"{v:.0f}" for k, v in m.items() if k.endswith("_peak_mib")) or "-"
        print(f"{label:<28} {m['total']:7.2f} {tps:7.1f} {m.get('dist_compute_s', 0):17.2f} "
              f"{m.get('dist_comm_s', 0):7.3f} {m['mem forward+head+backward']:11.0f} {workers:>15}")
    one, two = rows["Ray, 1 worker x 1 thread"], rows["Ray, 2 workers x 1 thread"]
    print(f"speed-up of 2 workers over 1: {one['total'] / two['total']:.2f}x; "
          f"over one process with 2 threads: {rows['one process, 2 threads']['total'] / two['total']:.2f}x")
    # the model: total(N) = compute1 / N + fixed + comm1 * N (comm per worker, measured at 1 and 2)
    compute1 = one["dist_compute_s"]
    comm_per_worker = max(two["dist_comm_s"] / 2, one["dist_comm_s"])
    fixed = max(0.0, one["total"] - compute1 - one["dist_comm_s"])
    print(f"model: step(N) = {compute1:.2f} s / N + {fixed:.2f} s driver + {comm_per_worker:.3f} s x N communication")
    # across machines each worker's gradient crosses the driver's link twice (there and back)
    net = 2 * two["dist_grad_mb"] * 8 / (args.bandwidth_gbit * 1000)
    print(f"  (on a {args.bandwidth_gbit:g} Gbit/s network: {two['dist_grad_mb']:.1f} MB of gradient each way, "
          f"{net:.2f} s x N communication)")
    print(f"  {'N':>3} {'this machine s':>15} {'speed-up':>9} {'network s':>10} {'speed-up':>9}")
    for n in (1, 2, 4, 8, 16):
        t = compute1 / n + fixed + comm_per_worker * n
        tn = compute1 / n + fixed + net * n
        print(f"  {n:>3} {t:15.2f} {one['total'] / t:8.2f}x {tn:10.2f} {one['total'] / tn:8.2f}x")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
