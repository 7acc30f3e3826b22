"""Tools for agentic rollouts: `[[agent.servers]]` parsing and the `ToolBox`.

    [[agent.servers]]
    name = "notes"                                  # required, unique, [a-z0-9_-]
    command = ["{python}", "notes_server.py"]       # an MCP server over stdio ("{python}": this interpreter)
    # url = "http://127.0.0.1:8765/mcp"             # or a streamable HTTP MCP server
    # functions = ["tools.py:lookup"]               # or plain Python functions (files resolve against the config)
    env = { NOTES_DEBUG = "1" }                     # optional, command servers only (added to the SDK's safe env)
    cwd = "."                                       # optional, command servers only (default: the config's dir)
    timeout_seconds = 5                             # optional, overrides [agent].tool_timeout_seconds

A `ToolBox` starts every server once, lists their tools once (the catalog is fixed for its life), and answers
calls synchronously (the MCP sessions run on an asyncio loop in one background thread). Every call is bounded in
time (the server's timeout_seconds, else the ToolBox's) and in output size (cut to output_chars, ending with a
marker), and a failure of any kind is a `ToolResult` with `is_error=True` and a `cause` (one of CAUSES), counted
in `ToolBox.counts` (calls, ok, errors, each cause, truncated, restarts), never an exception. Arguments are checked
against the tool's JSON schema before a call ("bad_arguments"); unknown names are "unknown_tool". A stdio server
that dies or hangs is restarted (an HTTP one reconnected) once, on the next call to it; after that its tools
answer "server_died" at once (details in `retrograd.agent.mcp_client`). A Python tool runs in a daemon thread:
one that overruns its time is abandoned, not killed.

Per-rollout state: a call may carry its rollout's state path (made absolute here). MCP servers receive it in the
request's `_meta` under "retrograd/state" (`STATE_META_KEY`; an HTTP server must see the same filesystem);
Python function tools receive it as their `state` keyword argument (a Path, or None) when their signature has a
parameter named `state`, which is hidden from the tool's schema.

Servers are stopped by `close()` (or leaving the `with` block), at interpreter exit (atexit: this covers an
unhandled Ctrl-C), and on SIGTERM/SIGHUP (the ToolBox chains a handler in front of the previous one, when it is
created in the main thread). A stdio server also sees its stdin close if this process is killed outright.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd.agent import pyfunc
from retrograd.agent.mcp_client import STATE_META_KEY, STOP_SECONDS, LoopThread, McpServer, StartError
from retrograd.agent.servers import ServerSpec, parse_servers
from retrograd.errors import ConfigError, RetrogradError

__all__ = ["CAUSES", "STATE_META_KEY", "ServerSpec", "ToolBox", "ToolResult", "ToolSpec", "compact_schema",
           "function_schema", "parse_servers"]

CAUSES = ("timeout", "server_died", "bad_response", "unknown_tool", "bad_arguments", "tool_error")
_MCP_GRACE = 5.0          # the loop enforces MCP deadlines itself; the caller waits this much longer at most


# --- tools and results --------------------------------------------------------------------------------------


@dataclass
class ToolSpec:
    """One tool: its name, description, JSON schema of its arguments, and the server that offers it."""

    name: str
    description: str
    input_schema: dict
    server: str = ""

    def openai(self) -> dict:
        """The OpenAI function-tool form (schema without JSON-schema "title" annotations)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": compact_schema(self.input_schema)}}


@dataclass
class ToolResult:
    """What a call gave: `text` is what the model sees (cut to the output limit); on failure `is_error` is true
    and `cause` is one of CAUSES ("tool_error" is the tool's own error answer, the rest are the ToolBox's)."""

    name: str
    text: str
    is_error: bool = False
    cause: str | None = None
    server: str = ""
    seconds: float = 0.0
    truncated: bool = False


def compact_schema(schema: Any) -> Any:
    """A JSON schema without "title" annotations (pydantic adds one to every object and property)."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "title" and isinstance(v, str):
                continue
            if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
                out[k] = {name: compact_schema(sub) for name, sub in v.items()}
            else:
                out[k] = compact_schema(v)
        return out
    if isinstance(schema, list):
        return [compact_schema(x) for x in schema]
    return schema


def cut(text: str, limit: int) -> tuple[str, bool]:
    """`text` cut to at most `limit` characters, ending with a marker that says how much was left out."""
    if len(text) <= limit:
        return text, False
    keep = limit
    for _ in range(3):  # the marker's length depends on the number in it
        marker = f"\n[... output cut: {len(text) - keep} more characters]"
        keep = max(0, limit - len(marker))
    return text[:keep] + marker, True


# --- Python function tools ---------------------------------------------------------------------------------


def function_schema(fn: Callable, name: str | None = None) -> tuple[ToolSpec, bool]:
    """The ToolSpec of a Python function (from its signature, type hints and docstring) and whether it takes
    the rollout's `state` (hidden from the schema, like *args and **kwargs)."""
    description, schema, wants_state = pyfunc.function_schema(fn)
    return ToolSpec(name=name or fn.__name__, description=description, input_schema=schema), wants_state


@dataclass
class _PyTool:
    spec: ToolSpec
    fn: Callable
    wants_state: bool


# --- the ToolBox --------------------------------------------------------------------------------------------


class ToolBox:
    """Every configured tool server, started once; synchronous, thread-safe calls.

        with ToolBox.from_config(cfg) as box:
            box.openai_tools()                        # the catalog for the chat template
            r = box.call("get_note", {"title": "dentist"}, state=rollout_state)
            rs = box.call_many([("get_note", {...}, s1), ("add_note", {...}, s2)])   # concurrently

    `servers` are ServerSpecs or raw `[[agent.servers]]` tables (validated against `base`). A server that cannot
    start is a RetrogradError naming it (with its stderr tail); two servers offering one tool name, or a Python
    tool that cannot be imported, is a ConfigError.
    """

    def __init__(self, servers: Sequence[ServerSpec | dict], *, base: Path | None = None, label: str = "<config>",
                 timeout_seconds: float = 10.0, output_chars: int = 4000, start_timeout_seconds: float = 30.0):
        if output_chars < 64:
            raise ConfigError(f"{label}: tool output limit must be >= 64 characters, got {output_chars}")
        if any(isinstance(s, dict) for s in servers):
            if not all(isinstance(s, dict) for s in servers):
                raise TypeError("servers: give either [[agent.servers]] tables or ServerSpecs, not both")
            servers = parse_servers(list(servers), Path(base) if base else Path.cwd(), label)
        self.servers: list[ServerSpec] = list(servers)  # type: ignore[arg-type]
        self.label = label
        self.timeout_seconds = float(timeout_seconds)
        self.output_chars = int(output_chars)
        self.start_timeout_seconds = float(start_timeout_seconds)
        self.counts: Counter = Counter()
        self._count_lock = threading.Lock()
        self._tools: dict[str, ToolSpec] = {}
        self._py: dict[str, _PyTool] = {}
        self._mcp: dict[str, McpServer] = {}
        self._validators: dict[str, Any] = {}
        self._loop: LoopThread | None = None
        self._close_future: concurrent.futures.Future | None = None
        self._closed = False
        _register(self)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, cfg: Any, **kw: Any) -> ToolBox:
        """A ToolBox for a loaded Config: its [[agent.servers]], tool_timeout_seconds and tool_output_chars."""
        from retrograd.run_setup import config_dir, config_label

        a = cfg.agent
        label = config_label(cfg)
        kw.setdefault("timeout_seconds", a.tool_timeout_seconds)
        kw.setdefault("output_chars", a.tool_output_chars)
        return cls(parse_servers(a.servers, config_dir(cfg), label), label=label, **kw)

    # --- start and stop ---------------------------------------------------------------------------------------

    def _start(self) -> None:
        offered: dict[str, str] = {}

        def add(spec: ToolSpec) -> None:
            if spec.name in offered:
                other = offered[spec.name]
                same = other == spec.server
                raise ConfigError(f"{self.label}: tool {spec.name!r} is offered "
                                  + (f"twice by [agent.servers] {other!r}" if same else
                                     f"by both [agent.servers] {other!r} and {spec.server!r}")
                                  + "; tool names must be unique (rename one or drop a server)")
            offered[spec.name] = spec.server
            self._tools[spec.name] = spec

        mcp_specs = [s for s in self.servers if s.transport in ("stdio", "http")]
        if mcp_specs:
            from retrograd.agent.mcp_client import quiet_sdk_logging

            quiet_sdk_logging()
            self._loop = LoopThread()
            self._mcp = {s.name: McpServer(s, self.start_timeout_seconds) for s in mcp_specs}
            errors = self._loop.submit(self._astart()).result()
            if errors:
                raise RetrogradError("\n".join(errors))
        for s in self.servers:
            if s.transport == "python":
                for j, ref in enumerate(s.functions):
                    where = f"{self.label}: {s.where}.functions[{j}]"
                    try:
                        fn = pyfunc.load_function(ref, s.base)
                        spec, wants_state = function_schema(fn)
                    except pyfunc.FunctionRefError as exc:
                        raise ConfigError(f"{where}: {exc}") from None
                    spec.server = s.name
                    add(spec)
                    self._py[spec.name] = _PyTool(spec, fn, wants_state)
            else:
                for t in self._mcp[s.name].tools:
                    add(ToolSpec(t["name"], t["description"], t["input_schema"], s.name))

    async def _astart(self) -> list[str]:
        results = await asyncio.gather(*(m.start() for m in self._mcp.values()), return_exceptions=True)
        return [str(r) if isinstance(r, StartError) else f"tool server {m.spec.name!r}: {type(r).__name__}: {r}"
                for m, r in zip(self._mcp.values(), results) if isinstance(r, BaseException)]

    async def _aclose(self) -> None:
        await asyncio.gather(*(m.close() for m in self._mcp.values()), return_exceptions=True)

    def close(self) -> None:
        """Stop every server (idempotent; bounded to about STOP_SECONDS)."""
        if self._closed:
            return
        if self._loop is not None:
            if self._close_future is None:
                self._close_future = self._loop.submit(self._aclose())
            try:
                self._close_future.result(timeout=STOP_SECONDS + 5.0)
            except concurrent.futures.TimeoutError:
                pass
            except Exception:
                pass
            self._loop.stop()
        self._closed = True
        _unregister(self)

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- catalog ----------------------------------------------------------------------------------------------

    def tools(self) -> list[ToolSpec]:
        """Every tool, in server order then each server's own order."""
        return list(self._tools.values())

    def openai_tools(self) -> list[dict]:
        return [t.openai() for t in self._tools.values()]

    def spec(self, name: str) -> ToolSpec | None:
        return self._tools.get(name)

    def server_tools(self) -> dict[str, list[ToolSpec]]:
        """{server name: its tools}, in configuration order."""
        out: dict[str, list[ToolSpec]] = {s.name: [] for s in self.servers}
        for t in self._tools.values():
            out[t.server].append(t)
        return out

    def stderr_tail(self, server: str) -> str:
        """The end of a stdio server's stderr ("" for others)."""
        m = self._mcp.get(server)
        return m.stderr_tail() if m else ""

    # --- calls ------------------------------------------------------------------------------------------------

    def call(self, name: str, arguments: Any = None, state: Path | str | None = None) -> ToolResult:
        """Call one tool. `arguments` is a dict (a JSON text is parsed); `state` is the rollout's state path."""
        return self.call_many([(name, arguments, state)])[0]

    def call_many(self, calls: Iterable[tuple]) -> list[ToolResult]:
        """Call several tools concurrently: each item is (name, arguments) or (name, arguments, state). The
        results come in the same order."""
        if self._closed:
            raise RuntimeError("the ToolBox is closed")
        pending = []
        for item in calls:
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise TypeError(f"expected (name, arguments[, state]), got {item!r}")
            name, arguments, state = (*item, None)[:3]
            pending.append(self._submit(str(name), arguments, state))
        return [self._finish(p) for p in pending]

    def _timeout_for(self, server: str) -> float:
        for s in self.servers:
            if s.name == server and s.timeout_seconds is not None:
                return s.timeout_seconds
        return self.timeout_seconds

    def _submit(self, name: str, arguments: Any, state: Any) -> tuple:
        t0 = time.monotonic()
        spec = self._tools.get(name)
        if spec is None:
            known = ", ".join(self._tools) or "none"
            return (name, "", t0, 0.0, ToolResult(name, f"unknown tool {name!r}; the tools are: {known}", True,
                                                  "unknown_tool"))
        args, problem = self._check_arguments(spec, arguments)
        if problem:
            return (name, spec.server, t0, 0.0,
                    ToolResult(name, f"bad arguments for tool {name!r}: {problem}", True, "bad_arguments"))
        timeout = self._timeout_for(spec.server)
        state = None if state is None else Path(state).resolve()  # servers run in their own directory
        if name in self._py:
            tool = self._py[name]
            kwargs = dict(args)
            if tool.wants_state:
                kwargs["state"] = state
            return (name, spec.server, t0, timeout, pyfunc.call_in_thread(tool.fn, kwargs, name))
        assert self._loop is not None
        fut = self._loop.submit(self._mcp[spec.server].call(name, args, None if state is None else str(state),
                                                            timeout))
        return (name, spec.server, t0, timeout + _MCP_GRACE, fut)

    def _finish(self, pending: tuple) -> ToolResult:
        name, server, t0, wait, work = pending
        if isinstance(work, ToolResult):
            return self._account(work, server, t0)
        is_py = name in self._py
        try:
            value = work.result(timeout=max(0.0, t0 + wait - time.monotonic()))
        except concurrent.futures.TimeoutError:
            work.cancel()
            limit = wait if is_py else wait - _MCP_GRACE
            return self._account(ToolResult(name, f"tool {name!r} timed out after {limit:g} s", True, "timeout"),
                                 server, t0)
        except concurrent.futures.CancelledError:
            return self._account(ToolResult(name, f"tool {name!r} was cancelled (the ToolBox is closing)", True,
                                            "server_died"), server, t0)
        except Exception as exc:
            if is_py:
                return self._account(ToolResult(name, f"{type(exc).__name__}: {exc}", True, "tool_error"), server, t0)
            return self._account(ToolResult(name, f"tool {name!r}: internal error {type(exc).__name__}: {exc}", True,
                                            "bad_response"), server, t0)
        if is_py:
            return self._account(ToolResult(name, pyfunc.text_of(value)), server, t0)
        if value.restarted:
            self._bump("restarts")
        return self._account(ToolResult(name, value.text, value.cause is not None, value.cause), server, t0)

    def _account(self, r: ToolResult, server: str, t0: float) -> ToolResult:
        r.server = server
        r.seconds = time.monotonic() - t0
        r.text, r.truncated = cut(r.text, self.output_chars)
        with self._count_lock:
            self.counts["calls"] += 1
            self.counts["errors" if r.is_error else "ok"] += 1
            if r.cause:
                self.counts[r.cause] += 1
            if r.truncated:
                self.counts["truncated"] += 1
        return r

    def _bump(self, key: str) -> None:
        with self._count_lock:
            self.counts[key] += 1

    def _check_arguments(self, spec: ToolSpec, arguments: Any) -> tuple[dict, str | None]:
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, (str, bytes)):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return {}, f"not valid JSON ({exc.msg})"
        if not isinstance(arguments, dict):
            return {}, f"expected a JSON object of named arguments, got {type(arguments).__name__}"
        validator = self._validator(spec)
        if validator is not None:
            try:
                import jsonschema

                err = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
            except Exception:
                err = None
            if err is not None:
                where = ".".join(str(p) for p in err.absolute_path)
                return arguments, f"{where}: {err.message}" if where else err.message
        return arguments, None

    def _validator(self, spec: ToolSpec) -> Any:
        if spec.name not in self._validators:
            v = None
            try:
                import jsonschema

                cls = jsonschema.validators.validator_for(spec.input_schema)
                cls.check_schema(spec.input_schema)
                v = cls(spec.input_schema)
            except Exception:  # no jsonschema, or a schema it cannot use: the server validates
                v = None
            self._validators[spec.name] = v
        return self._validators[spec.name]

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._tools)} tools"
        return f"ToolBox({', '.join(s.name for s in self.servers)}: {state})"


# --- stopping servers when the process ends -----------------------------------------------------------------

_live: set[ToolBox] = set()
_live_lock = threading.Lock()
_hooks = {"atexit": False, "signals": False}


def _register(box: ToolBox) -> None:
    with _live_lock:
        _live.add(box)
        if not _hooks["atexit"]:
            atexit.register(close_all)
            _hooks["atexit"] = True
        if not _hooks["signals"] and threading.current_thread() is threading.main_thread():
            for name in ("SIGTERM", "SIGHUP"):
                sig = getattr(signal, name, None)
                if sig is None:
                    continue
                try:
                    prev = signal.getsignal(sig)
                    if prev is signal.SIG_IGN or prev is None:
                        continue
                    signal.signal(sig, _chained(prev))
                except (ValueError, OSError):
                    continue
            _hooks["signals"] = True


def _unregister(box: ToolBox) -> None:
    with _live_lock:
        _live.discard(box)


def close_all() -> None:
    """Close every open ToolBox (atexit and signal hook)."""
    with _live_lock:
        boxes = list(_live)
    for box in boxes:
        try:
            box.close()
        except Exception:
            pass


def _chained(prev: Any) -> Callable:
    def handler(signum: int, frame: Any) -> None:
        close_all()
        if callable(prev):
            prev(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler
