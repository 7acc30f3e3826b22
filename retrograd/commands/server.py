"""`retrograd-server`: a long-running service that owns training runs and serves their weights.

    retrograd-server [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--state-dir DIR] [--share-cpu]

Runs are submitted over HTTP (POST /api/runs with {"config": PATH} or {"toml": TEXT}), train one at
a time in processes of their own, persist under the state directory and are served through the
OpenAI routes as RUN_ID (live), RUN_ID@final, @best, @latest, @step-N and @base. GET / is a web
page with the runs, their curves and a chat box; GET /openapi.json documents the API.

Its own program, not a `retrograd` command, so it has `parser()` and `main` (pyproject's
[project.scripts]) rather than `add_parser`; it lives with the commands because it is one: the
server itself is retrograd.serve.server.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from retrograd.errors import UsageError, reported


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="retrograd-server", description=__doc__.split("\n\n")[0],
        epilog="Routes: GET / (web page), GET /health, GET /openapi.json, GET|POST /api/runs, GET /api/runs/RUN, "
               "GET /api/runs/RUN/{metrics,log,events}, POST /api/runs/RUN/{stop,resume}, GET /v1/models, "
               "POST /v1/chat/completions. Each run's [serving] section sets enabled (live weights while it "
               "trains), idle_seconds, device_wait_seconds, parallel (saved weights' requests decoded together), queue, "
               "wait_seconds and max_body_bytes. GET /health reports requests decoding and waiting.")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs --api-key)")
    ap.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    ap.add_argument("--api-key", default=os.environ.get("RETRO_API_KEY") or None,
                    help="require Authorization: Bearer KEY on every route but /health (default: $RETRO_API_KEY)")
    ap.add_argument("--state-dir", default=None,
                    help="where runs persist (default: $RETRO_STATE_DIR, else ~/.local/share/retrograd/server)")
    ap.add_argument("--share-cpu", action="store_true",
                    help="let saved weights load on the CPU while a CPU run trains (default: a training run holds "
                         "the device, and loads wait [serving].device_wait_seconds for it)")
    return ap


def state_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser().resolve()
    if os.environ.get("RETRO_STATE_DIR"):
        return Path(os.environ["RETRO_STATE_DIR"]).expanduser().resolve()
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "retrograd" / "server"


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from retrograd.serve.app import is_loopback
    from retrograd.serve.server import RunServer

    if not is_loopback(args.host) and not args.api_key:
        raise UsageError(f"--host {args.host} is not a loopback address: binding it requires --api-key")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    root = state_dir(args.state_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--state-dir {root}: cannot create: {exc.strerror}") from None
    server = RunServer(root, api_key=args.api_key, exclusive_cpu=not args.share_cpu)
    print(f"retrograd-server: runs in {root}; http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, handle_signals=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from retrograd import logs

    logs.setup()
    args = parser().parse_args(argv)
    return reported(lambda: run(args), prefix="retrograd-server")


if __name__ == "__main__":
    sys.exit(main())
