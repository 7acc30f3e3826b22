"""Atomic file output: a reader (or a run killed at any instant) sees either the old file or the
complete new one, never a torn one. Every writer in retrograd that leaves something a user keeps
(adapters, checkpoints, reports, top-k files, the model cache, metrics rewrites) goes through here.

The recipe: write to a temporary name in the same directory, flush and fsync the file, rename it
over the target, then fsync the directory so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (a rename, a new file) durable; a no-op where that is refused."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tmp_name(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, *, keep_partial: bool = False) -> Iterator[BinaryIO]:
    """A binary file handle whose content replaces `path` only when the block ends normally.

    The data goes to FILE.tmp first. On an exception `path` is untouched and the temporary file is
    removed, unless keep_partial (long collections keep what they wrote so far for inspection)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    fh = open(tmp, "wb")
    try:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())
    except BaseException:
        fh.close()
        if not keep_partial:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise
    fh.close()
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path for a writer that opens files itself (a GGUF writer): when the block ends
    normally the file there is made durable and renamed over `path`; otherwise it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Replace `path` with `data` (str is written as UTF-8) atomically."""
    with atomic_open(path) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    with open(src, "rb") as s, atomic_open(dst) as d:
        shutil.copyfileobj(s, d, 1 << 20)
    return Path(dst)


def fsync_tree(path: Path) -> None:
    """fsync every file of a directory (not recursive) and the directory itself."""
    for f in Path(path).iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a complete directory `tmp` to `final`, replacing an existing one. The old one is first
    moved aside, so at every instant either the old or the new directory is at `final` or beside it."""
    old = final.with_name("." + final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
