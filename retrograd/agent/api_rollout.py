"""Rollouts through an OpenAI-compatible endpoint instead of a local model (`collect --api`): the
endpoint writes each turn, with structured tool calls; the tools run here, on the rollout's own
state copy, exactly as in local rollouts. No model is loaded."""

from __future__ import annotations

from pathlib import Path

from retrograd.agent import endpoint
from retrograd.agent.rollout import Trajectory
from retrograd.agent.scenarios import Scenario
from retrograd.agent.tools import ToolBox
from retrograd.agent.verify import fresh_state
from retrograd.config import EndpointSection
from retrograd.generation.conversation import tool_message


def rollout_api(ep: EndpointSection, toolbox: ToolBox, scenario: Scenario, *, seed: int, rid: str,
                system_prompt: str, max_turns: int, state_template: Path | None, workdir: Path) -> Trajectory:
    tools = toolbox.openai_tools()
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": scenario.task}]
    t = Trajectory(scenario, msgs, [], state=fresh_state(state_template, workdir, rid))
    for turn in range(max_turns):
        reply = endpoint.chat(ep, t.messages, tools=tools, seed=seed + turn, where="[agent.collect_api]")
        t.turns += 1
        calls = reply.get("tool_calls") or []
        msg = {"role": "assistant", "content": reply.get("content")}
        if calls:
            msg["tool_calls"] = calls
        elif msg["content"] is None:
            msg["content"] = ""
        t.messages.append(msg)
        t.raw.append(str(reply.get("content") or ""))
        if not calls:
            t.finish, t.answer = "answer", str(reply.get("content") or "").strip()
            return t
        # the ToolBox parses the JSON arguments and answers a malformed one with a tool error
        batch = [(c.get("function", {}).get("name", ""), c.get("function", {}).get("arguments") or "{}", t.state)
                 for c in calls]
        for c, r in zip(calls, toolbox.call_many(batch)):
            t.tool_calls += 1
            if r.is_error:
                t.causes[f"tool:{r.cause}"] += 1
            else:
                t.tool_ok += 1
            t.messages.append(tool_message(c.get("id", "call"), r.name, r.text))
    t.finish = "max_turns"
    return t
