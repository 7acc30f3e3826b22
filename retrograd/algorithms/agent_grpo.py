"""Agentic GRPO: GRPO on multi-turn conversations with tools. Per scenario, a group of
[grpo].group_size conversations is rolled out (agent/rollout.py: one batch per turn, a fresh state
copy each), rewarded by the scenario's verify or the judge, and trained with GRPO's losses on the
model's own tokens only (prompts and tool results are context). Everything after the rollout —
advantages within the group, the clipped objective, KL to the base model, resume — is GRPO's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from retrograd.agent import scenarios as sc_mod
from retrograd.agent.judge import build_judge
from retrograd.agent.rollout import AgentEnv, Trajectory, group_stats, rollout, score_group
from retrograd.agent.tools import ToolBox
from retrograd.algorithms.base import GeneratorFactory
from retrograd.algorithms.grpo import GRPO, Rollout
from retrograd.config import ConfigError
from retrograd.context import RunContext
from retrograd.data.batching import Group, train_and_eval
from retrograd.generation.llama import SamplingParams
from retrograd.losses.pg import group_advantages
from retrograd.run_setup import config_label


class _Loaded:
    """What train_and_eval wants of a loader's report."""

    def __init__(self, path: Path, n: int) -> None:
        self.path, self.n = path, n

    def summary(self) -> str:
        return f"{self.n} scenarios from {self.path}"


def load_scenarios(run: RunContext) -> tuple[list, list]:
    cfg = run.cfg
    if cfg.agent.scenarios is None:
        raise ConfigError(f"{config_label(cfg)}: [agent].scenarios is required for agent_grpo")

    def load(path: Path):
        items = sc_mod.load(path)
        return items, _Loaded(path, len(items))
    return train_and_eval(cfg, load, "scenarios", run.notes, train=Path(cfg.agent.scenarios))


def make_env(run: RunContext, gen, toolbox: ToolBox) -> AgentEnv:
    a = run.cfg.agent
    workdir = Path(tempfile.mkdtemp(prefix="retrograd-agent-"))
    return AgentEnv(gen, run.chat, toolbox, a.system_prompt, a.max_turns, a.state_template, workdir)


class AgentGRPO(GRPO):
    resample_together = True

    def __init__(self, run: RunContext, generators: GeneratorFactory | None = None) -> None:
        self.toolbox = ToolBox.from_config(run.cfg)
        try:
            super().__init__(run, generators)
            self.env = make_env(run, self.gen, self.toolbox)
            unverified = [s for s in self.train_prompts + self.eval_prompts if s.verify is None]
            self.judge = build_judge(run.cfg, self.gen, run.chat, required=bool(unverified),
                                     example=unverified[0] if unverified else None)
        except BaseException:
            self.toolbox.close()
            raise

    def context_size(self) -> int:
        return self.run.cfg.model.ctx           # whole conversations: prompt, turns and tool results

    def build_rewards(self) -> list:
        return []                     # verify and the judge score conversations

    def load_items(self) -> tuple[list, list]:
        return load_scenarios(self.run)

    def sampling(self, seeds) -> list[SamplingParams]:
        g, a = self.g, self.run.cfg.agent
        return [SamplingParams(g.temperature, g.top_p, g.top_k, a.max_new_tokens, int(s), tuple(g.stop)) for s in seeds]

    def _rollout(self) -> Rollout:
        """Every group of the step in one rollout (one batch per turn for all of them); then, up to
        [grpo].resample_zero_groups times, the groups whose rewards were all equal (no signal) are
        replaced by fresh scenarios, again rolled out together."""
        g, a = self.run.cfg.grpo, self.run.cfg.agent
        t0 = time.monotonic()
        swap_s = self.sync_adapter()
        chosen = list(self.stream.take(n=g.prompts_per_step))
        kept_trajs: list[list[Trajectory]] = [[] for _ in chosen]
        todo, tool_s, resampled = list(range(len(chosen))), 0.0, 0
        for attempt in range(g.resample_zero_groups + 1):
            if attempt:
                resampled += len(todo)
                for pi, scenario in zip(todo, self.stream.take(n=len(todo))):
                    chosen[pi] = scenario
            scen, params, ids = [], [], []
            for pi in todo:
                scen += [chosen[pi]] * g.group_size
                params += self.sampling(self.seeds(pi, attempt, n=g.group_size))
                ids += [f"{self.rollout_index}-{pi}-{attempt}-{k}" for k in range(g.group_size)]
            trajs = rollout(self.env, scen, params, ids)
            tool_s += max(t.tool_seconds for t in trajs)
            for j, pi in enumerate(todo):
                kept_trajs[pi] = trajs[j * g.group_size:(j + 1) * g.group_size]
                score_group(kept_trajs[pi], self.judge, a.tool_use_reward, a.unfinished_penalty,
                            a.tool_error_penalty)
            todo = [pi for pi in todo if len({t.reward for t in kept_trajs[pi]}) == 1]
            if not todo:
                break
        groups, lengths, slogp, owners, rewards, every = [], [], [], [], [], []
        zero = 0
        for pi, trajs in enumerate(kept_trajs):
            zero += len({t.reward for t in trajs}) == 1
            every += trajs
            kept = [t for t in trajs if t.n_trained]
            for t in kept:
                mask = np.asarray(t.trained, bool)
                lengths.append(int(mask.sum()))
                slogp.append(np.asarray(t.sample_logp, np.float64))
                owners.append(pi)
                rewards.append(t.reward)
            if kept:
                groups.append(Group(np.asarray(kept[0].prompt, np.int32),
                                    [np.asarray(t.tokens, np.int32) for t in kept],
                                    [np.asarray(t.trained, bool) for t in kept]))
        self.rollout_index += 1
        r = np.asarray(rewards, np.float64)
        adv = group_advantages(r, np.asarray(owners), scale=g.scale_rewards and g.loss != "dr_grpo")
        stats = {"reward_mean": float(r.mean()) if len(r) else 0.0, "reward_std": float(r.std()) if len(r) else 0.0,
                 "zero_signal_groups": float(zero), "resampled_groups": float(resampled),
                 "completion_len": float(np.mean(lengths)) if lengths else 0.0,
                 **group_stats(every), "gen_s": time.monotonic() - t0 - tool_s, "tool_s": tool_s}
        return Rollout(groups, adv, np.asarray(lengths, np.float64), slogp, stats=stats, swap_s=swap_s)

    def evaluate(self) -> dict[str, float]:
        """Greedy conversations on the held-out scenarios: reward, verify pass rate, turns, tool use."""
        if not self.eval_prompts:
            return {}
        limit = min(len(self.eval_prompts), self.run.cfg.evaluation.limit or self.g.eval_prompts)
        self.sync_adapter()
        trajs = evaluate_scenarios(self.env, self.eval_prompts[:limit], self.judge, self.gen.n_seq,
                                   self.run.cfg.agent.max_new_tokens, self.run.cfg.run.seed)
        st = group_stats(trajs)
        out = {"eval_reward": float(np.mean([t.reward for t in trajs]))}
        for k in ("verify_pass", "judge_score", "turns", "tool_success"):
            if k in st:
                out[f"eval_{k}"] = st[k]
        return out

    def close(self) -> None:
        super().close()
        self.toolbox.close()


def evaluate_scenarios(env: AgentEnv, scenarios: list, judge, batch: int, max_new_tokens: int,
                       seed: int) -> list[Trajectory]:
    """One greedy conversation per scenario, `batch` scenarios per generation batch."""
    out: list[Trajectory] = []
    for s in range(0, len(scenarios), batch):
        chunk = scenarios[s:s + batch]
        params = [SamplingParams(0.0, 1.0, 0, max_new_tokens, seed + s + i) for i in range(len(chunk))]
        trajs = rollout(env, chunk, params, [f"eval-{s + i}" for i in range(len(chunk))])
        for t in trajs:
            score_group([t], judge)
        out += trajs
    return out
