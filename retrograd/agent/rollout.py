"""Multi-turn rollouts with tools: a scenario becomes a conversation — the task under the model's
chat template with the tool catalog, a generated turn, its tool calls run, their results sent
back — until the model answers without calling a tool, runs out of turns, or out of context.

A group of conversations (one scenario, k attempts) is generated as one batch per turn, each with
a fresh copy of the environment's state. The token sequence each conversation leaves behind is
exactly what the model saw while it generated: the prompt, then its own sampled tokens (trained)
and the rendered tool results and next-turn headers between them (context only, masked). So the
policy update scores the same tokens in the same context, and `logp_gap` stays meaningful.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrograd.agent.scenarios import Scenario
from retrograd.agent.tools import ToolBox
from retrograd.agent.verify import discard_state, fresh_state
from retrograd.data.chat import ChatFormat
from retrograd.generation.conversation import Reply, prompt_text, read_reply, tool_message
from retrograd.generation.llama import Completion, Generator, SamplingParams

#: why a conversation ended
FINISHES = ("answer", "max_turns", "context", "truncated_turn")


@dataclass
class Trajectory:
    """One conversation: its messages, and the tokens after the prompt with what is trained."""

    scenario: Scenario
    messages: list[dict]
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)      # everything after the prompt
    trained: list[bool] = field(default_factory=list)    # per token: the model's own (True) or context
    sample_logp: list[float] = field(default_factory=list)  # llama.cpp's log-prob of each trained token
    finish: str = "answer"
    answer: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_ok: int = 0
    causes: Counter = field(default_factory=Counter)    # malformed_call, unknown_tool, tool:<cause>
    raw: list[str] = field(default_factory=list)         # each assistant turn's text as generated
    state: Path | None = None
    tool_seconds: float = 0.0
    reward: float = 0.0
    verified: bool | None = None                         # None: the scenario has no verify
    detail: str = ""
    judge: float | None = None

    @property
    def complete(self) -> bool:
        return self.finish == "answer"

    @property
    def n_trained(self) -> int:
        return int(sum(self.trained))


@dataclass
class AgentEnv:
    """What rollouts need: the generator, how to render and read turns, the tools."""

    gen: Generator
    chat: ChatFormat
    toolbox: ToolBox
    system_prompt: str = ""
    max_turns: int = 6
    state_template: Path | None = None
    workdir: Path | None = None

    @property
    def tools(self) -> list[dict]:
        return self.toolbox.openai_tools()

    def first_messages(self, scenario: Scenario) -> list[dict]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": scenario.task}]

    def prompt_tokens(self, scenario: Scenario) -> list[int]:
        return self.chat.encode(self.gen.tokenizer, prompt_text(self.chat, self.first_messages(scenario), self.tools))


def _delta_text(before: str, after: str, eog_text: str) -> str:
    """What the template adds after the model's turn (tool results, the next turn's header): the
    text of `after` beyond `before`, counted from the end of the model's end-of-turn token, whose
    own text the model already produced."""
    cut = before.rfind(eog_text) + len(eog_text) if eog_text and eog_text in before else len(before)
    base = before[:cut]
    if after.startswith(base):
        return after[len(base):]
    n = 0                                          # a template that rewrites earlier turns: where they part
    while n < min(len(before), len(after)) and before[n] == after[n]:
        n += 1
    return after[n:]


def rollout(env: AgentEnv, scenarios: list[Scenario], params: list[SamplingParams], ids: list[str]) -> list[Trajectory]:
    """One conversation per (scenario, sampling settings) pair, generated as one batch per turn: a
    GRPO group repeats one scenario, an evaluation batch holds different ones. Each conversation
    gets a fresh state copy named by ids[i]."""
    tok, chat, tools = env.gen.tokenizer, env.chat, env.tools
    prompts: dict[int, list[int]] = {}
    trajs = []
    for sc, i in zip(scenarios, ids):
        if id(sc) not in prompts:
            prompts[id(sc)] = env.prompt_tokens(sc)
        trajs.append(Trajectory(sc, env.first_messages(sc), list(prompts[id(sc)]),
                                state=fresh_state(env.state_template, env.workdir or Path("."), i)))
    active = list(range(len(params)))
    for _turn in range(env.max_turns):
        if not active:
            break
        seqs = [trajs[k].prompt + trajs[k].tokens for k in active]
        room = env.gen.n_ctx - max(len(s) for s in seqs) - 1
        turn_params = [SamplingParams(params[k].temperature, params[k].top_p, params[k].top_k,
                                      max(1, min(params[k].max_new_tokens, room)), params[k].seed + 7919 * _turn,
                                      params[k].stop) for k in active]
        outs = env.gen.generate_each(seqs, turn_params)
        pending: list[tuple[int, Reply, Completion]] = []
        for k, out in zip(list(active), outs):
            t = trajs[k]
            t.turns += 1
            toks, lps = out.trained()
            t.tokens += toks
            t.trained += [True] * len(toks)
            t.sample_logp += lps
            reply = read_reply(out.text, tools)
            t.messages.append(reply.message())
            t.raw.append(out.text)
            if out.end_token is None and out.finish_reason != "stop":
                t.finish = "truncated_turn" if len(t.prompt) + len(t.tokens) + 2 < env.gen.n_ctx else "context"
                active.remove(k)
                continue
            if not (reply.calls or reply.unknown or reply.malformed):
                t.finish, t.answer = "answer", out.text.strip()
                active.remove(k)
                continue
            pending.append((k, reply, out))
        _run_tools(env, trajs, pending)
        for k, reply, out in pending:
            t = trajs[k]
            n_calls = len(reply.calls) + len(reply.unknown) + (1 if reply.malformed and not reply.calls else 0)
            before = prompt_text(chat, t.messages[:len(t.messages) - n_calls], tools, add_generation_prompt=False)
            after = prompt_text(chat, t.messages, tools)
            eog = tok.token_text(out.end_token) if out.end_token is not None else ""
            delta = tok.encode(_delta_text(before, after, eog), add_bos=False, special=True)
            t.tokens += delta
            t.trained += [False] * len(delta)
            if len(t.prompt) + len(t.tokens) + 8 >= env.gen.n_ctx:
                t.finish = "context"
                active.remove(k)
    for k in active:
        trajs[k].finish = "max_turns"
    return trajs


def _run_tools(env: AgentEnv, trajs: list[Trajectory], pending: list[tuple[int, Reply, Completion]]) -> None:
    """Run every call of this turn (all conversations at once) and append the tool messages. Calls
    to unknown tools and unreadable calls get an error message back, so the model can recover."""
    calls, where = [], []
    for k, reply, _out in pending:
        t = trajs[k]
        for i, c in enumerate(reply.calls):
            calls.append((c.name, c.arguments, t.state))
            where.append((k, i, c.name))
    t0 = time.monotonic()
    results = env.toolbox.call_many(calls) if calls else []
    dt = time.monotonic() - t0
    by_conv: dict[int, list] = {}
    for (k, i, name), r in zip(where, results):
        by_conv.setdefault(k, []).append((i, name, r))
    for k, reply, _out in pending:
        t = trajs[k]
        t.tool_seconds += dt
        for i, name, r in by_conv.get(k, []):
            t.tool_calls += 1
            if r.is_error:
                t.causes[f"tool:{r.cause}"] += 1
            else:
                t.tool_ok += 1
            t.messages.append(tool_message(f"call_{i}", name, r.text))
        offered = ", ".join(sorted(s["function"]["name"] for s in env.tools))
        for c in reply.unknown:
            t.tool_calls += 1
            t.causes["unknown_tool"] += 1
            t.messages.append(tool_message(f"call_{len(reply.calls)}", c.name,
                                           f"error: there is no tool {c.name!r}; the tools are: {offered}"))
        if reply.malformed and not reply.calls:
            t.causes["malformed_call"] += 1
            t.messages.append(tool_message("call_0", "error", "error: the tool call could not be read ("
                                           + "; ".join(reply.malformed)[:300] + "); write it as JSON with "
                                           "\"name\" and \"arguments\""))


def failed_calls(t: Trajectory) -> int:
    """Tool calls that did not work: errors, unknown tools, and turns whose call could not be read."""
    return t.tool_calls - t.tool_ok + t.causes["malformed_call"]


def score_group(trajs: list[Trajectory], judge=None, tool_use_reward: float = 0.0,
                unfinished_penalty: float = 0.0, tool_error_penalty: float = 0.0) -> None:
    """Rewards: the scenario's verify where it has one (pass 1, fail 0), else the judge's score for
    the group (0 without a judge); then the shaping terms of [agent]: + tool_use_reward for a
    conversation with a successful tool call, - unfinished_penalty for one that ran out of turns
    or context without a final answer, - tool_error_penalty for each failed call. The penalties
    exist because without them a policy that loops on tool calls until it is cut off loses nothing
    against one that answers wrongly, and GRPO drifts into looping (docs/agentic.md). The state
    copies are discarded once verified."""
    unverified = []
    for t in trajs:
        if t.scenario.verify is not None:
            verdict = t.scenario.check(t.answer, t.state)
            t.verified, t.detail = verdict.passed, verdict.detail
            t.reward = float(verdict.score if verdict.score else (1.0 if verdict.passed else 0.0))
        else:
            unverified.append(t)
    if unverified and judge is not None:
        for t, (score, reason) in zip(unverified, judge.score(unverified[0].scenario, unverified)):
            t.judge, t.reward, t.detail = score, score, reason
    for t in trajs:
        if tool_use_reward and t.tool_ok:
            t.reward += tool_use_reward
        if unfinished_penalty and not t.complete:
            t.reward -= unfinished_penalty
        if tool_error_penalty:
            t.reward -= tool_error_penalty * failed_calls(t)
        discard_state(t.state)


def conversation_text(t: Trajectory, limit: int = 1500) -> str:
    """A compact transcript for a judge or a report."""
    lines = []
    for m in t.messages:
        if m["role"] == "system":
            continue
        if m.get("tool_calls"):
            calls = "; ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in m["tool_calls"])
            lines.append(f"assistant calls: {calls}")
        elif m["role"] == "tool":
            lines.append(f"tool {m.get('name', '')}: {str(m.get('content', ''))[:300]}")
        else:
            lines.append(f"{m['role']}: {m.get('content') or ''}")
    text = "\n".join(lines)
    return text if len(text) <= limit else text[:limit] + " ..."


def group_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """Metrics of a batch of trajectories, for the trainer's log and collect's report."""
    n = max(len(trajs), 1)
    calls = sum(t.tool_calls for t in trajs)
    out = {"turns": sum(t.turns for t in trajs) / n, "tool_calls": calls / n,
           "tool_success": sum(t.tool_ok for t in trajs) / calls if calls else 0.0,
           "tool_s": max((t.tool_seconds for t in trajs), default=0.0)}
    verified = [t for t in trajs if t.verified is not None]
    if verified:
        out["verify_pass"] = sum(bool(t.verified) for t in verified) / len(verified)
    judged = [t.judge for t in trajs if t.judge is not None]
    if judged:
        out["judge_score"] = float(np.mean(judged))
    for f in FINISHES:
        out[f"finish/{f}"] = sum(t.finish == f for t in trajs) / n
    causes: Counter = Counter()
    for t in trajs:
        causes.update(t.causes)
    for c, v in causes.items():
        out[f"count/{c}"] = float(v)
    return out


def messages_of(t: Trajectory, raw: bool = False) -> list[dict]:
    """The conversation as messages: structured (assistant tool_calls, tool results), or with each
    assistant turn's text exactly as generated (`raw`: only a student of the same family reads its
    call format back)."""
    if not raw or not t.raw:
        return [dict(m) for m in t.messages]
    out, turn = [], 0
    for m in t.messages:
        if m["role"] == "assistant" and turn < len(t.raw):
            out.append({"role": "assistant", "content": t.raw[turn]})
            turn += 1
        else:
            out.append(dict(m))
    return out


def to_record(t: Trajectory, tools: list[dict], raw: bool = False) -> dict:
    """A trajectory as a `tools` training record (SFT): messages plus the tool catalog."""
    return {"messages": messages_of(t, raw), "tools": tools}


def generated(outs: list[Completion]) -> int:
    return sum(len(o.tokens) for o in outs)
