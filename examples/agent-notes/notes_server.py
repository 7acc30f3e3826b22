"""Notes: a small MCP server over an SQLite notes store, the tool environment of retrograd's agentic GRPO example.

    python notes_server.py                  # stdio (how retrograd starts it)
    python notes_server.py --http 8765      # streamable HTTP on http://127.0.0.1:8765/mcp
    python notes_server.py --db notes.db    # a fixed database for calls that carry none (made when missing)

Which database a call works on: the path in the request's `_meta` under "retrograd/state" (retrograd sends each
rollout's own copy of seed.db there), else --db. A call with neither is a tool error.

Table: notes(title TEXT PRIMARY KEY COLLATE NOCASE, body TEXT, tags TEXT) where tags is a comma-separated,
lower-case list such as "health, home". Titles are matched without regard to case or surrounding spaces.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

from pydantic import Field

try:  # mcp 2.x
    from mcp.server.mcpserver import Context
    from mcp.server.mcpserver import MCPServer as Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import Context
    from mcp.server.fastmcp import FastMCP as Server
    from mcp.server.fastmcp.exceptions import ToolError

STATE_META_KEY = "retrograd/state"
SCHEMA = ("CREATE TABLE IF NOT EXISTS notes (title TEXT PRIMARY KEY COLLATE NOCASE, body TEXT NOT NULL, "
          "tags TEXT NOT NULL DEFAULT '')")
MAX_RESULTS = 20

server = Server("notes", instructions="A small notes store: search, read, add, change and delete notes by title.",
                log_level="WARNING")
default_db: Path | None = None


def _meta_value(ctx: Context) -> str | None:
    try:
        meta = ctx.request_context.meta
    except (AttributeError, ValueError):
        return None
    if meta is None:
        return None
    if isinstance(meta, dict):
        value = meta.get(STATE_META_KEY)
    else:  # mcp 1.x: a pydantic model with extra fields
        value = (getattr(meta, "model_extra", None) or {}).get(STATE_META_KEY)
    return value if isinstance(value, str) and value else None


@contextlib.contextmanager
def _connect(ctx: Context) -> Iterator[sqlite3.Connection]:
    """The call's database; committed when the block ends normally, closed always."""
    path = _meta_value(ctx)
    if path is None:
        if default_db is None:
            raise ToolError("no database: the call has no retrograd/state in its _meta and the server has no --db")
        path = str(default_db)
    if not Path(path).is_file():
        raise ToolError(f"database {path} does not exist")
    con = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=rw", uri=True, timeout=10.0)
    con.row_factory = sqlite3.Row
    try:
        with con:
            yield con
    finally:
        con.close()


def _tags(text: str) -> str:
    out: list[str] = []
    for t in text.replace(";", ",").split(","):
        t = " ".join(t.split()).lower()
        if t and t not in out:
            out.append(t)
    return ", ".join(out)


def _line(row: sqlite3.Row) -> str:
    tags = f" [{row['tags']}]" if row["tags"] else ""
    return f"{row['title']}{tags}: {row['body']}"


def _title(title: str) -> str:
    title = " ".join(str(title).split())
    if not title:
        raise ToolError("the title is empty")
    return title


@server.tool()
def search_notes(query: Annotated[str, Field(description='words to look for, e.g. "password"; "" lists all')],
                 ctx: Context) -> str:
    """Find notes whose title, body or tags contain every word of the query. One line per note: title [tags]: body."""
    words = query.lower().split()
    with _connect(ctx) as con:
        rows = con.execute("SELECT title, body, tags FROM notes ORDER BY title COLLATE NOCASE").fetchall()
    hits = [r for r in rows if all(w in f"{r['title']} {r['body']} {r['tags']}".lower() for w in words)]
    if not hits:
        return f"no notes match {query!r}"
    lines = [_line(r) for r in hits[:MAX_RESULTS]]
    if len(hits) > MAX_RESULTS:
        lines.append(f"... and {len(hits) - MAX_RESULTS} more")
    return "\n".join(lines)


@server.tool()
def get_note(title: Annotated[str, Field(description='the note\'s title, e.g. "dentist"')], ctx: Context) -> str:
    """Read the note with this title."""
    title = _title(title)
    with _connect(ctx) as con:
        row = con.execute("SELECT title, body, tags FROM notes WHERE title = ?", (title,)).fetchone()
    if row is None:
        raise ToolError(f"no note titled {title!r}")
    return _line(row)


@server.tool()
def add_note(title: Annotated[str, Field(description="a short title no other note has")],
             body: Annotated[str, Field(description="the text of the note")], ctx: Context,
             tags: Annotated[str, Field(description='comma-separated tags, e.g. "home, shopping"')] = "") -> str:
    """Add a new note."""
    title = _title(title)
    with _connect(ctx) as con:
        try:
            con.execute("INSERT INTO notes (title, body, tags) VALUES (?, ?, ?)", (title, body.strip(), _tags(tags)))
        except sqlite3.IntegrityError:
            raise ToolError(f"a note titled {title!r} already exists (use update_note to change it)") from None
    return f"added note {title!r}"


@server.tool()
def update_note(title: Annotated[str, Field(description="the note's title")],
                body: Annotated[str, Field(description="the new text of the note")], ctx: Context) -> str:
    """Replace the text of an existing note."""
    title = _title(title)
    with _connect(ctx) as con:
        n = con.execute("UPDATE notes SET body = ? WHERE title = ?", (body.strip(), title)).rowcount
    if n == 0:
        raise ToolError(f"no note titled {title!r}")
    return f"updated note {title!r}"


@server.tool()
def delete_note(title: Annotated[str, Field(description="the note's title")], ctx: Context) -> str:
    """Delete the note with this title."""
    title = _title(title)
    with _connect(ctx) as con:
        n = con.execute("DELETE FROM notes WHERE title = ?", (title,)).rowcount
    if n == 0:
        raise ToolError(f"no note titled {title!r}")
    return f"deleted note {title!r}"


def create_db(path: Path) -> None:
    """An empty notes database (the table only)."""
    con = sqlite3.connect(path)
    try:
        with con:
            con.execute(SCHEMA)
    finally:
        con.close()


def main(argv: list[str] | None = None) -> int:
    global default_db
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", type=Path, help="database for calls whose _meta names none (created when missing)")
    p.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on this port instead of stdio")
    p.add_argument("--host", default="127.0.0.1", help="address for --http (default 127.0.0.1)")
    args = p.parse_args(argv)
    if args.db is not None:
        default_db = args.db.resolve()
        if not default_db.exists():
            create_db(default_db)
    if args.http is None:
        server.run()
        return 0
    params = inspect.signature(server.run_streamable_http_async).parameters
    if "port" in params:  # mcp 2.x
        server.run("streamable-http", host=args.host, port=args.http)
    else:  # mcp 1.x reads host and port from its settings
        server.settings.host, server.settings.port = args.host, args.http
        server.run("streamable-http")
    return 0


if __name__ == "__main__":
    sys.exit(main())
