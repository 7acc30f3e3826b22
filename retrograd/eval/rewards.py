"""Reward distributions of generated answers: what `bench` reports for grpo and ppo, and what RL
runs evaluate. Fixed seeds, so the base model and an adapter are measured on the same draws."""

from __future__ import annotations

import numpy as np

from retrograd import rewards as rw
from retrograd.generation.llama import Generator, SamplingParams


def sample_rewards(gen: Generator, prompts: list, rewards: list[rw.Reward], *, n: int, temperature: float,
                   top_p: float, top_k: int, max_new_tokens: int, stop: tuple, seed: int,
                   on_error: str = "raise") -> dict:
    totals: list[float] = []
    per: dict[str, list[float]] = {r.name: [] for r in rewards}
    lengths: list[int] = []
    for i, p in enumerate(prompts):
        seeds = np.random.SeedSequence([seed, 99991, i]).generate_state(n).tolist()
        params = [SamplingParams(temperature, top_p, top_k, max_new_tokens, int(s), stop) for s in seeds]
        outs = gen.generate(p.tokens, params)
        sc = rw.score(rewards, [o.text for o in outs], p.record, p.line, on_error)
        totals += sc.total
        for k, v in sc.per_fn.items():
            per[k] += v
        lengths += [len(o.tokens) for o in outs]
    return summarize(totals, per, lengths)


def summarize(totals: list[float], per: dict[str, list[float]], lengths: list[int]) -> dict:
    t = np.asarray(totals, np.float64)
    out = {"reward_mean": float(t.mean()), "reward_std": float(t.std()),
           "reward_p10": float(np.quantile(t, 0.1)), "reward_p50": float(np.quantile(t, 0.5)),
           "reward_p90": float(np.quantile(t, 0.9)), "completions": int(len(t)),
           "completion_len": float(np.mean(lengths)) if lengths else 0.0}
    for k, v in per.items():
        a = np.asarray(v, np.float64)
        out[f"mean/{k}"] = float(a.mean())
        out[f"pass/{k}"] = float((a > 0).mean())
    return out
