"""Time of each phase of a GRPO step on the default model, through `retrograd-profile`:
generation (llama.cpp, adapter swapped in from memory), reference log-probs, forward, LM head,
backward, optimizer, adapter swap and the total, as medians over the timed steps.

    python scripts/bench_grpo.py [--config examples/grpo-arith/config.toml] [--steps 4] [--threads N]

The default workload is the grpo-arith example: 4 prompts x 8 completions x up to 24 new tokens,
beta 0.04 — the same work as scripts/trl_grpo_anchor.py runs with TRL's GRPOTrainer.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "grpo-arith" / "config.toml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    from retrograd.commands.profile import main as profile

    return profile([args.config, "--steps", str(args.steps), "--threads", str(args.threads)])


if __name__ == "__main__":
    sys.exit(main())
