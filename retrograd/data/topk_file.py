"""The offline distillation file (FILE.topk): a teacher's top-k next-token ids and log-probs for
every trained position of every example of a data file.

Layout (little-endian), version 1:

  b"RGTOPK\\0\\1"  magic (8 bytes), then u32 header length and the header as UTF-8 JSON:
                  format version, teacher (file name, size), vocabulary (size, sha256 of the token
                  texts), k, id dtype (uint16 when the vocabulary fits, else int32), data file
  records         one per example, in the order written:
                  u32 line, u32 n_tokens, u64 token hash, u32 n_positions, u32 0,
                  ids [n_positions, k] (id dtype), log-probs [n_positions, k] float32
  index           n_records x (u32 line, u32 0, u64 record offset)
  footer          u64 index offset, u64 n_records, b"RGTOPEND"

The writer streams records to FILE.topk.tmp (memory stays flat) and renames it once the footer
is written, so a file that exists is complete. The reader maps the file and checks each record
against the example it is asked for (line, length and token hash), so a file written for other
data, or with another tokenizer, is refused with the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from retrograd.errors import RetrogradError
from retrograd.fsutil import atomic_open

MAGIC = b"RGTOPK\x00\x01"
END = b"RGTOPEND"
VERSION = 1
_REC = struct.Struct("<IIQII")
_FOOT = struct.Struct("<QQ8s")
_INDEX = np.dtype([("line", "<u4"), ("pad", "<u4"), ("offset", "<u8")])


class TopkFileError(RetrogradError, ValueError):
    pass


def token_hash(tokens: np.ndarray) -> int:
    return int.from_bytes(hashlib.blake2b(np.asarray(tokens, "<i4").tobytes(), digest_size=8).digest(), "little")


def id_dtype(n_vocab: int) -> np.dtype:
    return np.dtype("<u2") if n_vocab <= 65536 else np.dtype("<i4")


class TopkWriter:
    """with TopkWriter(path, header) as w: w.add(example, ids, logp) ..."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path = Path(path)
        self.header = {"format": "retrograd-topk", "version": VERSION, **header}
        self.k = int(header["k"])
        self.dtype = id_dtype(int(header["n_vocab"]))
        self.header["id_dtype"] = self.dtype.name
        self.index: list[tuple[int, int]] = []
        self.fh: BinaryIO | None = None        # open between __enter__ and __exit__
        self._stack = contextlib.ExitStack()

    def _open_file(self) -> BinaryIO:
        if self.fh is None:
            raise RuntimeError("TopkWriter writes inside its `with` block only")
        return self.fh

    def __enter__(self) -> TopkWriter:
        # an interrupted run leaves FILE.topk.tmp (no footer: readers refuse it) and never FILE.topk
        self.fh = fh = self._stack.enter_context(atomic_open(self.path, keep_partial=True))
        h = json.dumps(self.header, sort_keys=True).encode()
        fh.write(MAGIC + struct.pack("<I", len(h)) + h)
        return self

    def add(self, line: int, tokens: np.ndarray, ids: np.ndarray, logp: np.ndarray) -> None:
        n = ids.shape[0]
        if ids.shape != (n, self.k) or logp.shape != (n, self.k):
            raise ValueError(f"expected [{n}, {self.k}] ids and log-probs, got {ids.shape} and {logp.shape}")
        fh = self._open_file()
        self.index.append((line, fh.tell()))
        fh.write(_REC.pack(line, len(tokens), token_hash(tokens), n, 0))
        fh.write(np.ascontiguousarray(ids, self.dtype).tobytes())
        fh.write(np.ascontiguousarray(logp, "<f4").tobytes())

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            fh = self._open_file()
            at = fh.tell()
            idx = np.zeros(len(self.index), _INDEX)
            if self.index:
                idx["line"], idx["offset"] = zip(*self.index)
            fh.write(idx.tobytes())
            fh.write(_FOOT.pack(at, len(self.index), END))
        self._stack.__exit__(exc_type, exc, tb)


class TopkFile:
    """Read access by data line, checked against the example."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.mm = np.memmap(self.path, np.uint8, mode="r")
        except FileNotFoundError:
            raise TopkFileError(f"{self.path}: no such top-k file (write it with `retrograd distill-teacher`)") from None
        except (OSError, ValueError) as exc:
            raise TopkFileError(f"{self.path}: cannot read: {exc}") from None
        raw = self.mm
        if len(raw) < 12 + _FOOT.size or bytes(raw[:8]) != MAGIC:
            raise TopkFileError(f"{self.path}: not a retrograd top-k file (bad magic)")
        (hlen,) = struct.unpack("<I", bytes(raw[8:12]))
        try:
            self.header = json.loads(bytes(raw[12:12 + hlen]).decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise TopkFileError(f"{self.path}: corrupt header") from None
        if self.header.get("version") != VERSION:
            raise TopkFileError(f"{self.path}: format version {self.header.get('version')}, this retrograd reads {VERSION}")
        at, n, end = _FOOT.unpack(bytes(raw[len(raw) - _FOOT.size:]))
        if end != END or at + n * _INDEX.itemsize + _FOOT.size != len(raw):
            raise TopkFileError(f"{self.path}: truncated or corrupt (no valid index at the end)")
        idx = np.frombuffer(raw, _INDEX, count=n, offset=at)
        self.offsets = {int(line): int(off) for line, off in zip(idx["line"], idx["offset"])}
        self.k = int(self.header["k"])
        self.dtype = np.dtype(self.header["id_dtype"])

    def __len__(self) -> int:
        return len(self.offsets)

    def check_vocab(self, n_vocab: int, vocab_sha256: str, student: str) -> None:
        h = self.header
        if h.get("n_vocab") != n_vocab or h.get("vocab_sha256") != vocab_sha256:
            raise TopkFileError(
                f"{self.path}: written with the vocabulary of {h.get('teacher')} ({h.get('n_vocab')} tokens), which "
                f"differs from the student {student}'s ({n_vocab} tokens"
                + (", same size but different tokens)" if h.get("n_vocab") == n_vocab else ")"))

    def get(self, line: int, tokens: np.ndarray, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """ids [n, k] int32 and log-probs [n, k] float32 for the example at data line `line`."""
        off = self.offsets.get(int(line))
        data = self.header.get("data", "the data")
        if off is None:
            raise TopkFileError(f"{self.path}: no record for line {line} of the data; it was written for "
                                f"{data} ({len(self)} examples). Rewrite it with `retrograd distill-teacher`")
        rl, nt, hsh, n, _ = _REC.unpack(bytes(self.mm[off:off + _REC.size]))
        if nt != len(tokens) or hsh != token_hash(tokens) or n != n_positions:
            raise TopkFileError(f"{self.path}: the record for line {line} does not match the example (the data, "
                                f"max_length or tokenizer changed since it was written for {data}). "
                                "Rewrite it with `retrograd distill-teacher`")
        k = self.k
        start = off + _REC.size
        ids = np.frombuffer(self.mm, self.dtype, count=n * k, offset=start).reshape(n, k).astype(np.int32)
        start += n * k * self.dtype.itemsize
        logp = np.frombuffer(self.mm, "<f4", count=n * k, offset=start).reshape(n, k).astype(np.float32)
        return ids, logp
