"""`retrograd tools list CONFIG [--json] [--no-connect]`: the configuration's tool servers and their tools.

Without --no-connect every server is started (one at a time, so that a broken one does not hide the others) and
its tools are printed with their JSON schemas; a server that cannot start is reported in its place and the
command exits 1. Two servers offering one tool name exit 2, as a ToolBox would refuse them. --json prints one
JSON object: {"config": ..., "servers": [{"name", "transport", "command" | "url" | "functions", ...,
"tools": [{"name", "description", "input_schema"}] or "error"}], "clashes": {...}}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from retrograd.commands import Subparsers, load_config, one_action
from retrograd.config import Config
from retrograd.errors import RetrogradError


def add_parser(sub: Subparsers) -> None:
    t = one_action(sub, "tools", "list", "list the tool servers of an agentic configuration and their tools",
                   "List the tool servers of [agent] ([[agent.servers]]: MCP servers over stdio or streamable "
                   "HTTP, or Python functions) and, unless --no-connect, start each one and list its tools with "
                   "their JSON schemas.",
                   "the configured servers and their tools", "run configuration (TOML) with an [agent] section")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.add_argument("--no-connect", action="store_true", help="only the configuration: start no server")
    t.set_defaults(run=run)


def _listing(cfg: Config, connect: bool) -> tuple[dict, int]:
    from retrograd.agent.tools import ToolBox, parse_servers
    from retrograd.run_setup import config_dir, config_label

    label = config_label(cfg)
    specs = parse_servers(cfg.agent.servers, config_dir(cfg), label)
    out: dict[str, Any] = {"config": label, "servers": []}
    status = 0
    offered: dict[str, list[str]] = {}
    for spec in specs:
        entry = spec.describe()
        entry.setdefault("timeout_seconds", cfg.agent.tool_timeout_seconds)
        if connect:
            try:
                with ToolBox([spec], label=label, timeout_seconds=cfg.agent.tool_timeout_seconds,
                             output_chars=cfg.agent.tool_output_chars) as box:
                    entry["tools"] = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
                                      for t in box.tools()]
            except RetrogradError as exc:
                entry["error"] = str(exc)
                status = max(status, 1)
            for t in entry.get("tools", []):
                offered.setdefault(t["name"], []).append(spec.name)
        out["servers"].append(entry)
    clashes = {name: servers for name, servers in offered.items() if len(servers) > 1}
    if clashes:
        out["clashes"] = clashes
        status = 2
    return out, status


def _signature(tool: dict) -> str:
    schema = tool.get("input_schema") or {}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    args = []
    for name, sub in props.items():
        kind = sub.get("type", "any") if isinstance(sub, dict) else "any"
        args.append(f"{name}{'' if name in required else '?'}: {kind if isinstance(kind, str) else '|'.join(kind)}")
    return f"{tool['name']}({', '.join(args)})"


def _print_text(listing: dict, connect: bool) -> None:
    print(f"config {listing['config']}")
    if not listing["servers"]:
        print("no tool servers: the configuration has no [[agent.servers]]")
        return
    for s in listing["servers"]:
        if s["transport"] == "stdio":
            where = " ".join(s["command"]) + f"  (cwd {s['cwd']})"
        elif s["transport"] == "http":
            where = s["url"]
        else:
            where = ", ".join(s["functions"])
        extra = f", env {', '.join(s['env'])}" if s.get("env") else ""
        print(f"\nserver {s['name']}  {s['transport']}  {where}  [timeout {s['timeout_seconds']:g} s{extra}]")
        if not connect:
            continue
        if "error" in s:
            print("  error: " + s["error"].replace("\n", "\n    "))
            continue
        print(f"  {len(s['tools'])} tool{'s' if len(s['tools']) != 1 else ''}")
        for t in s["tools"]:
            print(f"  {_signature(t)}")
            if t["description"]:
                for line in t["description"].splitlines():
                    print(f"      {line}")
            print("      schema " + json.dumps(t["input_schema"], ensure_ascii=False))
    for name, servers in listing.get("clashes", {}).items():
        print(f"\nerror: tool {name!r} is offered by several servers: {', '.join(servers)} (tool names must be unique)",
              file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    # only the tool servers matter here: the model, adapter and data need not exist yet
    cfg = load_config(args, reads=())
    connect = not getattr(args, "no_connect", False)
    listing, status = _listing(cfg, connect)
    if getattr(args, "json", False):
        print(json.dumps(listing, indent=2, ensure_ascii=False))
    else:
        _print_text(listing, connect)
    return status
