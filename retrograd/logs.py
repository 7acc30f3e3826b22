"""retrograd's own log messages: the `retrograd` logger, its level from RUST_LOG (the
specification's name) or RETRO_LOG (an alias), default warn. Both accept a bare level (error, warn,
info, debug, trace) or RUST_LOG-style `target=level` pairs, of which `retrograd=...` applies; the
same threshold routes llama.cpp's own messages (data/tokenizer.py)."""

from __future__ import annotations

import logging
import os
import sys

LEVELS = {"error": logging.ERROR, "warn": logging.WARNING, "warning": logging.WARNING, "info": logging.INFO,
          "debug": logging.DEBUG, "trace": logging.DEBUG, "off": logging.CRITICAL + 10}

log = logging.getLogger("retrograd")
_HANDLER = "retrograd-stderr"     # the name of the handler setup() adds, so that it adds one only


def level_name() -> str:
    """The level asked for: `retrograd=LEVEL` if given, else the first bare level, else warn."""
    raw = os.environ.get("RUST_LOG") or os.environ.get("RETRO_LOG") or ""
    bare = None
    for part in (p.strip().lower() for p in raw.split(",") if p.strip()):
        target, _, lvl = part.rpartition("=")
        if target == "retrograd" and lvl in LEVELS:
            return lvl
        if not target and bare is None and lvl in LEVELS:
            bare = lvl
    return bare or "warn"


def setup() -> None:
    """Point the `retrograd` logger at stderr with the level of RUST_LOG / RETRO_LOG (idempotent)."""
    log.setLevel(LEVELS[level_name()])
    if not any(h.name == _HANDLER for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S"))
        handler.name = _HANDLER
        log.addHandler(handler)
    log.propagate = False
    raw = os.environ.get("RUST_LOG") or os.environ.get("RETRO_LOG")
    if raw and not any(p.strip().lower().rpartition("=")[2] in LEVELS for p in raw.split(",")):
        log.warning("RUST_LOG / RETRO_LOG = %r names no level (expected error, warn, info, debug or trace); "
                    "using warn", raw)
