"""Draw a run's curves now, while it trains or after: RUN/loss.png from RUN/metrics.jsonl.

    python scripts/plot_run.py examples/sft-extract/runs/sft-extract
"""

import sys
from pathlib import Path

from retrograd.report import plot_run

if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "metrics.jsonl").exists():
        sys.exit("usage: python scripts/plot_run.py RUN_DIR   (a directory holding metrics.jsonl)")
    print(plot_run(Path(sys.argv[1])) or "no metrics to plot yet")
