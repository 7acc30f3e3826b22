"""GRPO and its variants (dr_grpo, dapo, gspo): for each prompt, a group of completions sampled in
one batch from the current adapter (swapped into llama.cpp from memory), rewards, advantages
normalised within the group, and the clipped policy loss of pg_losses.py with an optional KL to
the base model (the adapter switched off, scored by our own graph)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrograd.algorithms import MicroBatch, StepWork
from retrograd.algorithms import rewards as rw
from retrograd.algorithms.pg_losses import PGBatch, PGConfig, group_advantages, policy_loss
from retrograd.data.batching import ExampleStream, Group, group_batch, pack_groups, train_and_eval
from retrograd.data.prompts import load_prompts
from retrograd.eval.rewards import sample_rewards
from retrograd.generation.llama import Generator, SamplingParams
from retrograd.native import LossInputs, LossOutputs


@dataclass
class Rollout:
    """One batch of groups (prompt + completions), reusable for num_iterations updates. Per
    completion, in group order: advantage, length, llama.cpp's sampling log-probs."""

    groups: list[Group]
    adv: np.ndarray
    lengths: np.ndarray
    sample_logp: list[np.ndarray]
    old_logp: dict = field(default_factory=dict)     # micro-batch index -> logp of the first pass
    stats: dict = field(default_factory=dict)


class GRPO:
    def __init__(self, run) -> None:
        self.run = run
        cfg, g = run.cfg, run.cfg.grpo
        base = cfg.source.parent if cfg.source else Path.cwd()
        self.rewards = rw.build(g.rewards, base, "grpo")
        if cfg.data.train is None:
            raise rw.RewardError("[data].train is required: a JSONL file of prompts")
        self.train_prompts, self.eval_prompts = train_and_eval(
            cfg, lambda path: load_prompts(path, run.tokenizer, run.chat, max_tokens=g.max_prompt_tokens,
                                           skip_bad=cfg.data.skip_bad_lines), "prompts", run.notes)
        self.stream = ExampleStream(self.train_prompts, cfg.run.seed, cfg.data.shuffle)
        self.gen = Generator(run.trainable.model_path, n_ctx=g.max_prompt_tokens + g.max_new_tokens + 8,
                             n_seq=g.group_size, threads=run.trainable.info.n_threads, device=cfg.model.device)
        self.pg = PGConfig(g.loss, g.epsilon, g.epsilon_high or g.epsilon, g.beta, max_new_tokens=g.max_new_tokens)
        self.rollout_index = 0
        self.current: Rollout | None = None
        self.iteration = 0

    # ---- rollouts ------------------------------------------------------------------------------
    def _params(self, seeds) -> list[SamplingParams]:
        g = self.run.cfg.grpo
        return [SamplingParams(g.temperature, g.top_p, g.top_k, g.max_new_tokens, int(s), tuple(g.stop)) for s in seeds]

    def _rollout(self) -> Rollout:
        cfg, g = self.run.cfg, self.run.cfg.grpo
        t0 = time.monotonic()
        self.gen.set_adapter(self.run.trainable.adapter_bytes())
        groups_out, lengths, slogp, groups, rewards = [], [], [], [], []
        per: dict[str, list[float]] = {r.name: [] for r in self.rewards}
        zero, errors = 0, 0
        for pi, prompt in enumerate(self.stream.take(n=g.prompts_per_step)):
            for attempt in range(g.resample_zero_groups + 1):
                seeds = np.random.SeedSequence([cfg.run.seed, self.rollout_index, pi, attempt]).generate_state(g.group_size)
                outs = self.gen.generate(prompt.tokens, self._params(seeds))
                sc = rw.score(self.rewards, [o.text for o in outs], prompt.record, prompt.line, g.reward_errors)
                if len(set(sc.total)) > 1 or attempt == g.resample_zero_groups:
                    break
                prompt = self.stream.take(n=1)[0]
            zero += len(set(sc.total)) == 1
            errors += sc.errors
            for k, v in sc.per_fn.items():
                per[k] += v
            comps = []
            for o, r in zip(outs, sc.total):
                comp = list(o.tokens) + ([o.end_token] if o.end_token is not None else [])
                lp = list(o.logprobs) + ([o.end_logprob] if o.end_token is not None else [])
                if not comp:      # nothing generated (immediate stop at the context limit): nothing to learn
                    continue
                comps.append(np.asarray(comp, np.int32))
                lengths.append(len(comp))
                slogp.append(np.asarray(lp, np.float64))
                groups.append(pi)
                rewards.append(r)
            if comps:
                groups_out.append(Group(prompt.tokens, comps))
        self.rollout_index += 1
        r = np.asarray(rewards, np.float64)
        adv = group_advantages(r, np.asarray(groups), scale=g.scale_rewards and g.loss != "dr_grpo")
        stats = {"reward_mean": float(r.mean()) if len(r) else 0.0, "reward_std": float(r.std()) if len(r) else 0.0,
                 "zero_signal_groups": float(zero), "completion_len": float(np.mean(lengths)) if lengths else 0.0,
                 "gen_s": time.monotonic() - t0}
        if errors:
            stats["reward_errors"] = float(errors)
        for k, v in per.items():
            stats[f"reward/{k}"] = float(np.mean(v)) if v else 0.0
        return Rollout(groups_out, adv, np.asarray(lengths, np.float64), slogp, stats=stats)

    # ---- the step ------------------------------------------------------------------------------
    def next_step(self) -> StepWork:
        g, t = self.run.cfg.grpo, self.run.cfg.training
        if self.current is None or self.iteration >= g.num_iterations:
            self.current, self.iteration = self._rollout(), 0
        ro, first = self.current, self.iteration == 0
        self.iteration += 1
        self.pg.n_seqs = max(1, len(ro.lengths))
        self.pg.n_tokens = max(1, int(ro.lengths.sum()))
        self.pg.lengths = ro.lengths
        first_completion = np.cumsum([0] + [len(gr.completions) for gr in ro.groups])
        micro = []
        t_ref = time.monotonic()
        for mi, members in enumerate(pack_groups(ro.groups, t.micro_batch_tokens)):
            batch, owner = group_batch([ro.groups[i] for i in members])
            # owner counts completions within this micro-batch; map to the rollout's numbering
            offsets = np.concatenate([np.arange(first_completion[i], first_completion[i + 1]) for i in members])
            seq = offsets[owner]
            ref = self.run.trainable.logprobs(batch, adapter=False).logp if g.beta > 0 else None
            sample = np.concatenate([ro.sample_logp[i] for i in offsets])

            def loss(inp: LossInputs, mi=mi, seq=seq, ref=ref, sample=sample) -> tuple[LossOutputs, dict]:
                logp = inp.logp.astype(np.float64)
                if first:
                    ro.old_logp[mi] = logp.copy()
                old = ro.old_logp[mi]
                value, coeff, st = policy_loss(PGBatch(logp, old, ro.adv[seq], seq, ref), self.pg)
                n = len(logp)
                m = {"loss": value, "_n": n, "_clip": st["clip_frac"] * n, "_diff": float(np.abs(sample - logp).sum())}
                if "kl" in st:
                    m["_kl"] = st["kl"] * n
                if inp.entropy is not None:
                    m["_ent"] = float(inp.entropy.sum())
                return LossOutputs(coeff), m

            micro.append(MicroBatch(batch, loss, want_entropy=True))
        info = dict(ro.stats) if first else {}
        if g.beta > 0:
            info["ref_s"] = time.monotonic() - t_ref
        tokens = int(sum(gr.n_tokens for gr in ro.groups))
        return StepWork(micro, tokens, info, finalize=_finalize)

    def estimate_steps(self) -> int:
        g, t = self.run.cfg.grpo, self.run.cfg.training
        rollouts = int(np.ceil(t.epochs * len(self.train_prompts) / g.prompts_per_step))
        return max(1, rollouts * g.num_iterations)

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        if not self.eval_prompts:
            return {}
        g, cfg = self.run.cfg.grpo, self.run.cfg
        limit = min(len(self.eval_prompts), cfg.evaluation.limit or g.eval_prompts)
        self.gen.set_adapter(self.run.trainable.adapter_bytes())
        res = sample_rewards(self.gen, self.eval_prompts[:limit], self.rewards, n=1, temperature=0.0, top_p=1.0,
                             top_k=0, max_new_tokens=g.max_new_tokens, stop=tuple(g.stop), seed=cfg.run.seed,
                             on_error=g.reward_errors)
        # best.state keeps the lowest eval_loss: for RL that is the highest reward
        return {"eval_reward": res["reward_mean"], "eval_loss": -res["reward_mean"]}

    # ---- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"cursor": self.stream.cursor.to_dict(), "rollout_index": self.rollout_index,
                 "iteration": self.iteration}
        ro = self.current
        if ro is not None and self.iteration < self.run.cfg.grpo.num_iterations:
            # between the updates of one batch of rollouts: keep the batch (JSON floats round-trip exactly)
            state["rollout"] = {"prompts": [gr.prompt.tolist() for gr in ro.groups],
                                "completions": [[c.tolist() for c in gr.completions] for gr in ro.groups],
                                "adv": ro.adv.tolist(), "lengths": ro.lengths.tolist(),
                                "sample_logp": [x.tolist() for x in ro.sample_logp],
                                "old_logp": {str(k): v.tolist() for k, v in ro.old_logp.items()}}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.stream.seek(state.get("cursor", {}))
        self.rollout_index = int(state.get("rollout_index", 0))
        self.iteration = int(state.get("iteration", 0))
        r = state.get("rollout")
        if r:
            groups = [Group(np.asarray(p, np.int32), [np.asarray(c, np.int32) for c in cs])
                      for p, cs in zip(r["prompts"], r["completions"])]
            self.current = Rollout(groups, np.asarray(r["adv"]), np.asarray(r["lengths"]),
                                   [np.asarray(x) for x in r["sample_logp"]],
                                   {int(k): np.asarray(v) for k, v in r["old_logp"].items()})
        else:
            self.current = None
            self.iteration = 0


def _finalize(sums: dict) -> dict:
    n = max(sums.pop("_n", 0), 1)
    out = {k: v for k, v in sums.items() if not k.startswith("_")}
    out["clip_frac"] = sums.get("_clip", 0.0) / n
    out["logp_gap"] = sums.get("_diff", 0.0) / n       # |llama.cpp sampling logp - our logp|, mean per token
    if "_kl" in sums:
        out["kl"] = sums["_kl"] / n
    if "_ent" in sums:
        out["entropy"] = sums["_ent"] / n
    return out
