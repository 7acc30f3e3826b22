"""A tiny, dependency-free stdio MCP server that misbehaves on request (tests of retrograd.agent.tools).

    fake_server.py [MODE]   MODE: ok (default), garbage-start, exit-start, silent, linger (keeps running for a
                            minute after its stdin closes: only a kill stops it)

Tools: echo(text), whoami() (its pid), state() (the retrograd/state _meta it got), big(n), sleep(seconds) (blocks
the whole server: a hang), crash() (the process exits), garbage() (answers with a non-JSON line), bad_result()
(a JSON-RPC answer that is not a tool result). FAKE_PREFIX in the environment prefixes every tool name.
"""

import json
import os
import sys
import time

MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
PREFIX = os.environ.get("FAKE_PREFIX", "")
STR = {"type": "string"}
TOOLS = {
    "echo": ("Echo the text back.", {"text": STR}, ["text"]),
    "whoami": ("The server's process id.", {}, []),
    "state": ("The rollout state path this call carried.", {}, []),
    "big": ("n characters of output.", {"n": {"type": "integer"}}, ["n"]),
    "sleep": ("Block the server for some seconds.", {"seconds": {"type": "number"}}, ["seconds"]),
    "crash": ("Exit the server process.", {}, []),
    "garbage": ("Answer with a line that is not JSON.", {}, []),
    "bad_result": ("Answer with something that is not a tool result.", {}, []),
}


def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def text(req_id, value, error=False):
    send({"jsonrpc": "2.0", "id": req_id, "result": {"content": [{"type": "text", "text": value}], "isError": error}})


def call(req_id, params):
    name = params.get("name", "")[len(PREFIX):]
    args = params.get("arguments") or {}
    if name == "echo":
        text(req_id, args.get("text", ""))
    elif name == "whoami":
        text(req_id, str(os.getpid()))
    elif name == "state":
        text(req_id, str((params.get("_meta") or {}).get("retrograd/state")))
    elif name == "big":
        text(req_id, "x" * int(args["n"]))
    elif name == "sleep":
        time.sleep(float(args["seconds"]))
        text(req_id, "slept")
    elif name == "crash":
        sys.stderr.write("fake server: crashing on purpose\n")
        sys.stderr.flush()
        os._exit(3)
    elif name == "garbage":
        sys.stdout.write("this is not json\n")
        sys.stdout.flush()
    elif name == "bad_result":
        send({"jsonrpc": "2.0", "id": req_id, "result": {"content": "not a list"}})
    else:
        text(req_id, f"Unknown tool: {name}", error=True)


def main():
    if MODE == "exit-start":
        sys.stderr.write("fake server: cannot open its configuration\n")
        sys.exit(1)
    if MODE == "garbage-start":
        print("Hello from a server that prints to stdout")
        sys.stdout.flush()
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if "id" not in msg or "method" not in msg:
            continue
        method, params = msg["method"], msg.get("params") or {}
        if MODE == "silent":
            continue
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": msg["id"], "result": {
                "protocolVersion": params.get("protocolVersion"), "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake", "version": "0"}}})
        elif method == "ping":
            send({"jsonrpc": "2.0", "id": msg["id"], "result": {}})
        elif method == "tools/list":
            send({"jsonrpc": "2.0", "id": msg["id"], "result": {"tools": [
                {"name": PREFIX + n, "description": d,
                 "inputSchema": {"type": "object", "properties": p, "required": r}}
                for n, (d, p, r) in TOOLS.items()]}})
        elif method == "tools/call":
            call(msg["id"], params)
        else:
            send({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": f"no method {method}"}})
    if MODE == "linger":
        time.sleep(60)


if __name__ == "__main__":
    main()
