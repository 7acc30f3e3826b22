"""`retrograd` command line: the top-level parser, to which each module of COMMAND_MODULES (under
retrograd.commands) adds its commands with `add_parser`, and the dispatch to the function the chosen
command's parser names (`args.run`). Every failure the user can fix arrives as a RetrogradError and
becomes one `error:` line and its exit code (2 for configuration and usage mistakes, 1 otherwise);
Ctrl-C exits 130. Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

from retrograd import logs
from retrograd.errors import reported

COMMON = "Paths on the command line resolve against the current directory; paths in the TOML file " \
         "resolve against the file's directory."

#: the modules under retrograd.commands whose add_parser adds the commands, in the order of the help
COMMAND_MODULES = ("train", "bench", "chat", "serve", "export", "distill_teacher", "inspect", "models", "tools",
                   "scenarios", "judge", "collect")


def build_parser() -> argparse.ArgumentParser:
    description = ("Fine-tune quantized GGUF language models on the hardware you have: LoRA adapters trained "
                   "directly on the quantized weights, with SFT, GRPO, PPO, distillation and preference training "
                   "(DPO, IPO, SimPO, ORPO), evaluation, chat and an OpenAI-compatible server.")
    epilog = (COMMON + " Environment: RETRO_THREADS overrides training.threads; RETRO_REQUIRE_GPU_RESIDENT=1 equals "
                        "training.require_gpu_resident; RETRO_FAST_TOP_P=1 uses a faster top-p selection (ties may "
                        "resolve differently); RETRO_DEVICE_SAMPLING and RETRO_DEVICE_LOGPROBS, which the "
                        "specification names, are not read (sampling and its log-probs are computed on the host "
                        "on every device); RUST_LOG (alias RETRO_LOG: "
                        "error, warn, info, debug, or retrograd=LEVEL) sets the log level of retrograd and of "
                        "llama.cpp (default warn); RETROGRAD_CACHE moves the model cache; RETRO_STATE_DIR and "
                        "RETRO_API_KEY are retrograd-server's defaults. Manual pages: man retrograd, man "
                        "retrograd-COMMAND. Exit status: 0 success, 1 a failure (data, model, "
                        "checkpoint, device), 2 a configuration or usage mistake, 130 interrupted.")
    ap = argparse.ArgumentParser(prog="retrograd", description=description, epilog=epilog)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:          # each declares its commands, their flags and the function that runs them
        importlib.import_module(f"retrograd.commands.{name}").add_parser(sub)
    # the top-level help lists every command with its flags, then the environment (kept as written)
    listing = ["commands and their flags (retrograd COMMAND --help explains each):"]
    for p in sub.choices.values():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for q in (list(nested[0].choices.values()) if nested else [p]):      # models fetch, tools list, ...
            usage = " ".join(q.format_usage().split()).removeprefix("usage: ")
            listing.append(textwrap.fill(usage, 100, initial_indent="  ", subsequent_indent="      ",
                                         break_on_hyphens=False))
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.description = textwrap.fill(description, 100)
    ap.epilog = "\n".join(listing) + "\n\n" + "\n\n".join(textwrap.fill(par, 100) for par in epilog.split("\n\n"))
    return ap


def main(argv: list[str] | None = None) -> int:
    logs.setup()
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 2
    return dispatch(args)


def dispatch(args: argparse.Namespace) -> int:
    """Run the command; a RetrogradError becomes one `error:` line and its exit code."""
    def body() -> int:
        return args.run(args)
    return reported(body)


if __name__ == "__main__":
    sys.exit(main())
