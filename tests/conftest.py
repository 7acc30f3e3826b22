"""Shared fixtures: tiny synthetic GGUF models (fast, exact) and the real models (integration)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from synth import write_tiny  # noqa: E402

from retrograd import models  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
THREADS = min(2, os.cpu_count() or 1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """tiny(arch, **kw) -> path of a cached synthetic model."""
    cache: dict = {}

    def make(arch: str = "llama", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            name = f"{arch}-{abs(hash(key)) % 10**8}.gguf"
            cache[key] = write_tiny(tiny_dir / name, arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm() -> Path:
    try:
        return models.default_model_path()
    except models.ModelNotFound as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def gemma() -> Path:
    try:
        return models.gemma_model_path()
    except models.ModelNotFound as exc:
        pytest.fail(str(exc))
