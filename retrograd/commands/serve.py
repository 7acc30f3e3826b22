"""`retrograd serve`: the trained adapter (and the base model beside it) behind the OpenAI API."""

from __future__ import annotations

import argparse
import sys

from retrograd.commands import choose_adapter, load_config
from retrograd.data.chat import format_for
from retrograd.errors import UsageError
from retrograd.generation.batching import auto_parallel, serving_generator
from retrograd.run_setup import resolve_model, resolve_threads
from retrograd.serve.app import BASE_ID, ModelHost, ServedModel, create_app, is_loopback
from retrograd.serve.scheduler import Scheduler


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    if not is_loopback(args.host) and not args.api_key:
        raise UsageError(f"--host {args.host} is not a loopback address: binding it requires --api-key")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    adapter = choose_adapter(args, cfg)
    model_path = resolve_model(cfg)
    parallel = cfg.serving.parallel or auto_parallel(cfg.model.ctx)
    gen = serving_generator(model_path, n_ctx=cfg.model.ctx, parallel=parallel, threads=resolve_threads(cfg),
                            device=cfg.model.device, weights=cfg.serving.generator_weights,
                            dora=cfg.lora.variant == "dora")
    chat = format_for(gen.tokenizer, cfg.model.chat_template)
    if adapter is None:
        served = [ServedModel(args.model_name or BASE_ID, None)]
        if args.model_name and args.model_name != BASE_ID:
            served.append(ServedModel(BASE_ID, None))
    else:
        data = adapter.read_bytes()
        gen.set_adapter(data)          # fails here, before serving, if llama.cpp rejects it
        served = [ServedModel(args.model_name or adapter.name, data), ServedModel(BASE_ID, None)]
    adapters = {m.id: m.adapter for m in served}
    sched = Scheduler(gen, parallel=parallel, queue=cfg.serving.queue, wait_seconds=cfg.serving.wait_seconds,
                      adapter_of=adapters.__getitem__)
    host = ModelHost(sched, chat, served)
    app = create_app(host, api_key=args.api_key, max_body_bytes=cfg.serving.max_body_bytes)
    from aiohttp import web

    names = ", ".join(m.id for m in served)
    print(f"serving {names} ({model_path.name}) on http://{args.host}:{args.port}/v1: {parallel} requests decoded "
          f"together, {cfg.serving.queue} more may wait", file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True)
    return 0
