"""The command modules own their parsers: every module under retrograd.commands is either a
`retrograd` command (its `add_parser` declares the command and the function that runs it, and
`retrograd --help` lists it) or a program of its own named in pyproject's [project.scripts]. Building
the parser loads no engine, llama.cpp or web server. No model is loaded here."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import retrograd.commands
from retrograd.cli import COMMAND_MODULES

ROOT = Path(__file__).resolve().parent.parent
#: modules that are programs of their own (`main`, in [project.scripts]) or a helper of one
PROGRAMS = {"server": "retrograd-server", "profile": "retrograd-profile"}
HELPERS = {"profile_sft"}          # retrograd-profile's SFT phases


def commands_of(module: str) -> dict[str, argparse.ArgumentParser]:
    """The commands a module's add_parser adds to an empty set of subcommands."""
    sub = argparse.ArgumentParser(prog="retrograd").add_subparsers(dest="command")
    importlib.import_module(f"retrograd.commands.{module}").add_parser(sub)
    return dict(sub.choices)


def runs_of(p: argparse.ArgumentParser) -> list:
    """The `run` each leaf parser sets (a command with actions sets it on each action, or on itself)."""
    nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    leaves = list(nested[0].choices.values()) if nested else []
    return [q.get_default("run") or p.get_default("run") for q in leaves] or [p.get_default("run")]


def test_every_command_module_has_add_parser_and_is_listed():
    modules = {m.name for m in pkgutil.iter_modules(retrograd.commands.__path__)}
    assert modules == set(COMMAND_MODULES) | set(PROGRAMS) | HELPERS, \
        "a new module under retrograd/commands: add it to cli.COMMAND_MODULES (or PROGRAMS/HELPERS here)"
    top = subprocess.run([sys.executable, "-m", "retrograd.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert top.returncode == 0, top.stderr
    listed = set(re.findall(r"^ {4}(\S+)", top.stdout.split("options:")[0], re.M))
    seen: set[str] = set()
    for module in COMMAND_MODULES:
        added = commands_of(module)
        assert added, f"retrograd.commands.{module}.add_parser adds no command"
        for name, p in added.items():
            assert name in listed, f"`retrograd --help` does not list {name} ({module})"
            assert all(callable(r) for r in runs_of(p)), f"{name}: add_parser sets no `run`"
            assert name not in seen, f"{name} is added twice"
            seen.add(name)
    assert seen == listed, f"listed but added by no command module: {listed - seen}"


def test_the_programs_of_their_own_are_the_scripts():
    text = (ROOT / "pyproject.toml").read_text()
    for module, script in PROGRAMS.items():
        assert f'{script} = "retrograd.commands.{module}:main"' in text, script
        out = subprocess.run([sys.executable, "-m", f"retrograd.commands.{module}", "--help"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.startswith(f"usage: {script}"), out.stderr


def test_building_the_parser_loads_no_engine():
    """cli.py imports every command module: their heavy imports wait until the command runs."""
    code = ("import sys; from retrograd.cli import build_parser; build_parser(); "
            "print(' '.join(sorted(m for m in ('numpy', 'llama_cpp', 'aiohttp', 'jinja2', 'retrograd.native', "
            "'retrograd.trainer', 'retrograd.generation') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"building the parser imported {out.stdout.strip()}"
