"""The group-relative judge: for scenarios without a verify, one request per group shows the judge
the task, the rubric and every attempt side by side, and asks for a score in [0, 1] and a reason
per attempt. Seeing the group at once lets the judge rank attempts against each other, which is
all GRPO's advantages need.

Backed by any OpenAI-compatible endpoint ([agent.judge].base_url; a `retrograd serve` process is
one) or a local GGUF through retrograd's own generation engine ([agent.judge].local_model). Judge
output is read leniently (a JSON object, a JSON list, or "attempt N: score" lines; 0-10 scales are
rescaled); an attempt the judge left unscored after the retries scores 0 with that reason, and is
counted in `Judge.failures`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal, overload

from retrograd.agent import endpoint
from retrograd.config import Config, JudgeSection
from retrograd.errors import ConfigError
from retrograd.run_setup import config_label

INSTRUCTIONS = (
    "You are grading {n} attempts at the same task. Rubric: {rubric}\n\n"
    "Task: {task}\n\n{attempts}\n\n"
    "Compare the attempts with each other. Answer with JSON only, one entry per attempt:\n"
    '{{"scores": [{{"attempt": 1, "score": 0.0, "reason": "..."}}, ...]}}\n'
    "Scores are numbers from 0 (fails the task) to 1 (completes it fully and correctly)."
)


def judge_prompt(task: str, transcripts: list[str], rubric: str) -> str:
    attempts = "\n\n".join(f"### Attempt {i + 1}\n{t}" for i, t in enumerate(transcripts))
    return INSTRUCTIONS.format(n=len(transcripts), rubric=rubric, task=task, attempts=attempts)


def _clip(v: float, scale10: bool) -> float:
    v = v / 10.0 if scale10 else v
    return min(1.0, max(0.0, v))


def parse_scores(text: str, n: int) -> list[tuple[float, str] | None]:
    """Scores per attempt from a judge's answer; None where the judge gave none."""
    found: dict[int, tuple[float, str]] = {}
    entries = None
    m = re.search(r"\{.*\}|\[.*\]", text, re.S)
    if m:
        try:
            obj = json.loads(m.group(0))
            entries = obj.get("scores") if isinstance(obj, dict) else obj
        except json.JSONDecodeError:
            entries = None
    if isinstance(entries, list):
        for pos, e in enumerate(entries):
            if isinstance(e, (int, float)) and not isinstance(e, bool):
                found[pos] = (float(e), "")
            elif isinstance(e, dict) and isinstance(e.get("score"), (int, float)) and not isinstance(e["score"], bool):
                idx = e.get("attempt", pos + 1)
                idx = int(idx) - 1 if isinstance(idx, (int, float)) and not isinstance(idx, bool) else pos
                found[idx] = (float(e["score"]), str(e.get("reason", ""))[:300])
    if not found:
        for line in text.splitlines():
            lm = re.match(r"\s*(?:attempt\s*)?#?(\d+)\s*[:.)\-]\s*(?:score\s*[:=]?\s*)?(-?\d+(?:\.\d+)?)(.*)", line, re.I)
            if lm:
                found[int(lm.group(1)) - 1] = (float(lm.group(2)), lm.group(3).strip(" -:,")[:300])
    scale10 = any(v > 1.0 for v, _ in found.values())
    return [(_clip(found[i][0], scale10), found[i][1]) if i in found else None for i in range(n)]


class Judge:
    """Scores a group of transcripts of one task; subclasses say how the judge model is asked."""

    def __init__(self, cfg: JudgeSection) -> None:
        self.cfg = cfg
        self.failures = 0

    def ask(self, prompt: str, attempt: int) -> str:
        raise NotImplementedError

    def score_texts(self, task: str, transcripts: list[str]) -> list[tuple[float, str]]:
        prompt = judge_prompt(task, transcripts, self.cfg.rubric)
        got: list[tuple[float, str] | None] = [None] * len(transcripts)
        for attempt in range(self.cfg.retries + 1):
            for i, v in enumerate(parse_scores(self.ask(prompt, attempt), len(transcripts))):
                if got[i] is None:
                    got[i] = v
            if all(g is not None for g in got):
                break
        out = []
        for g in got:
            if g is None:
                self.failures += 1
                out.append((0.0, "the judge gave no readable score"))
            else:
                out.append(g)
        return out

    def score(self, scenario, trajs) -> list[tuple[float, str]]:
        from retrograd.agent.rollout import conversation_text

        return self.score_texts(scenario.task, [conversation_text(t) for t in trajs])


class ApiJudge(Judge):
    def ask(self, prompt: str, attempt: int) -> str:
        msg = endpoint.chat(self.cfg, [{"role": "user", "content": prompt}], seed=attempt, where="[agent.judge]",
                            temperature=self.cfg.temperature if attempt == 0 else max(self.cfg.temperature, 0.7))
        return str(msg.get("content") or "")


class LocalJudge(Judge):
    """A GGUF judge run by our generation engine (no adapter)."""

    def __init__(self, cfg: JudgeSection, ctx: int, threads: int | None = None, device: str = "auto") -> None:
        super().__init__(cfg)
        from retrograd.data.chat import format_for
        from retrograd.generation.llama import Generator

        if cfg.local_model is None:
            raise ConfigError("[agent.judge]: a local judge needs local_model (a GGUF)")
        self.gen = Generator(Path(cfg.local_model), n_ctx=ctx, threads=threads, device=device)
        self.chat = format_for(self.gen.tokenizer)

    def ask(self, prompt: str, attempt: int) -> str:
        from retrograd.generation.conversation import encode_prompt
        from retrograd.generation.llama import SamplingParams

        ids = encode_prompt(self.gen.tokenizer, self.chat, [{"role": "user", "content": prompt}])
        ids = ids[-(self.gen.n_ctx - self.cfg.max_tokens - 1):]
        temp = self.cfg.temperature if attempt == 0 else max(self.cfg.temperature, 0.7)
        out = self.gen.generate(ids, [SamplingParams(temp, 1.0, 0, self.cfg.max_tokens, attempt)])[0]
        return out.text


@overload
def build_judge(cfg: Config, gen=None, chat=None, *, required: Literal[True], example=None) -> Judge: ...


@overload
def build_judge(cfg: Config, gen=None, chat=None, *, required: bool = False, example=None) -> Judge | None: ...


def build_judge(cfg: Config, gen=None, chat=None, *, required: bool = False, example=None) -> Judge | None:
    """The configured judge, or None when none is configured (an error when `required`: a scenario
    without a verify needs one)."""
    j = cfg.agent.judge
    label = config_label(cfg)
    if j.base_url:
        endpoint.check(j, f"{label}: [agent.judge]")
        return ApiJudge(j)
    if j.local_model:
        from retrograd.run_setup import resolve_threads

        return LocalJudge(j, cfg.model.ctx, resolve_threads(cfg), cfg.model.device)
    if required:
        where = f" (scenario {example.id!r}, {example.source}:{example.line})" if example is not None else ""
        raise ConfigError(f"{label}: some scenarios have no verify{where}, so they need a judge: set "
                          "[agent.judge].base_url (an OpenAI-compatible endpoint, e.g. a `retrograd serve`) or "
                          "[agent.judge].local_model (a GGUF)")
    return None
