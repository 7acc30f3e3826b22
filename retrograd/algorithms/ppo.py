"""PPO with a value head: one completion per prompt, a per-token KL penalty against the base model
folded into the rewards, GAE, whitened advantages, clipped policy and value losses, ppo_epochs
updates per batch of rollouts.

The value head is a linear map of the final hidden state, v = h . u + b, kept in numpy and trained
with its own AdamW; its loss reaches the LoRA through d(loss)/d(hidden), which the engine adds to
the head's gradient, so the adapter learns from both losses."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrograd.algorithms import MicroBatch, StepWork
from retrograd.algorithms import rewards as rw
from retrograd.data.batching import ExampleStream, pack, to_batch, train_and_eval
from retrograd.data.formats import Example
from retrograd.data.prompts import load_prompts
from retrograd.eval.rewards import sample_rewards
from retrograd.generation.llama import Generator, SamplingParams
from retrograd.native import LossInputs, LossOutputs


def gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns of one sequence (the value after its last token is 0)."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    last = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        nxt = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * nxt - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, adv + values


def ppo_token_loss(logp, old, adv, values, old_values, returns, cliprange: float, cliprange_value: float,
                   vf_coef: float, n_tokens: int) -> tuple[float, np.ndarray, np.ndarray, dict]:
    """Clipped policy loss + clipped value loss, averaged over the step's n_tokens. Returns the
    loss, d loss/d logp, d loss/d value, and stats."""
    logp, old, adv = (np.asarray(x, np.float64) for x in (logp, old, adv))
    values, old_values, returns = (np.asarray(x, np.float64) for x in (values, old_values, returns))
    r = np.exp(logp - old)
    unclipped, clipped = r * adv, np.clip(r, 1 - cliprange, 1 + cliprange) * adv
    use = unclipped <= clipped
    pg = -np.where(use, unclipped, clipped)
    d_logp = -np.where(use, unclipped, 0.0) / n_tokens
    v_clip = old_values + np.clip(values - old_values, -cliprange_value, cliprange_value)
    l1, l2 = (values - returns) ** 2, (v_clip - returns) ** 2
    take1 = l1 >= l2
    vl = 0.5 * np.maximum(l1, l2)
    inside = np.abs(values - old_values) < cliprange_value
    d_value = vf_coef * np.where(take1, values - returns, np.where(inside, v_clip - returns, 0.0)) / n_tokens
    loss = float((pg.sum() + vf_coef * vl.sum()) / n_tokens)
    stats = {"pg_loss": float(pg.sum() / n_tokens), "value_loss": float(vl.sum() / n_tokens),
             "clip_frac": float((~use & (unclipped != clipped)).mean()) if len(r) else 0.0}
    return loss, d_logp.astype(np.float32), d_value, stats


@dataclass
class ValueHead:
    """v = h . u + b with AdamW moments; all float64 on the host."""

    u: np.ndarray
    b: float = 0.0
    m: np.ndarray = field(default=None)
    v: np.ndarray = field(default=None)
    t: int = 0
    grad: np.ndarray = field(default=None)

    @classmethod
    def new(cls, n_embd: int) -> ValueHead:
        z = np.zeros(n_embd + 1)
        return cls(np.zeros(n_embd), 0.0, z.copy(), z.copy(), 0, z.copy())

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        return hidden.astype(np.float64) @ self.u + self.b

    def step(self, lr: float, beta1=0.9, beta2=0.999, eps=1e-8) -> None:
        self.t += 1
        g = self.grad
        self.m = beta1 * self.m + (1 - beta1) * g
        self.v = beta2 * self.v + (1 - beta2) * g * g
        upd = lr * (self.m / (1 - beta1 ** self.t)) / (np.sqrt(self.v / (1 - beta2 ** self.t)) + eps)
        self.u -= upd[:-1]
        self.b -= float(upd[-1])
        self.grad = np.zeros_like(self.grad)

    def state(self) -> dict:
        return {"u": self.u.tolist(), "b": self.b, "m": self.m.tolist(), "v": self.v.tolist(), "t": self.t}

    @classmethod
    def from_state(cls, s: dict) -> ValueHead:
        u = np.asarray(s["u"], np.float64)
        return cls(u, float(s["b"]), np.asarray(s["m"]), np.asarray(s["v"]), int(s["t"]), np.zeros(len(u) + 1))


@dataclass
class PPORollout:
    examples: list[Example]
    adv: list[np.ndarray]
    returns: list[np.ndarray]
    old_logp: list[np.ndarray]
    old_values: list[np.ndarray]
    stats: dict


class PPO:
    def __init__(self, run) -> None:
        self.run = run
        cfg, p = run.cfg, run.cfg.ppo
        base = cfg.source.parent if cfg.source else Path.cwd()
        self.rewards = rw.build(p.rewards, base, "ppo")
        if cfg.data.train is None:
            raise rw.RewardError("[data].train is required: a JSONL file of prompts")
        self.train_prompts, self.eval_prompts = train_and_eval(
            cfg, lambda path: load_prompts(path, run.tokenizer, run.chat, max_tokens=p.max_prompt_tokens,
                                           skip_bad=cfg.data.skip_bad_lines), "prompts", run.notes)
        self.stream = ExampleStream(self.train_prompts, cfg.run.seed, cfg.data.shuffle)
        self.gen = Generator(run.trainable.model_path, n_ctx=p.max_prompt_tokens + p.max_new_tokens + 8,
                             n_seq=8, threads=run.trainable.info.n_threads, device=cfg.model.device)
        self.value = ValueHead.new(run.trainable.info.n_embd)
        self.rollout_index = 0
        self.current: PPORollout | None = None
        self.epoch = 0

    def _score_pass(self, examples: list[Example]) -> tuple[list, list, list]:
        """Policy log-probs, values and reference log-probs of each example's completion tokens."""
        t = self.run.cfg.training
        tr = self.run.trainable
        logp, values, ref = [None] * len(examples), [None] * len(examples), [None] * len(examples)
        index = {id(e): i for i, e in enumerate(examples)}
        for group in pack(examples, t.micro_batch_tokens, True):
            batch, owner = to_batch(group)
            cur = tr.logprobs(batch, hidden=True)
            base = tr.logprobs(batch, adapter=False)
            v = self.value(cur.hidden[batch.target_rows])
            for s, e in enumerate(group):
                m = owner == s
                i = index[id(e)]
                logp[i], values[i], ref[i] = cur.logp[m].astype(np.float64), v[m], base.logp[m].astype(np.float64)
        return logp, values, ref

    def _rollout(self) -> PPORollout:
        cfg, p = self.run.cfg, self.run.cfg.ppo
        t0 = time.monotonic()
        self.gen.set_adapter(self.run.trainable.adapter_bytes())
        prompts = self.stream.take(n=p.batch_prompts)
        examples, scores, lengths = [], [], []
        per: dict[str, list[float]] = {r.name: [] for r in self.rewards}
        for pi, prompt in enumerate(prompts):
            seed = int(np.random.SeedSequence([cfg.run.seed, self.rollout_index, pi]).generate_state(1)[0])
            o = self.gen.generate(prompt.tokens, [SamplingParams(p.temperature, p.top_p, 0, p.max_new_tokens, seed,
                                                                 tuple(p.stop))])[0]
            comp = list(o.tokens) + ([o.end_token] if o.end_token is not None else [])
            if not comp:
                continue
            sc = rw.score(self.rewards, [o.text], prompt.record, prompt.line, p.reward_errors)
            for k, v in sc.per_fn.items():
                per[k] += v
            toks = np.concatenate([prompt.tokens, np.asarray(comp, np.int32)])
            trained = np.zeros(len(toks), bool)
            trained[len(prompt.tokens):] = True
            examples.append(Example(toks, trained, prompt.line))
            scores.append(sc.total[0])
            lengths.append(len(comp))
        self.rollout_index += 1
        logp, values, ref = self._score_pass(examples)
        adv, rets, kls = [], [], []
        for lp, v, rf, s in zip(logp, values, ref, scores):
            kl = lp - rf
            r = -p.kl_coef * kl
            r[-1] += s
            a, ret = gae(r, v, p.gamma, p.lam)
            adv.append(a)
            rets.append(ret)
            kls.append(kl.mean())
        if p.whiten_advantages and adv:
            flat = np.concatenate(adv)
            mu, sd = flat.mean(), flat.std() + 1e-8
            adv = [(a - mu) / sd for a in adv]
        mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0   # noqa: E731
        stats = {"reward_mean": mean(scores), "reward_std": float(np.std(scores)) if scores else 0.0,
                 "kl": mean(kls), "completion_len": mean(lengths), "gen_s": time.monotonic() - t0}
        for k, v in per.items():
            stats[f"reward/{k}"] = mean(v)
        return PPORollout(examples, adv, rets, logp, values, stats)

    def next_step(self) -> StepWork:
        p, t = self.run.cfg.ppo, self.run.cfg.training
        if self.current is None or self.epoch >= p.ppo_epochs:
            self.current, self.epoch = self._rollout(), 0
        ro, first = self.current, self.epoch == 0
        self.epoch += 1
        n_tokens = max(1, sum(len(a) for a in ro.adv))
        index = {id(e): i for i, e in enumerate(ro.examples)}
        micro = []
        for group in pack(ro.examples, t.micro_batch_tokens, True):
            batch, owner = to_batch(group)
            ids = [index[id(e)] for e in group]
            cat = lambda xs, ids=ids: np.concatenate([xs[i] for i in ids])   # noqa: E731
            adv, ret, old, oldv = cat(ro.adv), cat(ro.returns), cat(ro.old_logp), cat(ro.old_values)
            rows = batch.target_rows

            def loss(inp: LossInputs, adv=adv, ret=ret, old=old, oldv=oldv, rows=rows) -> tuple[LossOutputs, dict]:
                h = inp.hidden[rows].astype(np.float64)
                v = self.value(h)
                value, d_logp, d_v, st = ppo_token_loss(inp.logp, old, adv, v, oldv, ret, p.cliprange,
                                                        p.cliprange_value, p.vf_coef, n_tokens)
                grad_h = np.zeros_like(inp.hidden, dtype=np.float32)
                np.add.at(grad_h, rows, (d_v[:, None] * self.value.u[None, :]).astype(np.float32))
                self.value.grad[:-1] += d_v @ h
                self.value.grad[-1] += d_v.sum()
                n = len(d_v)
                return LossOutputs(d_logp, grad_h), {"loss": value, "pg_loss": st["pg_loss"],
                                                     "value_loss": st["value_loss"], "_clip": st["clip_frac"] * n,
                                                     "_n": n}

            micro.append(MicroBatch(batch, loss, want_hidden=True))
        info = dict(ro.stats) if first else {}
        tokens = int(sum(len(e.tokens) for e in ro.examples))
        return StepWork(micro, tokens, info, finalize=self._finalize)

    def _finalize(self, sums: dict) -> dict:
        # the trainer calls this once the step's gradients are in: update the value head alongside
        self.value.step(self.run.cfg.ppo.value_lr)
        n = max(sums.pop("_n", 0), 1)
        out = {k: v for k, v in sums.items() if not k.startswith("_")}
        out["clip_frac"] = sums.get("_clip", 0.0) / n
        return out

    def estimate_steps(self) -> int:
        p, t = self.run.cfg.ppo, self.run.cfg.training
        return max(1, int(np.ceil(t.epochs * len(self.train_prompts) / p.batch_prompts)) * p.ppo_epochs)

    def evaluate(self) -> dict[str, float]:
        if not self.eval_prompts:
            return {}
        p, cfg = self.run.cfg.ppo, self.run.cfg
        limit = min(len(self.eval_prompts), cfg.evaluation.limit or 32)
        self.gen.set_adapter(self.run.trainable.adapter_bytes())
        res = sample_rewards(self.gen, self.eval_prompts[:limit], self.rewards, n=1, temperature=0.0, top_p=1.0, top_k=0,
                             max_new_tokens=p.max_new_tokens, stop=tuple(p.stop), seed=cfg.run.seed,
                             on_error=p.reward_errors)
        return {"eval_reward": res["reward_mean"], "eval_loss": -res["reward_mean"]}

    def state_dict(self) -> dict:
        state = {"cursor": self.stream.cursor.to_dict(), "rollout_index": self.rollout_index, "epoch": self.epoch,
                 "value_head": self.value.state()}
        ro = self.current
        if ro is not None and self.epoch < self.run.cfg.ppo.ppo_epochs:
            state["rollout"] = {"tokens": [e.tokens.tolist() for e in ro.examples],
                                "trained": [e.trained.tolist() for e in ro.examples],
                                **{k: [x.tolist() for x in getattr(ro, k)]
                                   for k in ("adv", "returns", "old_logp", "old_values")}}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.stream.seek(state.get("cursor", {}))
        self.rollout_index = int(state.get("rollout_index", 0))
        self.epoch = int(state.get("epoch", 0))
        if "value_head" in state:
            self.value = ValueHead.from_state(state["value_head"])
        r = state.get("rollout")
        if r:
            ex = [Example(np.asarray(t, np.int32), np.asarray(m, bool)) for t, m in zip(r["tokens"], r["trained"])]
            arrs = {k: [np.asarray(x, np.float64) for x in r[k]] for k in ("adv", "returns", "old_logp", "old_values")}
            self.current = PPORollout(ex, arrs["adv"], arrs["returns"], arrs["old_logp"], arrs["old_values"], {})
        else:
            self.current, self.epoch = None, 0
