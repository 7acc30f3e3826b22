"""`retrograd judge eval CONFIG --fixtures FILE.jsonl`: how well the configured judge agrees with
people. Each fixture line is a task and a group of attempts a person scored:

    {"id": "milk-1", "task": "Add a note ...", "attempts": [{"transcript": "...", "score": 1.0}, ...]}

(`label`: true/false may stand for score 1/0; `rubric` overrides [agent.judge].rubric for that
line). The judge scores each group as it does during training; per fixture and overall we report
best-pick accuracy (the judge's top attempt is one of the person's best) and Spearman's rank
correlation between the two sets of scores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from retrograd.commands import Subparsers, load_config, one_action
from retrograd.errors import UsageError

if TYPE_CHECKING:
    import numpy as np


def add_parser(sub: Subparsers) -> None:
    t = one_action(sub, "judge", "eval", "measure the judge's agreement with human scores",
                   "`judge eval` scores fixture groups (tasks with attempts a person scored) with the configured "
                   "[agent.judge] and reports, per fixture and overall, best-pick accuracy and Spearman's rank "
                   "correlation with the human scores.",
                   "agreement of the judge with human labels", "a configuration with [agent.judge]")
    t.add_argument("--fixtures", required=True, metavar="FILE.jsonl",
                   help='lines of {"task": ..., "attempts": [{"transcript": ..., "score": ...}, ...]}')
    t.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                   help="a table (text), one JSON object (jsonl), or by terminal (auto)")
    t.set_defaults(run=run)


def load_fixtures(path: Path) -> list[dict]:
    from retrograd.data.formats import DataError

    if not path.is_file():
        raise UsageError(f"--fixtures: {path}: no such file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("task"), str):
            raise DataError(f'{where}: expected an object with "task" (a string) and "attempts"')
        attempts = rec.get("attempts")
        if not isinstance(attempts, list) or len(attempts) < 2:
            raise DataError(f'{where}: "attempts" must be a list of at least two attempts')
        texts, scores = [], []
        for i, a in enumerate(attempts):
            if not isinstance(a, dict) or not isinstance(a.get("transcript"), str):
                raise DataError(f'{where}: attempts[{i}] needs a "transcript" (a string)')
            s = a.get("score", a.get("label"))
            if isinstance(s, bool):
                s = float(s)
            if not isinstance(s, (int, float)):
                raise DataError(f'{where}: attempts[{i}] needs a "score" (a number) or a "label" (true/false)')
            texts.append(a["transcript"])
            scores.append(float(s))
        out.append({"id": str(rec.get("id", n)), "task": rec["task"], "rubric": rec.get("rubric"),
                    "transcripts": texts, "human": scores})
    if not out:
        raise DataError(f"{path}: no fixtures")
    return out


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties given their average rank."""
    import numpy as np

    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x), dtype=float)
    for v in np.unique(x):
        m = x == v
        r[m] = r[m].mean()
    return r


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rho; None when either side has no spread (a constant ranking says nothing)."""
    import numpy as np

    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def best_pick(judge: list[float], human: list[float]) -> bool:
    import numpy as np

    return human[int(np.argmax(judge))] == max(human)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from retrograd.agent.judge import build_judge

    # only [agent.judge] matters: the adapter, data and scenarios of the run need not exist yet
    cfg = load_config(args, reads=("model.path", "agent.judge.local_model"))
    fixtures = load_fixtures(Path(args.fixtures).resolve())
    judge = build_judge(cfg, required=True)
    rows = []
    for f in fixtures:
        if f["rubric"]:
            judge.cfg.rubric, kept = f["rubric"], judge.cfg.rubric
        got = judge.score_texts(f["task"], f["transcripts"])
        if f["rubric"]:
            judge.cfg.rubric = kept
        scores = [s for s, _ in got]
        rows.append({"id": f["id"], "attempts": len(scores), "judge": scores, "human": f["human"],
                     "reasons": [r for _, r in got], "best_pick": best_pick(scores, f["human"]),
                     "spearman": spearman(scores, f["human"])})
    rhos = [r["spearman"] for r in rows if r["spearman"] is not None]
    overall = {"fixtures": len(rows), "best_pick_accuracy": float(np.mean([r["best_pick"] for r in rows])),
               "spearman_mean": float(np.mean(rhos)) if rhos else None,
               "spearman_pooled": spearman([s for r in rows for s in r["judge"]], [s for r in rows for s in r["human"]]),
               "unscored": judge.failures}
    fmt = args.format if args.format != "auto" else ("text" if sys.stdout.isatty() else "jsonl")
    if fmt == "jsonl":
        print(json.dumps({"overall": overall, "fixtures": rows}))
        return 0
    print(f"{'fixture':<24}{'attempts':>9}{'best pick':>11}{'spearman':>10}")
    for r in rows:
        rho = "-" if r["spearman"] is None else f"{r['spearman']:.3f}"
        print(f"{r['id'][:23]:<24}{r['attempts']:>9}{'yes' if r['best_pick'] else 'no':>11}{rho:>10}")
    pooled = overall["spearman_pooled"]
    print(f"overall: best-pick accuracy {overall['best_pick_accuracy']:.3f} over {len(rows)} fixtures; Spearman "
          f"mean {overall['spearman_mean'] if overall['spearman_mean'] is None else round(overall['spearman_mean'], 3)}"
          f", pooled {'-' if pooled is None else round(pooled, 3)}"
          + (f"; {judge.failures} attempts left unscored" if judge.failures else ""))
    return 0
