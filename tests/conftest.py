"""Shared fixtures: tiny synthetic GGUF models (fast, exact) and the real models (integration); a test
that uses a real model is marked `slow`, so the fast tier, `pytest -m "not slow"`, never loads one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from synth import write_tiny  # noqa: E402

from retrograd import models  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
THREADS = min(2, os.cpu_count() or 1)
#: the fixtures that hand out a real model: every test that uses one, directly or through another fixture, is
#: `slow`, so the fast tier (`pytest -m "not slow"`) runs on the synthetic models only
REAL_MODEL_FIXTURES = frozenset({"smollm", "gemma"})


def slow_case(*values: object) -> object:
    """A parametrize case that only the full suite runs (the fast tier keeps the cheapest case)."""
    return pytest.param(*values, marks=pytest.mark.slow)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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


def train_sft(d: Path, records: list[dict], model: Path, *, name: str, ctx: int, steps: int, extra: str = "",
              every_steps: int = 0, timeout: int = 1200) -> Path:
    """Train a small SFT run on `records` through the real CLI (train.jsonl and run.toml in `d`, batch 4,
    learning rate 3e-3) and return `d`; the run's outputs are under d/runs/NAME."""
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "run.toml").write_text(f"""
[model]
path = "{model}"
ctx = {ctx}
[run]
name = "{name}"
[data]
train = "train.jsonl"
{extra}
[training]
max_steps = {steps}
batch_size = 4
learning_rate = 3e-3
[checkpoint]
every_steps = {every_steps}
""")
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "train", str(d / "run.toml")], capture_output=True,
                         text=True, env={**os.environ, "RETRO_THREADS": str(THREADS)}, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return d
