"""The MCP side of the ToolBox: one client session per server, on an asyncio loop in one background thread.

Each server lives in one long task (`McpServer._run`) that holds its transport (a stdio subprocess or a streamable
HTTP connection) and its `ClientSession` open until it is told to stop, so that the SDK's own shutdown (close stdin,
wait, then kill the process group) always runs in the task that opened them. Calls come from other tasks and race
the call against the server's death and a deadline; whatever goes wrong becomes an `Outcome` with a cause, never
an exception.

Failure policy:
- a call that runs past its time is "timeout"; the server is then suspect: the next call first pings it, and a
  server that does not answer the ping counts as hung and is treated as dead;
- a dead server (its process exited, its connection failed, or it is hung) is restarted (stdio) or reconnected
  (HTTP) once, on the next call to it; the call during which it died gets "server_died". After the one restart
  its tools answer "server_died" at once for the rest of the run;
- a line on a stdio server's stdout that is not JSON-RPC fails the start at once; during a call it is remembered,
  and a call that then gets no answer is "bad_response" (not "timeout"); a result that is not a valid
  CallToolResult is "bad_response" too.

A stdio server's stderr goes to a temporary file; its tail is quoted in start and death messages. The SDK starts
stdio servers in their own session (process group), so a Ctrl-C in a terminal does not reach them; the ToolBox
stops them on close, at interpreter exit and on SIGTERM/SIGHUP (`retrograd.agent.tools`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from retrograd.agent.servers import ServerSpec

STATE_META_KEY = "retrograd/state"
STOP_SECONDS = 15.0        # the SDK's stdio shutdown is bounded near 6 s; this is the outer bound
PING_SECONDS = 2.0
_RESTARTS = 1
_MCP_MAJOR: int | None = None


class StartError(Exception):
    """A server that could not be started (the message says why, with its stderr tail)."""


@dataclass
class Outcome:
    """One call's raw result: the text, and the cause of failure (None when it worked)."""

    text: str
    cause: str | None = None
    restarted: bool = False


def quiet_sdk_logging() -> None:
    """The SDK logs transport faults with tracebacks; the ToolBox reports them itself. Only when the user has not
    configured the "mcp" logger."""
    log = logging.getLogger("mcp")
    if log.level == logging.NOTSET and not log.handlers:
        log.setLevel(logging.CRITICAL)


class LoopThread:
    """An asyncio event loop running in a daemon thread; `submit` schedules a coroutine from any other thread."""

    def __init__(self, name: str = "retrograd-tools") -> None:
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, wait: float = 5.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(wait)


def _read_timeout(seconds: float) -> Any:
    """A request timeout as the installed SDK takes it: seconds (mcp 2), a timedelta (mcp 1.x)."""
    global _MCP_MAJOR
    if _MCP_MAJOR is None:
        try:
            _MCP_MAJOR = int(importlib.metadata.version("mcp").split(".")[0])
        except (importlib.metadata.PackageNotFoundError, ValueError):
            _MCP_MAJOR = 2
    return seconds if _MCP_MAJOR >= 2 else datetime.timedelta(seconds=seconds)


def _leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups."""
    while inner := getattr(exc, "exceptions", None):   # ExceptionGroup is a builtin from 3.11 on
        exc = inner[0]
    return exc


def _excerpt(text: str, n: int = 120) -> str:
    text = text.strip()
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def _garbage_text(exc: Exception) -> str:
    """The offending stdout line when the SDK says which (a pydantic error carries it as its input)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            if isinstance(first.get("input"), str):
                return _excerpt(first["input"])
        except Exception:
            pass
    return _excerpt(f"{type(exc).__name__}: {exc}")


def result_text(result: Any) -> str:
    """The text a model sees for a CallToolResult: its content blocks, else its structured content."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {getattr(block, 'mime_type', getattr(block, 'mimeType', ''))}]")
        elif kind == "resource":
            res = block.resource
            parts.append(getattr(res, "text", None) or f"[resource {res.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{kind or type(block).__name__} content]")
    structured = getattr(result, "structured_content", getattr(result, "structuredContent", None))
    if not parts and structured is not None:
        return json.dumps(structured, ensure_ascii=False)
    return "\n".join(parts)


class McpServer:
    """One MCP server (stdio or streamable HTTP) and its client session. Every coroutine runs on the loop."""

    def __init__(self, spec: ServerSpec, start_timeout: float) -> None:
        self.spec = spec
        self.start_timeout = start_timeout
        self.tools: list[dict] = []
        self.session: Any = None
        self.restarts_left = _RESTARTS
        self.death: str = ""              # why it is dead, when it is
        self._task: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._dead: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._stderr: Any = None
        self._handshake_scope: Any = None
        self._garbage: list[str] = []
        self._garbage_seen = 0
        self._suspect = False
        self._closing = False

    # --- describing -----------------------------------------------------------------------------------------

    @property
    def what(self) -> str:
        return " ".join(self.spec.command) if self.spec.transport == "stdio" else str(self.spec.url)

    def stderr_tail(self, chars: int = 1500, lines: int = 12) -> str:
        f = self._stderr
        if f is None:
            return ""
        try:
            size = os.fstat(f.fileno()).st_size
            data = os.pread(f.fileno(), chars, max(0, size - chars))
        except (OSError, ValueError):
            return ""
        text = data.decode("utf-8", "replace").strip()
        return "\n".join(text.splitlines()[-lines:])

    def _with_tail(self, msg: str) -> str:
        tail = self.stderr_tail()
        return f"{msg}; its stderr ended with:\n{tail}" if tail else msg

    def _describe_failure(self, exc: BaseException) -> str:
        from mcp.shared.exceptions import MCPError

        leaf = _leaf(exc)
        if isinstance(leaf, StartError):
            return str(leaf)
        if isinstance(leaf, TimeoutError):
            return f"it did not complete the MCP handshake within {self.start_timeout:g} s"
        if isinstance(leaf, MCPError) and leaf.code == -32000:
            return ("its process exited during start-up" if self.spec.transport == "stdio"
                    else "the connection closed during start-up")
        if isinstance(leaf, FileNotFoundError) and self.spec.transport == "stdio":
            return f"cannot run {self.spec.command[0]!r}: no such file or command"
        if isinstance(leaf, OSError) and self.spec.transport == "stdio":
            return f"cannot run {self.spec.command[0]!r}: {leaf.strerror or leaf}"
        if type(leaf).__name__ in ("ConnectError", "ConnectTimeout"):
            return f"cannot connect to {self.spec.url}: {leaf}"
        return f"{type(leaf).__name__}: {leaf}"

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the transport, handshake, list the tools; StartError (with the stderr tail) when that fails."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self.spec.transport == "stdio":
            if self._stderr is not None:
                self._stderr.close()
            self._stderr = tempfile.TemporaryFile(prefix=f"retrograd-{self.spec.name}-", suffix=".stderr")
        self._garbage, self._suspect, self.death = [], False, ""
        self._stop, self._dead = asyncio.Event(), asyncio.Event()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._run(ready, self._stop, self._dead))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.start_timeout + 10.0)
        except BaseException as exc:
            await self.stop()
            if isinstance(exc, asyncio.CancelledError):
                raise
            why = (f"it did not complete the MCP handshake within {self.start_timeout:g} s"
                   if isinstance(exc, asyncio.TimeoutError) else self._describe_failure(exc))
            raise StartError(self._with_tail(f"tool server {self.spec.name!r} ({self.what}) could not start: {why}")) \
                from None

    def _transport(self) -> Any:
        if self.spec.transport == "stdio":
            from mcp.client.stdio import StdioServerParameters, get_default_environment, stdio_client

            params = StdioServerParameters(command=self.spec.command[0], args=list(self.spec.command[1:]),
                                           env=get_default_environment() | dict(self.spec.env),
                                           cwd=str(self.spec.cwd) if self.spec.cwd else None)
            return stdio_client(params, errlog=self._stderr)
        try:
            from mcp.client.streamable_http import streamable_http_client as http_client
        except ImportError:  # older mcp 1.x
            # the 1.x name, absent from the mcp 2 that type checking sees
            from mcp.client.streamable_http import (  # type: ignore[attr-defined,no-redef]
                streamablehttp_client as http_client,
            )
        return http_client(str(self.spec.url))

    async def _run(self, ready: asyncio.Future, stop: asyncio.Event, dead: asyncio.Event) -> None:
        import anyio
        from mcp import ClientSession
        from mcp.types import Implementation

        try:
            async with self._transport() as streams:
                read, write = streams[0], streams[1]
                async with ClientSession(read, write, message_handler=self._on_message,
                                         client_info=Implementation(name="retrograd", version="0.1.0")) as session:
                    with anyio.CancelScope() as scope:
                        self._handshake_scope = scope
                        with anyio.fail_after(self.start_timeout):
                            await session.initialize()
                            tools = await self._list_tools(session)
                    self._handshake_scope = None
                    if scope.cancelled_caught:
                        raise StartError(f"it wrote something that is not JSON-RPC on stdout: {self._garbage[-1]} "
                                         "(a stdio MCP server must write only protocol messages to stdout; "
                                         "log to stderr)")
                    self.tools, self.session = tools, session
                    ready.set_result(None)
                    await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else StartError(repr(exc)))
            elif not self.death:
                self.death = self._describe_failure(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.session = None
            self._handshake_scope = None
            dead.set()

    @staticmethod
    async def _list_tools(session: Any) -> list[dict]:
        from mcp.types import PaginatedRequestParams

        out: list[dict] = []
        cursor = None
        for _ in range(1000):
            res = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            for t in res.tools:
                schema = getattr(t, "input_schema", None) or getattr(t, "inputSchema", None) or {"type": "object"}
                out.append({"name": t.name, "description": t.description or "", "input_schema": dict(schema)})
            cursor = getattr(res, "next_cursor", None) or getattr(res, "nextCursor", None)
            if not cursor:
                break
        return out

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, Exception):
            self._garbage_seen += 1
            self._garbage = [*self._garbage[-4:], _garbage_text(message)]
            if self._handshake_scope is not None:
                self._handshake_scope.cancel()

    async def stop(self) -> None:
        """Stop the session and (stdio) the process; bounded, idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        if self._stop is not None:
            self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), STOP_SECONDS)
        except asyncio.TimeoutError:
            task.cancel()
        except BaseException:
            pass

    async def close(self) -> None:
        self._closing = True
        await self.stop()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    # --- calls ----------------------------------------------------------------------------------------------

    def _alive(self) -> bool:
        return self.session is not None and self._dead is not None and not self._dead.is_set()

    async def _ensure_alive(self) -> tuple[bool, bool]:
        """(usable, restarted): restart a dead or hung server once."""
        assert self._lock is not None
        async with self._lock:
            if self._alive() and self._suspect:
                self._suspect = False
                try:
                    await asyncio.wait_for(self.session.send_ping(), PING_SECONDS)
                except Exception:
                    self.death = "it stopped answering (a call timed out, then a ping got no answer)"
                    await self.stop()
            if self._alive():
                return True, False
            if not self.death:
                self.death = "it stopped"
            if self.restarts_left <= 0 or self._closing:
                return False, False
            self.restarts_left -= 1
            why = self.death
            await self.stop()
            try:
                await self.start()
            except StartError as exc:
                self.death = f"{why}; restarting it failed: {exc}"
                return False, False
            return True, True

    def _died_text(self) -> str:
        again = "" if self.restarts_left > 0 else " (it was already restarted once; its tools are off for this run)"
        return self._with_tail(f"tool server {self.spec.name!r} died: {self.death or 'it stopped'}{again}")

    async def call(self, name: str, arguments: dict, state: str | None, timeout: float) -> Outcome:
        from mcp.shared.exceptions import MCPError

        usable, restarted = await self._ensure_alive()
        if not usable:
            return Outcome(self._died_text(), "server_died", restarted)
        session, dead = self.session, self._dead
        assert dead is not None
        meta = {STATE_META_KEY: state} if state is not None else None
        garbage_before = self._garbage_seen
        call = asyncio.ensure_future(session.call_tool(name, arguments, read_timeout_seconds=_read_timeout(timeout),
                                                       meta=meta))
        died = asyncio.ensure_future(dead.wait())
        try:
            done, _ = await asyncio.wait({call, died}, timeout=timeout + 1.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
        if call not in done:
            call.cancel()
            if dead.is_set():
                return Outcome(self._died_text(), "server_died", restarted)
            return self._timed_out(name, timeout, garbage_before, restarted)
        try:
            result = call.result()
        except MCPError as exc:
            if exc.code == -32000:  # CONNECTION_CLOSED
                self.death = self.death or ("its process exited" if self.spec.transport == "stdio"
                                            else "the connection closed")
                self.session = None
                if self._stop is not None:
                    self._stop.set()
                return Outcome(self._died_text(), "server_died", restarted)
            if exc.code == -32001:  # REQUEST_TIMEOUT
                return self._timed_out(name, timeout, garbage_before, restarted)
            if exc.code == -32602:  # INVALID_PARAMS
                return Outcome(f"tool {name!r} rejected its arguments: {exc.message}", "bad_arguments", restarted)
            if exc.code == -32601:  # METHOD_NOT_FOUND
                return Outcome(f"tool server {self.spec.name!r} does not serve tools/call", "bad_response", restarted)
            return Outcome(f"tool {name!r} failed: {exc.message}", "tool_error", restarted)
        except Exception as exc:
            leaf = _leaf(exc)
            return Outcome(f"tool {name!r}: the server's answer is not a valid tool result "
                           f"({type(leaf).__name__}: {_excerpt(str(leaf), 200)})", "bad_response", restarted)
        if not hasattr(result, "content") or not hasattr(result, "is_error"):
            return Outcome(f"tool {name!r}: the server answered {type(result).__name__}, not a tool result",
                           "bad_response", restarted)
        text = result_text(result)
        return Outcome(text, "tool_error" if result.is_error else None, restarted)

    def _timed_out(self, name: str, timeout: float, garbage_before: int, restarted: bool) -> Outcome:
        if self._garbage_seen > garbage_before:
            return Outcome(f"tool {name!r} got no valid answer: the server wrote something that is not JSON-RPC "
                           f"on stdout: {self._garbage[-1]}", "bad_response", restarted)
        self._suspect = True
        return Outcome(f"tool {name!r} timed out after {timeout:g} s", "timeout", restarted)
