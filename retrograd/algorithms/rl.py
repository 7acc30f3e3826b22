"""What the RL recipes (grpo, ppo) share: the reward functions, the prompts of [data].train and
the held-out ones, the generator (llama.cpp, the current adapter swapped in from memory), the
per-rollout sampling seeds and the greedy evaluation. Each recipe adds only how it turns
completions into a loss."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from retrograd import rewards as rw
from retrograd.algorithms.base import GeneratorFactory, Recipe
from retrograd.config import RolloutSection
from retrograd.context import RunContext
from retrograd.data.batching import ExampleStream, train_and_eval
from retrograd.data.prompts import load_prompts
from retrograd.eval.rewards import sample_rewards
from retrograd.generation.llama import Generator, SamplingParams, group_kv_cells
from retrograd.generation.weights import generator_model
from retrograd.run_setup import config_dir, config_label


class RolloutRecipe(Recipe):
    """Base of the RL recipes; `settings` is their [grpo] or [ppo] section."""

    def __init__(self, run: RunContext, generators: GeneratorFactory | None, settings: RolloutSection, section: str,
                 n_seq: int, groups: int | None = None) -> None:
        """generators: what makes the generator (None: llama.cpp in this process); groups: how many
        prompts the n_seq sequences continue (each group shares its prompt's KV cells); None: every
        sequence has a prompt of its own."""
        self.run, self.g, self.section = run, settings, section
        cfg = run.cfg
        self.rewards = self.build_rewards()
        self.train_prompts, self.eval_prompts = self.load_items()
        self.stream = ExampleStream(self.train_prompts, cfg.run.seed, cfg.data.shuffle)
        threads = run.trainable.info.n_threads
        make = generators or Generator      # with [distributed]: sampled on the workers
        n_ctx = self.context_size()
        cells = None if groups is None else group_kv_cells(groups, n_ctx, n_seq, settings.max_new_tokens)
        weights = generator_model(run.trainable.model_path, settings.generator_weights, threads,
                                  on_cpu=run.trainable.model.device.kind == "cpu", dora=run.trainable.spec.dora)
        self.gen = make(weights, n_ctx=n_ctx, n_seq=n_seq, threads=threads, device=cfg.model.device, kv_cells=cells)
        self.rollout_index = 0

    def context_size(self) -> int:
        """Tokens per generated sequence: the longest prompt there is (longer ones than max_prompt_tokens
        were skipped when loading) and the longest completion; a KV cache sized to the work."""
        prompts = [*self.train_prompts, *self.eval_prompts]
        longest = max((len(p.tokens) for p in prompts), default=self.g.max_prompt_tokens)
        return longest + self.g.max_new_tokens + 8

    def build_rewards(self) -> list[rw.Reward]:
        cfg = self.run.cfg
        return rw.build(self.g.rewards, config_dir(cfg), self.section, config_label(cfg))

    def load_items(self) -> tuple[list, list]:
        """The training and held-out prompts ([data].train, [evaluation].data or the split)."""
        run, cfg = self.run, self.run.cfg
        run.require_train_data()
        return train_and_eval(
            cfg, lambda path: load_prompts(path, run.tokenizer, run.chat, max_tokens=self.g.max_prompt_tokens,
                                           skip_bad=cfg.data.skip_bad_lines), "prompts", run.notes)

    def close(self) -> None:
        self.gen.close()

    def sampling(self, seeds: Iterable[int]) -> list[SamplingParams]:
        g = self.g
        return [SamplingParams(g.temperature, g.top_p, g.top_k, g.max_new_tokens, int(s), tuple(g.stop)) for s in seeds]

    def seeds(self, *path: int, n: int) -> np.ndarray:
        """n sampling seeds derived from the run seed, the rollout index and `path` (so a resumed run
        draws what the uninterrupted one drew)."""
        return np.random.SeedSequence([self.run.cfg.run.seed, self.rollout_index, *path]).generate_state(n)

    def sync_adapter(self) -> float:
        """Give the generator the adapter as it is now (after the last optimizer step); returns the
        seconds it took (a step's StepWork.swap_s)."""
        t0 = time.monotonic()
        self.gen.set_adapter(self.run.trainable.adapter_bytes())
        return time.monotonic() - t0

    def score(self, texts: list[str], prompt) -> rw.Scored:
        return rw.score(self.rewards, texts, prompt.record, prompt.line, self.g.reward_errors)

    def evaluate(self) -> dict[str, float]:
        """Mean reward of greedy answers to the first eval_prompts held-out prompts."""
        if not self.eval_prompts:
            return {}
        g, cfg = self.g, self.run.cfg
        limit = min(len(self.eval_prompts), cfg.evaluation.limit or g.eval_prompts)
        self.sync_adapter()
        res = sample_rewards(self.gen, self.eval_prompts[:limit], self.rewards, n=1, temperature=0.0, top_p=1.0,
                             top_k=0, max_new_tokens=g.max_new_tokens, stop=tuple(g.stop), seed=cfg.run.seed,
                             on_error=g.reward_errors)
        return {"eval_reward": res["reward_mean"]}

    def base_state(self) -> dict:
        return {"cursor": self.stream.cursor.to_dict(), "rollout_index": self.rollout_index}

    def load_base_state(self, state: dict) -> None:
        self.stream.seek(state.get("cursor", {}))
        self.rollout_index = int(state.get("rollout_index", 0))


def reward_stats(per: dict[str, list[float]]) -> dict[str, float]:
    """Mean of each reward function over a batch of rollouts."""
    return {f"reward/{k}": float(np.mean(v)) if v else 0.0 for k, v in per.items()}
