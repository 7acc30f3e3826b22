"""`retrograd inspect` and `retrograd preflight`: what a GGUF is, and whether the chosen device can
run its training graph."""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import TYPE_CHECKING

from retrograd.commands import Subparsers, common_flags, positive
from retrograd.errors import RetrogradError, UsageError
from retrograd.models import default_model_path

if TYPE_CHECKING:
    from retrograd import native


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("inspect", help="architecture, tensor types, LoRA targets and device of a GGUF",
                       description="Print the model's architecture, tensor types, suggested LoRA targets and the "
                                   "device that will be used.")
    common_flags(p, config=False)
    p.set_defaults(run=run_inspect)

    p = sub.add_parser("preflight", help="list the training-graph ops the device cannot run",
                       description="Build the training graph without running it and list the operations the device "
                                   "cannot run (they fall back to the CPU and slow every step), then the slow paths: "
                                   "nodes the device runs through a route known to cost more than the CPU build's, "
                                   "each with the reason. The same check runs at the start of every training run.")
    common_flags(p, config=False)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down", metavar="q,k,v",
                   help="LoRA targets (default: all seven)")
    p.add_argument("--strict", action="store_true",
                   help="exit with an error if any op is unsupported (slow paths are reported, not errors)")
    p.add_argument("--tokens", type=int, default=512, metavar="N", help="micro-batch size of the graph (default 512)")
    p.set_defaults(run=run_preflight)


def _model_path(args: argparse.Namespace) -> Path:
    if args.model:
        p = Path(args.model).resolve()
        if not p.is_file():
            raise RetrogradError(f"{p}: no such model file")
        return p
    return default_model_path()


def suggested_targets(info: native.ModelInfo) -> str:
    """All seven projections for small models; attention only when the model is large for a laptop."""
    if info.n_params > 3_000_000_000:
        return "q,k,v,o (the model is large: start with attention only)"
    return "q,k,v,o,gate,up,down"


def run_inspect(args: argparse.Namespace) -> int:
    from retrograd import native

    path = _model_path(args)
    m = native.Model(path, device=args.device or "auto", threads=1)
    i = m.info
    types = collections.Counter(t.upper() for _, t, _ in m.tensors())
    print(f"model        {path}")
    print(f"architecture {i.arch}")
    print(f"parameters   {i.n_params / 1e6:.1f} M in {i.weight_bytes / 2**20:.1f} MiB "
          f"({i.weight_bytes * 8 / max(i.n_params, 1):.2f} bits per weight)")
    print(f"layers       {i.n_layer}, width {i.n_embd}, feed-forward {i.n_ff}")
    print(f"attention    {i.n_head} heads ({i.n_head_kv} key/value), head size {i.head_dim}"
          + (f", sliding window {i.n_swa} on {i.n_swa_layers} layers" if i.n_swa else "")
          + (", q/k norms" if i.has_qk_norm else ""))
    print(f"rope         base {i.rope_base:g}" + (f" (local layers {i.rope_base_swa:g})" if i.n_swa else "")
          + f", {'neox' if i.rope_mode == 2 else 'normal'} mode, {i.n_rot} dims")
    print(f"vocabulary   {i.n_vocab}, output {'tied to the embeddings' if i.tied_output else 'separate'}")
    print(f"context      {i.n_ctx_train} (training)")
    print("tensor types " + ", ".join(f"{t} x{n}" for t, n in types.most_common()))
    print(f"LoRA targets {suggested_targets(i)}")
    dev = m.device
    print(f"device       {dev.name} ({dev.kind}, {dev.description})" + (", weights memory-mapped" if i.mmapped else ""))
    return 0


def run_preflight(args: argparse.Namespace) -> int:
    from retrograd import native

    positive(args, "tokens")
    path = _model_path(args)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in native.TARGETS]
    if bad or not targets:
        raise UsageError(f"--targets: expected some of {','.join(native.TARGETS)}, got {args.targets!r}")
    m = native.Model(path, device=args.device or "auto", threads=1)
    e = native.Engine(m)
    lora = native.Lora(m, targets, 16, 32.0)
    unsupported = e.preflight(lora, args.tokens)
    dev = m.device
    scope = f"{','.join(targets)}, {args.tokens} tokens"
    if not unsupported:
        print(f"{dev.name}: every op of the training graph ({scope}) runs on the device")
    else:
        print(f"{dev.name} cannot run these ops of the training graph ({scope}); they fall back to the CPU:")
        for op, n in unsupported.items():
            print(f"  {op:<20} {n}")
    if dev.kind == "cpu":
        print(cpu_route())
    slow = e.slow_paths() + device_slow_paths(dev)
    if slow:
        print("slow paths (they run on the device, at a cost):")
        for what, n, why in slow:
            print(f"  {what} ({n}): {why}")
    return 1 if unsupported and args.strict else 0


def cpu_route() -> str:
    """Which route [training].matmul_precision = "auto" takes for the frozen weights here, and why."""
    from retrograd import native

    kind, kernel = native.conv_type("auto"), native.matmul_kernel("auto")
    why = {"amx-bf16": "this CPU has AMX tiles",
           "avx512-bf16": "this CPU has AVX512-BF16 dot products",
           "avx2-f16": "this CPU has AVX2, FMA and F16C but no AVX512-BF16 (F32 activations, F16 weights)",
           "ggml": "no packed kernel runs here: ggml's own product"}[kernel]
    return f"base-weight products (matmul_precision auto): {kind}, packed kernel {kernel}: {why}"


def device_slow_paths(dev: native.DeviceInfo) -> list[tuple[str, int, str]]:
    """Slow paths of the device as a whole (not of any op)."""
    text = f"{dev.name} {dev.description}".lower()
    if dev.kind != "cpu" and ("llvmpipe" in text or "lavapipe" in text or "swiftshader" in text):
        return [("software GPU driver", 1, f"{dev.description} runs its shaders on the CPU: every op is "
                 "slower than the CPU build's, and F32 products go through F16 (about 2e-3 relative); Mesa's "
                 "lavapipe before 25.0 kills a training now and then (a driver fault: resume from the last "
                 "checkpoint, or use Mesa 25, which scripts/build_vulkan.sh fetches)")]
    return []

