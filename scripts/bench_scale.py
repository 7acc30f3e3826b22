"""Peak memory and speed of LoRA training by model size, retrograd beside PyTorch + PEFT.

For each shape, the synthetic Q4_K_M model of `scripts/make_synthetic_model.py` (written on first
use) trains LoRA r16 on all seven targets, one sequence of 256 tokens a step: one warm-up step,
then `--steps` timed ones, each side in a process of its own so each peak RSS is its own. The
PyTorch side (the baseline script, which dequantizes the GGUF to fp32) runs only where twice its
fp32 weights fit in 80% of this machine's memory (transformers' GGUF loader holds the dequantized
numpy arrays and the torch tensors at once), and the table says so where they do not.

    python scripts/bench_scale.py [--shapes qwen2-0.5b,qwen2-1.5b,llama-3b,llama-7b] [--steps 2]
                                  [--threads N] [--baseline torch_lora_sft.py] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from make_synthetic_model import SHAPES, write  # noqa: E402


def n_params(shape: str) -> int:
    arch, e, nl, nh, nkv, ff, nv = SHAPES[shape]
    hd = e // nh
    layer = e * nh * hd * 2 + e * nkv * hd * 2 + 3 * e * ff
    return nl * layer + 2 * nv * e


def mem_total_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 1024
    return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2-0.5b,qwen2-1.5b,llama-3b,llama-7b")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--baseline", default=os.environ.get("RETRO_TORCH_BASELINE", ""),
                    help="the PyTorch + PEFT baseline script (without it only retrograd runs)")
    ap.add_argument("--torch-python", default=str(ROOT / ".venv-torch" / "bin" / "python"))
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    env = {**os.environ, "RETRO_THREADS": str(args.threads), "THREADS": str(args.threads)}
    out_dir = Path.home() / ".cache" / "retrograd" / "synthetic"
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = 0.8 * mem_total_mib()
    rows = []
    print(f"{'model':<12} {'params':>7} {'file':>8} | {'retrograd':>22} | {'torch + PEFT (fp32)':>30}")
    for shape in args.shapes.split(","):
        path = write(shape, out_dir)
        p = n_params(shape)
        row = {"shape": shape, "params_b": p / 1e9, "file_mib": path.stat().st_size / 2**20}
        r = subprocess.run([sys.executable, "-m", "retrograd.commands.profile_sft", str(path), str(args.seq), "1",
                            str(args.steps), str(args.seq)], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            row["ours_error"] = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        else:
            row["ours"] = json.loads(r.stdout.strip().splitlines()[-1])
        fp32_mib = p * 4 / 2**20
        if not args.baseline or not Path(args.baseline).is_file():
            row["torch"] = "skipped: no --baseline"
        elif 2 * fp32_mib > budget:
            row["torch"] = (f"does not fit: loading needs ~{2 * fp32_mib / 1024:.0f} GiB (fp32 weights "
                            f"{fp32_mib / 1024:.1f} GiB, twice while loading) of {budget / 1024:.1f}")
        else:
            t = subprocess.run([args.torch_python, args.baseline, str(path), str(args.seq), "1", str(args.steps)],
                               capture_output=True, text=True, env=env)
            m = re.search(r"([\d.]+) tokens/s.*peak_rss (\d+) MiB", t.stdout)
            row["torch"] = ({"tokens_s": float(m.group(1)), "rss_mb": float(m.group(2))} if m and t.returncode == 0
                            else "failed: " + (t.stderr.strip().splitlines() or ["?"])[-1][:200])
        rows.append(row)
        ours = row.get("ours")
        left = (f"{ours['tokens_s']:6.1f} tok/s {ours['rss_mb']:7.0f} MiB" if ours else row["ours_error"][:22])
        tr = row["torch"]
        right = f"{tr['tokens_s']:6.1f} tok/s {tr['rss_mb']:7.0f} MiB" if isinstance(tr, dict) else tr
        print(f"{shape:<12} {p / 1e9:6.2f}B {row['file_mib']:6.0f}Mi | {left:>22} | {right}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
