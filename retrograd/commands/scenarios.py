"""`retrograd scenarios generate CONFIG [--dry-run] [--force]`: an LLM writes [agent].generate_count
scenarios for the configured tools into [agent].scenarios. The model is the [agent.collect_api]
endpoint when one is configured, else the configuration's own model. Every candidate is checked
before anything is written — a JSON object with a task, a valid verify spec (agent/verify.py),
only tools that exist, not a duplicate — and the file is written atomically once enough passed.
--dry-run prints the prompt and the plan and calls nothing; an existing file needs --force.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
from pathlib import Path

from retrograd.commands import Subparsers, load_config, one_action
from retrograd.config import Config
from retrograd.errors import ConfigError, RetrogradError, UsageError
from retrograd.fsutil import atomic_write
from retrograd.run_setup import config_label, resolve_model, resolve_threads

PER_REQUEST = 5

PROMPT = """You write test scenarios for an assistant that uses tools. The tools, as JSON schemas:
{catalog}
{state}
Write {n} new, diverse scenarios, one JSON object per line and nothing else:
{{"task": "<what a user asks, self-contained>", "tools": ["<tools a good answer uses>"], "verify": <check>}}
where <check> tests the outcome: {{"answer_contains": "<text the final answer must contain>"}},
{{"answer_equals": "<exact answer>"}}, {{"answer_matches": "<regex>"}}{sql_hint}.
Vary the tools and the wording. Do not repeat these tasks:
{existing}"""


def add_parser(sub: Subparsers) -> None:
    t = one_action(sub, "scenarios", "generate", "have an LLM write scenarios for the configured tools",
                   "`scenarios generate` asks an LLM ([agent.collect_api], else the configuration's model) for "
                   "[agent].generate_count diverse scenarios that use the configured tools, with verify specs "
                   "where it can, checks each one (task, verify spec, tools exist, no duplicates) and writes them "
                   "to [agent].scenarios.",
                   "write [agent].scenarios", "an agent_grpo configuration (TOML)")
    t.add_argument("--dry-run", action="store_true", help="print the prompt and the plan; call nothing")
    t.add_argument("--force", action="store_true", help="overwrite an existing scenarios file")
    t.set_defaults(run=run)


def state_schema(template: Path | None) -> str:
    """The SQL schema of an SQLite state template, for the prompt (empty for other state)."""
    if template is None or not Path(template).is_file():
        return ""
    try:
        con = sqlite3.connect(f"file:{template}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError:
        return ""
    return "The tools work on an SQLite database with this schema:\n" + "\n".join(r[0] for r in rows) + "\n"


def candidates(text: str) -> list[dict]:
    """Every JSON object on its own line of an LLM's answer (fences and prose are skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        m = re.search(r"\{.*\}", line)
        if not m:
            continue
        try:
            obj = json.loads(m.group(0))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def problem(obj: dict, tool_names: set[str], seen: set[str], base: Path) -> str | None:
    """Why a candidate cannot be used, or None."""
    from retrograd.agent import verify

    task = obj.get("task")
    if not isinstance(task, str) or len(task.strip()) < 8:
        return "no task"
    key = " ".join(task.lower().split())
    if key in seen:
        return "duplicate"
    unknown = [t for t in obj.get("tools") or [] if t not in tool_names]
    if unknown:
        return f"unknown tools {unknown}"
    if obj.get("verify") is not None:
        why = verify.spec_problem(obj["verify"], base)
        if why:
            return f"bad verify: {why}"
    return None


class _Writer:
    """The model that writes scenarios: the collect_api endpoint or the local model."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.api = bool(cfg.agent.collect_api.base_url)
        if not self.api:
            from retrograd.data.chat import format_for
            from retrograd.generation.llama import Generator

            self.gen = Generator(resolve_model(cfg), n_ctx=cfg.model.ctx, threads=resolve_threads(cfg),
                                 device=cfg.model.device)
            self.chat = format_for(self.gen.tokenizer, cfg.model.chat_template)

    def describe(self) -> str:
        ep = self.cfg.agent.collect_api
        return f"the endpoint {ep.base_url} (model {ep.model or 'default'})" if self.api else \
            f"the local model {resolve_model(self.cfg).name}"

    def ask(self, prompt: str, seed: int) -> str:
        if self.api:
            from retrograd.agent import endpoint

            msg = endpoint.chat(self.cfg.agent.collect_api, [{"role": "user", "content": prompt}], seed=seed,
                                temperature=max(self.cfg.agent.collect_api.temperature, 0.8),
                                where="[agent.collect_api]")
            return str(msg.get("content") or "")
        from retrograd.generation.conversation import encode_prompt
        from retrograd.generation.llama import SamplingParams

        ids = encode_prompt(self.gen.tokenizer, self.chat, [{"role": "user", "content": prompt}])
        room = self.gen.n_ctx - len(ids) - 1
        if room < 64:
            raise RetrogradError(f"the scenario prompt ({len(ids)} tokens) does not fit [model].ctx = {self.gen.n_ctx}")
        return self.gen.generate(ids, [SamplingParams(0.9, 0.95, 0, min(1024, room), seed)])[0].text


def run(args: argparse.Namespace) -> int:
    from retrograd.agent.tools import ToolBox

    # it writes the scenarios, and a local writer is the base model (no adapter)
    cfg = load_config(args, reads=("model.path",))
    a = cfg.agent
    if a.scenarios is None:
        raise ConfigError(f"{config_label(cfg)}: [agent].scenarios names the file to write; it is not set")
    out = Path(a.scenarios)
    if out.exists() and not args.force and not args.dry_run:
        raise UsageError(f"{out} exists (pass --force to overwrite it)")
    with ToolBox.from_config(cfg) as box:
        tools = box.openai_tools()
    names = {t["function"]["name"] for t in tools}
    catalog = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    schema = state_schema(a.state_template)
    sql_hint = (', or {"sql": "<SELECT returning a true first column when the database ends as it should>"}'
                if schema else "")

    def prompt(n: int, existing: list[str]) -> str:
        return PROMPT.format(catalog=catalog, state=schema, n=n, sql_hint=sql_hint,
                             existing="\n".join(f"- {t}" for t in existing[-30:]) or "(none yet)")

    requests = -(-a.generate_count // PER_REQUEST)
    if args.dry_run:
        print(prompt(min(PER_REQUEST, a.generate_count), []))
        who = "the [agent.collect_api] endpoint" if a.collect_api.base_url else "the local model"
        print(f"\nplan: {a.generate_count} scenarios into {out}, about {requests} requests of {PER_REQUEST} (at most "
              f"{3 * requests}), written by {who}; each checked (task, verify spec, tools exist, no duplicate) "
              "before the file is written. Nothing was called.")
        return 0
    writer = _Writer(cfg)
    kept: list[dict] = []
    seen: set[str] = set()
    rejected: dict[str, int] = {}
    for attempt in range(3 * requests):
        if len(kept) >= a.generate_count:
            break
        for obj in candidates(writer.ask(prompt(PER_REQUEST, [k["task"] for k in kept]), a.seed + attempt)):
            why = problem(obj, names, seen, out.parent)
            if why:
                rejected[why.split(":")[0]] = rejected.get(why.split(":")[0], 0) + 1
                continue
            seen.add(" ".join(obj["task"].lower().split()))
            kept.append({k: obj[k] for k in ("task", "verify", "answer", "tools") if obj.get(k) is not None})
            if len(kept) >= a.generate_count:
                break
    if not kept:
        raise RetrogradError(f"{writer.describe()} wrote no usable scenario in {3 * requests} requests "
                             f"(rejected: {rejected or 'nothing parseable'})")
    atomic_write(out, "".join(json.dumps(k, ensure_ascii=False) + "\n" for k in kept))
    print(f"wrote {len(kept)} scenarios to {out} (asked {writer.describe()})"
          + (f"; rejected {', '.join(f'{k} {v}' for k, v in rejected.items())}" if rejected else ""))
    if len(kept) < a.generate_count:
        print(f"note: {a.generate_count} were asked for; run again with --force for another try")
    return 0
