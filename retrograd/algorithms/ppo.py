"""PPO with a value head: one completion per prompt, a per-token KL penalty against the base model
folded into the rewards, GAE, whitened advantages, clipped policy and value losses, ppo_epochs
updates per batch of rollouts.

The value head is a linear map of the final hidden state, v = h . u + b, kept in numpy and trained
with its own AdamW; its loss reaches the LoRA through d(loss)/d(hidden), which the engine adds to
the head's gradient, so the adapter learns from both losses."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from retrograd.algorithms.base import GeneratorFactory, MicroBatch, StepWork, Tally
from retrograd.algorithms.rl import RolloutRecipe, reward_stats
from retrograd.batch import LossInputs, LossOutputs
from retrograd.context import RunContext
from retrograd.data.batching import pack, to_batch
from retrograd.data.formats import Example
from retrograd.losses.pg import ppo_loss


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


@dataclass
class ValueHead:
    """v = h . u + b with AdamW moments; all float64 on the host."""

    u: np.ndarray
    b: float
    m: np.ndarray
    v: np.ndarray
    t: int
    grad: np.ndarray

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
    swap_s: float = 0.0           # the adapter swap before sampling (RolloutRecipe.sync_adapter)


class PPO(RolloutRecipe):
    # the value head trains in this process, inside the loss: its gradients stay here (with
    # [distributed], PPO's rollouts are spread over the workers, its gradients are not)
    distributed_gradients = False

    def __init__(self, run: RunContext, generators: GeneratorFactory | None = None) -> None:
        # a rollout's prompts decode together, one sequence each (split between the workers with [distributed])
        super().__init__(run, generators, run.cfg.ppo, "ppo", n_seq=run.cfg.ppo.batch_prompts)
        self.value = ValueHead.new(run.trainable.info.n_embd)
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
            base = tr.reference_logprobs(batch)
            assert cur.hidden is not None, "asked for with hidden=True"
            v = self.value(cur.hidden[batch.target_rows])
            for s, e in enumerate(group):
                m = owner == s
                i = index[id(e)]
                logp[i], values[i], ref[i] = cur.logp[m].astype(np.float64), v[m], base.logp[m].astype(np.float64)
        return logp, values, ref

    def _rollout(self) -> PPORollout:
        p = self.run.cfg.ppo
        t0 = time.monotonic()
        swap_s = self.sync_adapter()
        prompts = self.stream.take(n=p.batch_prompts)
        examples, scores, lengths = [], [], []
        per: dict[str, list[float]] = {r.name: [] for r in self.rewards}
        outs = self.gen.generate_each([pr.tokens for pr in prompts],
                                      [self.sampling(self.seeds(pi, n=1))[0] for pi in range(len(prompts))])
        for prompt, o in zip(prompts, outs):
            comp, _ = o.trained()
            if not comp:
                continue
            sc = self.score([o.text], prompt)
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
        stats.update(reward_stats(per))
        return PPORollout(examples, adv, rets, logp, values, stats, swap_s)

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

            def loss(inp: LossInputs, tally: Tally, adv=adv, ret=ret, old=old, oldv=oldv, rows=rows) -> LossOutputs:
                assert inp.hidden is not None, "the micro-batch wants hidden states"
                h = inp.hidden[rows].astype(np.float64)
                v = self.value(h)
                value, d_logp, d_v, st = ppo_loss(inp.logp, old, adv, v, oldv, ret, p.cliprange, p.cliprange_value,
                                                  p.vf_coef, n_tokens)
                grad_h = np.zeros_like(inp.hidden, dtype=np.float32)
                np.add.at(grad_h, rows, (d_v[:, None] * self.value.u[None, :]).astype(np.float32))
                self.value.grad[:-1] += d_v @ h
                self.value.grad[-1] += d_v.sum()
                n = len(d_v)
                tally.add("loss", value)
                tally.add("pg_loss", st["pg_loss"])
                tally.add("value_loss", st["value_loss"])
                tally.mean("clip_frac", st["clip_frac"] * n, n)
                return LossOutputs(d_logp, grad_h)

            micro.append(MicroBatch(batch, loss, want_hidden=True))
        info = dict(ro.stats) if first else {}
        tokens = int(sum(len(e.tokens) for e in ro.examples))
        # the value head's gradient is complete once every micro-batch ran: update it beside the adapter
        return StepWork(micro, tokens, info, after_update=lambda: self.value.step(p.value_lr),
                        swap_s=ro.swap_s if first else 0.0)

    def estimate_steps(self) -> int:
        p, t = self.run.cfg.ppo, self.run.cfg.training
        return max(1, int(np.ceil(t.epochs * len(self.train_prompts) / p.batch_prompts)) * p.ppo_epochs)

    def state_dict(self) -> dict:
        state = {**self.base_state(), "epoch": self.epoch, "value_head": self.value.state()}
        ro = self.current
        if ro is not None and self.epoch < self.run.cfg.ppo.ppo_epochs:
            state["rollout"] = {"tokens": [e.tokens.tolist() for e in ro.examples],
                                "trained": [e.trained.tolist() for e in ro.examples],
                                **{k: [x.tolist() for x in getattr(ro, k)]
                                   for k in ("adv", "returns", "old_logp", "old_values")}}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.load_base_state(state)
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
