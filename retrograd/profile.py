"""`retrograd-profile`: time and memory per phase of a GRPO workload. Not built yet (it needs GRPO);
scripts/bench_train.py measures the training phases of SFT-style steps today."""

from __future__ import annotations

import sys


def main() -> int:
    print("retrograd-profile: not built yet in this version (it profiles GRPO, which is not built yet); "
          "python scripts/bench_train.py prints time per training phase and peak memory.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
