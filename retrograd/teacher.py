"""The teacher side of distillation: a second GGUF run forward-only (no adapter, weights kept
quantized like the student's), the two sources of per-position targets — that model online, or a
top-k file written beforehand by `retrograd distill-teacher` — and the student batch that scores
the teacher's tokens."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from retrograd import native
from retrograd.batch import Batch
from retrograd.config import Config
from retrograd.data import tokenizer as tok_mod
from retrograd.data.topk_file import TopkFile, TopkFileError
from retrograd.errors import RetrogradError
from retrograd.models import default_model_path
from retrograd.run_setup import resolve_threads


class DistillError(RetrogradError):
    pass


class Teacher(native.Closeable):
    """A second GGUF for forward passes only (distillation): the k most likely next tokens at the
    rows of a batch. No adapter, no gradients; its weights stay quantized like the student's."""

    def __init__(self, model_path: str | os.PathLike, *, device: str = "auto", threads: int | None = None) -> None:
        self.model_path = Path(model_path)
        self.model = native.Model(self.model_path, device=device, threads=threads)
        self.engine = native.Engine(self.model)

    @property
    def info(self) -> native.ModelInfo:
        return self.model.info

    def topk(self, batch: Batch, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids, logp, _ = self.engine.topk(None, batch, k)
        return ids, logp

    def close(self) -> None:
        self.engine.close()
        self.model.close()


def check_vocab(student_tok, teacher_tok, student: Path, teacher: Path) -> None:
    if student_tok.n_vocab != teacher_tok.n_vocab:
        raise DistillError(f"the teacher {teacher} has {teacher_tok.n_vocab} tokens and the student {student} "
                           f"{student_tok.n_vocab}: distillation needs the same vocabulary")
    if student_tok.vocab_sha256() != teacher_tok.vocab_sha256():
        raise DistillError(f"the teacher {teacher} and the student {student} have vocabularies of the same size "
                           "but different tokens: distillation needs the same vocabulary")


class OnlineTeacher:
    def __init__(self, teacher, k: int) -> None:
        self.teacher, self.k = teacher, k

    def targets(self, group, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        return self.teacher.topk(batch, self.k)


class OfflineTeacher:
    def __init__(self, files: list[TopkFile], k: int) -> None:
        for f in files:
            if f.k < k:
                raise DistillError(f"{f.path}: holds the top {f.k} tokens per position, [distill].k asks for {k}")
        self.files, self.k = files, k

    def targets(self, group, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        ids, lps = [], []
        for ex in group:
            err: TopkFileError | None = None
            for f in self.files:
                try:
                    i, lp = f.get(ex.line, ex.tokens, ex.n_trained)
                    break
                except TopkFileError as exc:
                    err = err or exc
            else:   # no file holds the example: the first file's reason, or that there is no file
                raise err or DistillError("offline distillation has no top-k file to read")
            ids.append(i[:, :self.k])
            lps.append(lp[:, :self.k])
        return np.concatenate(ids), np.concatenate(lps)


def expand(batch: Batch, ids: np.ndarray, with_data: bool) -> Batch:
    """The student's targets: the teacher's k ids at every row, then (optionally) the data tokens."""
    rows = np.repeat(batch.target_rows, ids.shape[1])
    tid = ids.reshape(-1)
    if with_data:
        rows = np.concatenate([rows, batch.target_rows])
        tid = np.concatenate([tid, batch.target_ids])
    return Batch(batch.tokens, batch.positions, batch.seq_ids, rows, tid)


def load_teacher(cfg: Config, student_tok, student_path: Path) -> Teacher:
    """The configured teacher GGUF (default: the embedded default model), vocabulary checked."""
    path = Path(cfg.distill.teacher) if cfg.distill.teacher else default_model_path()
    check_vocab(student_tok, tok_mod.load(str(path)), student_path, path)
    return Teacher(path, device=cfg.model.device, threads=resolve_threads(cfg))
