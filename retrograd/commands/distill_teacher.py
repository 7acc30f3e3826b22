"""`retrograd distill-teacher CONFIG [--data FILE] [--out FILE.topk] [--k N] [--teacher T]`: run the
teacher once over the data and write its top-k next tokens per trained position, so distillation
can train from the file without loading the teacher (retrograd.data.topk_file has the format).
The teacher is [distill].teacher (or --teacher); --model is the common flag, the student's
[model].path, and a teacher that is the student's own file is refused."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from retrograd.commands import Subparsers, common_flags, load_config, positive
from retrograd.errors import UsageError
from retrograd.models import ModelNotFound, default_model_path
from retrograd.report import Progress
from retrograd.run_setup import config_label, resolve_model, resolve_threads


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("distill-teacher", help="write the teacher's top-k predictions for offline distillation",
                       description="Run the teacher over the data once and write its top-k next-token ids and "
                                   "log-probs for every trained position to FILE.topk (written as FILE.topk.tmp and "
                                   "renamed when complete). Set [distill].teacher_file to it and training never loads "
                                   "the teacher. The teacher is --teacher, else [distill].teacher, else the embedded "
                                   "default model; --model, as for every command, replaces the student's [model].path. "
                                   "A teacher that is the student's own file is refused.")
    common_flags(p)
    p.add_argument("--teacher", metavar="T", help="use this GGUF as the teacher instead of [distill].teacher")
    p.add_argument("--data", metavar="FILE", help="data to score (default [data].train)")
    p.add_argument("--out", metavar="FILE.topk",
                   help="output (default [distill].teacher_file, else the data file's name with .topk)")
    p.add_argument("--k", type=int, metavar="N", help="tokens per position (default [distill].k)")
    p.add_argument("--ctx", type=int, metavar="N", help="longest sequence (overrides [model].ctx)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from retrograd.data import chat as chat_mod
    from retrograd.data import tokenizer as tok_mod
    from retrograd.data.batching import pack, to_batch
    from retrograd.data.formats import load_examples
    from retrograd.data.topk_file import TopkWriter
    from retrograd.teacher import Teacher

    # it writes the top-k files; with --teacher the configured teacher need not exist
    skip = ("distill.teacher_file", "distill.eval_teacher_file") + (("distill.teacher",) if args.teacher else ())
    cfg = load_config(args, skip=skip)
    d = cfg.distill
    if args.teacher:
        teacher_path = Path(args.teacher).resolve()
    else:
        teacher_path = Path(d.teacher) if d.teacher else default_model_path()
    if not teacher_path.is_file():
        raise UsageError(f"teacher model not found: {teacher_path}")
    try:
        student = resolve_model(cfg)
    except ModelNotFound:             # the default student is not in the cache: it is not the teacher either
        student = None
    if student is not None and _same_file(teacher_path, student):
        named = "--teacher" if args.teacher else ("[distill].teacher" if d.teacher else "the default model")
        student_named = "--model" if args.model else ("[model].path" if cfg.model.path else "the default model")
        raise UsageError(f"{config_label(cfg)}: the teacher {teacher_path} ({named}) is the student's model "
                         f"({student_named}): a model distilled into itself learns nothing; name another GGUF as "
                         "the teacher ([distill].teacher or --teacher)")
    data = Path(args.data).resolve() if args.data else (Path(cfg.data.train) if cfg.data.train else None)
    if data is None:
        raise UsageError(f"{config_label(cfg)}: no data: pass --data or set [data].train")
    out = Path(args.out).resolve() if args.out else (Path(d.teacher_file) if d.teacher_file and not args.data
                                                      else data.with_suffix(".topk"))
    positive(args, "k")
    k = args.k if args.k is not None else d.k
    tok = tok_mod.load(str(teacher_path))
    chat = chat_mod.format_for(tok, cfg.model.chat_template)
    max_length = min(cfg.data.max_length, cfg.model.ctx)
    examples, report = load_examples(data, tok, chat, fmt=cfg.data.format, max_length=max_length,
                                     skip_bad=cfg.data.skip_bad_lines)
    teacher = Teacher(teacher_path, device=cfg.model.device, threads=resolve_threads(cfg))
    header = {"teacher": teacher_path.name, "teacher_bytes": teacher_path.stat().st_size,
              "n_vocab": tok.n_vocab, "vocab_sha256": tok.vocab_sha256(), "k": k, "data": str(data),
              "max_length": max_length, "data_format": report.format}
    progress = Progress(len(examples), label="examples")
    progress.note(f"{teacher_path.name}: top-{k} of {len(examples)} examples from {data} ({report.summary()})")
    done = positions = 0
    with TopkWriter(out, header) as w:
        for group in pack(examples, cfg.training.micro_batch_tokens, True):
            batch, owner = to_batch(group)
            ids, lp = teacher.topk(batch, k)
            for s, ex in enumerate(group):
                sel = owner == s
                w.add(ex.line, ex.tokens, ids[sel], lp[sel])
            done += len(group)
            positions += batch.n_targets
            progress.update(done, int(batch.n_tokens), {})
    teacher.close()
    size = out.stat().st_size
    print(f"wrote {out}: {done} examples, {positions} positions x top-{k} ({size / 2**20:.1f} MiB)")
    return 0


def _same_file(a: Path, b: Path) -> bool:
    """One file under two names (a link, a relative path) counts as the same."""
    try:
        return os.path.samefile(a, b)
    except OSError:                   # the student does not exist (yet): compare the names
        return a.resolve() == b.resolve()
