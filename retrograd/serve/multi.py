"""`retrograd-server`: serves the runs of a directory (RUN_ID, RUN_ID@best, ...). Not built yet: it
refuses through the one table of unbuilt features."""

from __future__ import annotations

import sys

from retrograd.errors import reported
from retrograd.features import refuse


def main() -> int:
    return reported(lambda: refuse("retrograd-server"), prefix="retrograd-server")


if __name__ == "__main__":
    sys.exit(main())
