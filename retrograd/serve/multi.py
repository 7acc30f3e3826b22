"""`retrograd-server`: serves the runs of a directory (RUN_ID, RUN_ID@best, ...). Not built yet."""

from __future__ import annotations

import sys


def main() -> int:
    print("retrograd-server: not built yet in this version; `retrograd serve CONFIG.toml` serves one run's adapter "
          "and the base model through the same OpenAI API.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
