"""`retrograd serve`: the trained adapter (and the base model beside it) behind the OpenAI API."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path

from retrograd.checkpoint import CheckpointError, adapter_of
from retrograd.commands import load_config
from retrograd.config import ConfigError
from retrograd.data.chat import format_for
from retrograd.generation.llama import Generator
from retrograd.models import default_model_path
from retrograd.serve.app import BASE_ID, ModelHost, ServedModel, create_app
from retrograd.trainer import TrainError, resolve_threads, run_dir


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def choose_adapter(args: argparse.Namespace, cfg) -> Path | None:
    if args.base_only:
        return None
    if args.adapter:
        p = Path(args.adapter).resolve()
        if not p.is_file():
            raise TrainError(f"--adapter: {p}: no such adapter file")
        return p
    if args.checkpoint:
        state = Path(args.checkpoint).resolve()
        beside = state.with_suffix(".gguf")
        if beside.is_file():
            return beside
        return adapter_of(state)
    p = run_dir(cfg) / "adapter.gguf"
    if not p.is_file():
        raise TrainError(f"no adapter to serve: {p} does not exist (train first, or pass --adapter, "
                         "--checkpoint or --base-only)")
    return p


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    if not is_loopback(args.host) and not args.api_key:
        raise ConfigError(f"--host {args.host} is not a loopback address: binding it requires --api-key")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    try:
        adapter = choose_adapter(args, cfg)
    except CheckpointError as exc:
        raise TrainError(str(exc)) from None
    model_path = Path(cfg.model.path) if cfg.model.path else default_model_path()
    gen = Generator(model_path, n_ctx=cfg.model.ctx, threads=resolve_threads(cfg), device=cfg.model.device)
    chat = format_for(gen.tokenizer, cfg.model.chat_template)
    if adapter is None:
        served = [ServedModel(args.model_name or BASE_ID, None)]
        if args.model_name and args.model_name != BASE_ID:
            served.append(ServedModel(BASE_ID, None))
    else:
        data = adapter.read_bytes()
        gen.set_adapter(data)          # fails here, before serving, if llama.cpp rejects it
        served = [ServedModel(args.model_name or adapter.name, data), ServedModel(BASE_ID, None)]
    host = ModelHost(gen, chat, served)
    app = create_app(host, api_key=args.api_key, queue=cfg.serving.queue, max_body_bytes=cfg.serving.max_body_bytes)
    from aiohttp import web

    names = ", ".join(m.id for m in served)
    print(f"serving {names} ({model_path.name}) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True)
    return 0
