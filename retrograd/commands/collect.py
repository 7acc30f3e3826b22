"""`retrograd collect CONFIG --out FILE.jsonl ...`: roll out the scenarios of an agent_grpo
configuration and keep the successful traces as `tools` records for SFT (or, with --pairs, one
preference pair per scenario). Trains nothing. The file is written as FILE.jsonl.tmp, one scenario
at a time, and renamed when complete; an interrupted run leaves the .tmp with what it kept.

Filters, in order: truncated traces (no final answer), traces with a malformed tool call, traces
the environment did not verify (with --require-verified, the default when every scenario has a
verify), traces below --min-reward. Then per scenario the --keep best: highest reward, shortest
at equal reward, no exact duplicate. Every drop is counted by cause.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from retrograd.commands import Subparsers, load_config, positive
from retrograd.config import Config
from retrograd.errors import ConfigError, UsageError
from retrograd.fsutil import atomic_open, atomic_write
from retrograd.report import Progress
from retrograd.run_setup import config_label, resolve_model, resolve_threads

if TYPE_CHECKING:
    from retrograd.agent.rollout import Trajectory
    from retrograd.agent.tools import ToolBox


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("collect", help="roll out agentic scenarios and keep the successful traces for SFT",
                       description="Roll out the scenarios of an agent_grpo configuration ([agent].scenarios, its "
                                   "tool servers, [model] with [lora].init_adapter, and [agent.judge]) and write the "
                                   "successful traces as `tools` records that `train` accepts for SFT, or with "
                                   "--pairs one preference pair per scenario. Trains nothing. Traces that were "
                                   "truncated, hold a malformed call or fail a filter are counted by cause. The file "
                                   "is written as FILE.jsonl.tmp and renamed when complete; an interrupted run "
                                   "leaves the .tmp with what it kept.")
    p.add_argument("config", help="an agent_grpo configuration (TOML)")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="where the traces (or pairs) go")
    p.add_argument("--k", type=int, metavar="N", help="attempts per scenario (default [grpo].group_size); with 1, "
                                                      "the environment must grade every scenario")
    p.add_argument("--keep", type=int, metavar="N", help="traces kept per scenario (default 1): the highest reward, "
                                                         "the shortest at equal reward, no exact duplicate")
    p.add_argument("--min-reward", type=float, metavar="R", help="drop traces below this total reward (default: none)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--require-verified", dest="require_verified", action="store_true", default=None,
                   help="keep only traces the environment verified (default when every scenario has a verify)")
    g.add_argument("--allow-unverified", dest="require_verified", action="store_false",
                   help="also keep traces no verify passed (judged ones)")
    p.add_argument("--raw", action="store_true", help="write assistant turns verbatim instead of structured (only a "
                                                      "student of the generator's family can train on them)")
    p.add_argument("--limit", type=int, metavar="N", help="collect from the first N scenarios (default: all)")
    p.add_argument("--scenarios", metavar="FILE.jsonl", help="roll out these scenarios instead of [agent].scenarios "
                                                             "(e.g. the held-out ones, to measure a pass rate)")
    p.add_argument("--seed", type=int, metavar="N", help="scenario i is rolled out from seed + i x k "
                                                         "(default [agent].seed)")
    p.add_argument("--report", metavar="FILE.json", help="per-scenario attempts, passes, kept traces and pass rate")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="M", help="use this GGUF instead of [model].path")
    g.add_argument("--api", action="store_true", help="generate with the [agent.collect_api] endpoint: no model is "
                                                      "loaded, only the environment grades, turns are structured")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), help="as for train")
    p.add_argument("--pairs", action="store_true", help="one preference pair per scenario: the best passing trace "
                                                        "as chosen, the worst complete one as rejected (no --keep)")
    p.add_argument("--min-gap", type=float, metavar="G", help="with --pairs: skip a scenario whose two rewards differ "
                                                              "by less (default 0.5)")
    p.set_defaults(run=run)


def _settings(args: argparse.Namespace, cfg: Config, scenarios: list) -> dict:
    k = args.k if args.k is not None else cfg.grpo.group_size
    every_verified = all(s.verify is not None for s in scenarios)
    require = every_verified if args.require_verified is None else args.require_verified
    if args.pairs and args.keep is not None:
        raise UsageError("--pairs writes one pair per scenario and takes no --keep")
    if k == 1 and not every_verified:
        missing = next(s for s in scenarios if s.verify is None)
        raise UsageError(f"--k 1: the environment must grade every scenario, and {missing.source}:{missing.line} "
                         f"({missing.id}) has no verify (a judge needs a group to compare)")
    return {"k": k, "keep": args.keep or 1, "require": require,
            "seed": args.seed if args.seed is not None else cfg.agent.seed}


def _filter(t: Trajectory, require: bool, min_reward: float | None) -> str | None:
    """Why a trace is dropped, or None to keep it."""
    if t.finish != "answer":
        return "truncated" if t.finish != "max_turns" else "max_turns"
    if t.causes.get("malformed_call") or t.causes.get("unknown_tool"):
        return "malformed_call"
    if require and not t.verified:
        return "not_verified"
    if min_reward is not None and t.reward < min_reward:
        return "below_min_reward"
    return None


def _length(t: Trajectory) -> int:
    return len(json.dumps(t.messages))


def best_traces(trajs: list[Trajectory], keep: int, raw: bool, counts: Counter) -> list[Trajectory]:
    """The highest reward first, the shortest at equal reward, no exact duplicate."""
    from retrograd.agent.rollout import messages_of

    out: list[Trajectory] = []
    seen: set[str] = set()
    for t in sorted(trajs, key=lambda t: (-t.reward, _length(t))):
        key = json.dumps(messages_of(t, raw), sort_keys=True)
        if key in seen:
            counts["duplicate"] += 1
            continue
        seen.add(key)
        if len(out) < keep:
            out.append(t)
        else:
            counts["beyond_keep"] += 1
    return out


def pair_of(trajs: list[Trajectory], passing: list[Trajectory], min_gap: float, raw: bool,
            tools: list[dict], counts: Counter) -> dict | None:
    """chosen: the best trace that passes the filters; rejected: the worst complete trace."""
    from retrograd.agent.rollout import messages_of

    if not passing:
        counts["pair:no_passing_trace"] += 1
        return None
    chosen = min(passing, key=lambda t: (-t.reward, _length(t)))
    complete = [t for t in trajs if t.finish == "answer" and t is not chosen and not t.causes.get("malformed_call")]
    if not complete:
        counts["pair:no_rejected_trace"] += 1
        return None
    rejected = min(complete, key=lambda t: (t.reward, -_length(t)))
    if chosen.reward - rejected.reward < min_gap:
        counts["pair:gap_below_min"] += 1
        return None
    return {"chosen": messages_of(chosen, raw), "rejected": messages_of(rejected, raw), "tools": tools,
            "rewards": [chosen.reward, rejected.reward], "scenario": chosen.scenario.id}


def run(args: argparse.Namespace) -> int:
    from retrograd.agent import scenarios as sc_mod
    from retrograd.agent.rollout import to_record
    from retrograd.agent.tools import ToolBox

    cfg = load_config(args)
    positive(args, "k", "keep", "limit")
    if args.min_gap is not None and not args.pairs:
        raise UsageError("--min-gap goes with --pairs")
    if args.api and args.model:
        raise UsageError("--api generates with [agent.collect_api]: it takes no --model")
    out = Path(args.out).resolve()
    if out.exists() and not args.force:
        raise UsageError(f"--out {out} exists (pass --force to overwrite it)")
    source = Path(args.scenarios).resolve() if args.scenarios else cfg.agent.scenarios
    if source is None:
        raise ConfigError(f"{config_label(cfg)}: [agent].scenarios is required for collect (or pass --scenarios)")
    scenarios = sc_mod.load(Path(source), limit=args.limit or 0)
    s = _settings(args, cfg, scenarios)
    workdir = Path(tempfile.mkdtemp(prefix="retrograd-collect-"))
    counts: Counter = Counter()
    report: list[dict] = []
    written = 0
    with ToolBox.from_config(cfg) as toolbox:
        attempts = _attempts(args, cfg, toolbox, workdir, s)
        tools = toolbox.openai_tools()
        progress = Progress(len(scenarios), label="scenarios")
        try:
            with atomic_open(out, keep_partial=True) as fh:
                for i, scenario in enumerate(scenarios):
                    trajs = attempts(i, scenario)
                    passing = []
                    for t in trajs:
                        why = _filter(t, s["require"], args.min_reward)
                        if why:
                            counts[why] += 1
                        else:
                            passing.append(t)
                    if args.pairs:
                        pair = pair_of(trajs, passing, 0.5 if args.min_gap is None else args.min_gap, args.raw,
                                       tools, counts)
                        kept = [pair] if pair else []
                    else:
                        kept = [to_record(t, tools, args.raw) for t in best_traces(passing, s["keep"], args.raw, counts)]
                    for rec in kept:
                        fh.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
                    fh.flush()
                    written += len(kept)
                    passes = sum(bool(t.verified) for t in trajs)
                    report.append({"scenario": scenario.id, "line": scenario.line, "attempts": len(trajs),
                                   "passes": passes, "kept": len(kept), "pass_rate": passes / max(len(trajs), 1),
                                   "rewards": [t.reward for t in trajs], "finishes": [t.finish for t in trajs],
                                   "tool_calls": [t.tool_calls for t in trajs]})
                    progress.update(i + 1, sum(t.n_trained for t in trajs), {"kept": written, "passes": passes})
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    total = sum(r["attempts"] for r in report)
    passes = sum(r["passes"] for r in report)
    summary = {"scenarios": len(report), "attempts": total, "passes": passes,
               "pass_rate": passes / max(total, 1), "written": written, "dropped": dict(sorted(counts.items())),
               "k": s["k"], "require_verified": s["require"], "pairs": bool(args.pairs)}
    if args.report:
        atomic_write(Path(args.report).resolve(), json.dumps({**summary, "per_scenario": report}, indent=2))
    what = "pairs" if args.pairs else "traces"
    print(f"wrote {written} {what} to {out}: {len(report)} scenarios x {s['k']} attempts, "
          f"pass rate {summary['pass_rate']:.3f} ({passes}/{total})")
    if counts:
        print("dropped: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


def _attempts(args: argparse.Namespace, cfg: Config, toolbox: ToolBox, workdir: Path, s: dict):
    """attempts(i, scenario) -> the k scored trajectories of scenario i (seeds from seed + i * k)."""
    from retrograd.agent.rollout import score_group

    a, k = cfg.agent, s["k"]
    if args.api:
        from retrograd.agent import endpoint
        from retrograd.agent.api_rollout import rollout_api

        endpoint.check(a.collect_api, f"{config_label(cfg)}: [agent.collect_api]")

        def api_attempts(i: int, scenario) -> list[Trajectory]:
            trajs = [rollout_api(a.collect_api, toolbox, scenario, seed=s["seed"] + i * k + j, rid=f"{i}-{j}",
                                 system_prompt=a.system_prompt, max_turns=a.max_turns,
                                 state_template=a.state_template, workdir=workdir) for j in range(k)]
            score_group(trajs, None)         # only the environment grades in --api mode
            return trajs
        return api_attempts

    from retrograd.agent.judge import build_judge
    from retrograd.agent.rollout import AgentEnv, rollout
    from retrograd.data.chat import format_for
    from retrograd.generation.llama import Generator, SamplingParams

    gen = Generator(resolve_model(cfg), n_ctx=cfg.model.ctx, n_seq=k, threads=resolve_threads(cfg),
                    device=cfg.model.device)
    if cfg.lora.init_adapter:
        gen.load_adapter(cfg.lora.init_adapter)
    chat = format_for(gen.tokenizer, cfg.model.chat_template)
    env = AgentEnv(gen, chat, toolbox, a.system_prompt, a.max_turns, a.state_template, workdir)
    judge = build_judge(cfg, gen, chat) if not s["require"] else None
    g = cfg.grpo

    def local_attempts(i: int, scenario) -> list[Trajectory]:
        params = [SamplingParams(g.temperature, g.top_p, g.top_k, a.max_new_tokens, s["seed"] + i * k + j, tuple(g.stop))
                  for j in range(k)]
        trajs = rollout(env, [scenario] * k, params, [f"{i}-{j}" for j in range(k)])
        score_group(trajs, judge if k > 1 else None)
        return trajs
    return local_attempts
