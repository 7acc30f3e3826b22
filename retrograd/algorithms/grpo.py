"""GRPO and its variants (dr_grpo, dapo, gspo): for each prompt, a group of completions sampled in
one batch from the current adapter (swapped into llama.cpp from memory), rewards, advantages
normalised within the group, and the clipped policy loss of pg_losses.py with an optional KL to
the base model (the adapter switched off, scored by our own graph)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np

from retrograd.algorithms.base import GeneratorFactory, MicroBatch, StepWork, Tally
from retrograd.algorithms.rl import RolloutRecipe, reward_stats
from retrograd.batch import LossInputs, LossOutputs
from retrograd.context import RunContext
from retrograd.data.batching import Group, group_batch, pack_groups, split_groups
from retrograd.losses.pg import PGBatch, PGConfig, group_advantages, policy_loss


@dataclass
class Rollout:
    """One batch of groups (prompt + completions), reusable for num_iterations updates. Per
    completion, in group order: advantage, length, llama.cpp's sampling log-probs. swap_s: the
    adapter swap before sampling (RolloutRecipe.sync_adapter)."""

    groups: list[Group]
    adv: np.ndarray
    lengths: np.ndarray
    sample_logp: list[np.ndarray]
    old_logp: dict = field(default_factory=dict)     # micro-batch index -> logp of the first pass
    stats: dict = field(default_factory=dict)
    swap_s: float = 0.0


class GRPO(RolloutRecipe):
    resample_together = False     # resampled groups decoded one at a time

    def __init__(self, run: RunContext, generators: GeneratorFactory | None = None) -> None:
        g = run.cfg.grpo
        # without resampling, a step's groups are decoded together (one weight read per token for all);
        # agent_grpo also resamples its zero-signal groups together, so it always decodes them together
        together = g.prompts_per_step if g.resample_zero_groups == 0 or self.resample_together else 1
        super().__init__(run, generators, g, "grpo", n_seq=g.group_size * together, groups=together)
        self.pg = PGConfig(g.loss, g.epsilon, g.epsilon_high or g.epsilon, g.beta, max_new_tokens=g.max_new_tokens)
        self.current: Rollout | None = None
        self.iteration = 0

    # ---- rollouts ------------------------------------------------------------------------------
    def _rollout(self) -> Rollout:
        g = self.run.cfg.grpo
        t0 = time.monotonic()
        swap_s = self.sync_adapter()
        groups_out, lengths, slogp, groups, rewards = [], [], [], [], []
        per: dict[str, list[float]] = {r.name: [] for r in self.rewards}
        zero, errors = 0, 0
        prompts = self.stream.take(n=g.prompts_per_step)
        together = None
        if g.resample_zero_groups == 0:
            together = self.gen.generate_groups([p.tokens for p in prompts],
                                                [self.sampling(self.seeds(pi, 0, n=g.group_size))
                                                 for pi in range(len(prompts))])
        for pi, prompt in enumerate(prompts):
            for attempt in range(g.resample_zero_groups + 1):
                if together is not None:
                    outs = together[pi]
                else:
                    outs = self.gen.generate(prompt.tokens, self.sampling(self.seeds(pi, attempt, n=g.group_size)))
                sc = self.score([o.text for o in outs], prompt)
                if len(set(sc.total)) > 1 or attempt == g.resample_zero_groups:
                    break
                prompt = self.stream.take(n=1)[0]
            zero += len(set(sc.total)) == 1
            errors += sc.errors
            for k, v in sc.per_fn.items():
                per[k] += v
            comps = []
            for o, reward in zip(outs, sc.total):
                comp, lp = o.trained()
                if not comp:      # nothing generated (immediate stop at the context limit): nothing to learn
                    continue
                comps.append(np.asarray(comp, np.int32))
                lengths.append(len(comp))
                slogp.append(np.asarray(lp, np.float64))
                groups.append(pi)
                rewards.append(reward)
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
        stats.update(reward_stats(per))
        return Rollout(groups_out, adv, np.asarray(lengths, np.float64), slogp, stats=stats, swap_s=swap_s)

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
        micro = []
        t_ref = time.monotonic()
        parts = split_groups(ro.groups, t.micro_batch_tokens)      # a group over the budget: several parts
        for mi, members in enumerate(pack_groups([p for p, _ in parts], t.micro_batch_tokens)):
            batch, owner = group_batch([parts[i][0] for i in members])
            # owner counts completions within this micro-batch; map to the rollout's numbering
            offsets = np.concatenate([parts[i][1] for i in members])
            seq = offsets[owner]
            ref = self.run.trainable.reference_logprobs(batch).logp if g.beta > 0 else None
            sample = np.concatenate([ro.sample_logp[i] for i in offsets])

            # the loss reads only what it is given (it may run in another process): the first pass's
            # log-probs go back through tally.keep, not into the rollout
            def loss(inp: LossInputs, tally: Tally, mi=mi, seq=seq, ref=ref, sample=sample, adv=ro.adv[seq],
                     old=None if first else ro.old_logp[mi], pg=copy.copy(self.pg)) -> LossOutputs:
                logp = inp.logp.astype(np.float64)
                if old is None:
                    old = logp.copy()
                    tally.keep(mi, old)
                value, coeff, st = policy_loss(PGBatch(logp, old, adv, seq, ref), pg)
                n = len(logp)
                tally.add("loss", value)
                tally.mean("clip_frac", st["clip_frac"] * n, n)
                # |llama.cpp's sampling log-prob - our graph's| per token: the two engines' rounding apart
                tally.mean("logp_gap", float(np.abs(sample - logp).sum()), n)
                if "kl" in st:
                    tally.mean("kl", st["kl"] * n, n)
                if inp.entropy is not None:
                    tally.mean("entropy", float(inp.entropy.sum()), n)
                return LossOutputs(coeff)

            micro.append(MicroBatch(batch, loss, want_entropy=True))
        info = dict(ro.stats) if first else {}
        if g.beta > 0:
            info["ref_s"] = time.monotonic() - t_ref
        tokens = int(sum(gr.n_tokens for gr in ro.groups))
        return StepWork(micro, tokens, info, on_kept=ro.old_logp.update if first else None,
                        swap_s=ro.swap_s if first else 0.0)

    def estimate_steps(self) -> int:
        g, t = self.run.cfg.grpo, self.run.cfg.training
        rollouts = int(np.ceil(t.epochs * len(self.train_prompts) / g.prompts_per_step))
        return max(1, rollouts * g.num_iterations)

    # ---- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {**self.base_state(), "iteration": self.iteration}
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
        self.load_base_state(state)
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
