"""`[[agent.servers]]` tables: validation into `ServerSpec`s (messages name `[agent.servers][i].key`, i from 0).

Each table has `name` (required, unique, [a-z0-9_-]) and exactly one of `command` (a list of strings: an MCP
server over stdio; the token "{python}" stands for the running interpreter), `url` (a streamable HTTP MCP
server) or `functions` (a list of "file.py:function" Python tools, files relative to the config's directory);
optionally `env` (a table of strings) and `cwd` (command servers only; cwd defaults to the config's directory)
and `timeout_seconds` (overrides [agent].tool_timeout_seconds for this server's calls).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrograd.agent import pyfunc
from retrograd.errors import ConfigError

SERVER_KEYS = ("name", "command", "url", "functions", "env", "cwd", "timeout_seconds")
_NAME = re.compile(r"^[a-z0-9_-]+$")


@dataclass
class ServerSpec:
    """One validated `[[agent.servers]]` table. `transport` is "stdio" (command), "http" (url) or "python"
    (functions); `command` has "{python}" replaced; `cwd` is absolute (stdio: default the config's directory)."""

    name: str
    transport: str
    command: list[str] = field(default_factory=list)
    url: str | None = None
    functions: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    timeout_seconds: float | None = None
    base: Path = field(default_factory=Path.cwd)
    where: str = "[agent.servers]"

    def describe(self) -> dict:
        """A JSON-friendly summary (env values are left out: they may be secrets)."""
        out: dict[str, Any] = {"name": self.name, "transport": self.transport}
        if self.transport == "stdio":
            out["command"] = list(self.command)
            out["cwd"] = str(self.cwd) if self.cwd else None
            if self.env:
                out["env"] = sorted(self.env)
        elif self.transport == "http":
            out["url"] = self.url
        else:
            out["functions"] = list(self.functions)
        if self.timeout_seconds is not None:
            out["timeout_seconds"] = self.timeout_seconds
        return out


def parse_servers(tables: Any, base: Path, label: str = "<config>") -> list[ServerSpec]:
    """Validate `[agent].servers` (a list of tables); `base` is where relative paths resolve. ConfigError names
    `[agent.servers][i].key` (i counts from 0)."""
    if tables is None:
        return []
    if not isinstance(tables, list):
        raise ConfigError(f"{label}: [agent].servers: expected a list of tables ([[agent.servers]]), got {tables!r}")
    out: list[ServerSpec] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(tables):
        spec = _parse_one(t, i, Path(base), label)
        if spec.name in seen:
            raise ConfigError(f"{label}: [agent.servers][{i}].name: {spec.name!r} is already the name of "
                              f"[agent.servers][{seen[spec.name]}]")
        seen[spec.name] = i
        out.append(spec)
    return out


def _parse_one(t: Any, i: int, base: Path, label: str) -> ServerSpec:
    where = f"[agent.servers][{i}]"

    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{label}: {where}.{key}: {msg}" if key else f"{label}: {where}: {msg}")

    if not isinstance(t, dict):
        raise bad("", f"expected a table, got {t!r}")
    for key in t:
        if key not in SERVER_KEYS:
            raise bad(key, f"unknown key; expected one of {', '.join(SERVER_KEYS)}")
    name = t.get("name")
    if name is None:
        raise bad("name", "missing (every server needs a name)")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad("name", f"expected lower-case letters, digits, '_' or '-', got {name!r}")
    kinds = [k for k in ("command", "url", "functions") if k in t]
    if len(kinds) != 1:
        got = f"got {' and '.join(kinds)}" if kinds else "got none"
        raise bad("", f"expected exactly one of command (stdio MCP), url (HTTP MCP) or functions (Python), {got}")
    kind = kinds[0]
    spec = ServerSpec(name=name, transport={"command": "stdio", "url": "http", "functions": "python"}[kind],
                      base=base, where=where)
    for key in ("env", "cwd"):
        if key in t and kind != "command":
            raise bad(key, f"only for command (stdio) servers, not {kind}")
    if kind == "command":
        cmd = t["command"]
        if not isinstance(cmd, list) or not cmd or not all(isinstance(c, str) and c for c in cmd):
            raise bad("command", f"expected a list of strings (program first), got {cmd!r}")
        spec.command = [c.replace("{python}", sys.executable) for c in cmd]
        env = t.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise bad("env", f"expected a table of strings, got {env!r}")
        spec.env = dict(env)
        cwd = t.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not cwd):
            raise bad("cwd", f"expected a path (string), got {cwd!r}")
        path = Path(cwd).expanduser() if cwd else Path(".")
        spec.cwd = (path if path.is_absolute() else base / path).resolve()
        if not spec.cwd.is_dir():
            raise bad("cwd", f"not a directory: {spec.cwd}")
    elif kind == "url":
        url = t["url"]
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
            raise bad("url", f"expected an http:// or https:// URL, got {url!r}")
        spec.url = url
    else:
        funcs = t["functions"]
        if not isinstance(funcs, list) or not funcs or not all(isinstance(f, str) for f in funcs):
            raise bad("functions", f"expected a list of \"file.py:function\" strings, got {funcs!r}")
        for j, ref in enumerate(funcs):
            try:
                path = pyfunc.resolve_file(ref, base)
            except pyfunc.FunctionRefError as exc:
                raise bad(f"functions[{j}]", str(exc)) from None
            if not path.is_file():
                raise bad(f"functions[{j}]", f"no such file: {path}")
        spec.functions = list(funcs)
    if "timeout_seconds" in t:
        v = t["timeout_seconds"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise bad("timeout_seconds", f"expected a number > 0, got {v!r}")
        spec.timeout_seconds = float(v)
    return spec
