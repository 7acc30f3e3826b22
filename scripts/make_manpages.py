"""Write the manual pages (man/man1/*.1) from the argparse parsers, with argparse-manpage:
retrograd(1), one retrograd-COMMAND(1) per command, retrograd-server(1) and retrograd-profile(1).
They are committed and installed with the package (share/man/man1); tests/test_cli.py checks
that they match what the parsers say now, so run this after changing a flag:

    python scripts/make_manpages.py            # rewrite man/man1
    python scripts/make_manpages.py --check    # exit 1 if a page is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "man" / "man1"


def parsers() -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Every page's name, the parser it documents and its one-line summary."""
    from retrograd.cli import build_parser
    from retrograd.commands.profile import parser as profile_parser
    from retrograd.commands.server import parser as server_parser

    top = build_parser()
    pages = {"retrograd": (top, "fine-tune quantized GGUF language models on the hardware you have")}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            summary = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                sub.prog = f"retrograd {name}"
                pages[f"retrograd-{name}"] = (sub, summary.get(name) or "")
    pages["retrograd-server"] = (server_parser(), "a long-running service that owns training runs and serves their "
                                                  "weights")
    pages["retrograd-profile"] = (profile_parser(), "where the time of a GRPO or SFT training step goes")
    return pages


def render_all() -> dict[str, str]:
    import re

    from argparse_manpage.manpage import Manpage

    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    out = {}
    for name, (parser, summary) in parsers().items():
        data = {"project_name": "retrograd", "version": version, "date": "2026-12-03",
                "manual_title": "retrograd manual"}
        page = Manpage(parser, _data=data)
        page.prog, page.description = name, summary       # title and NAME: retrograd-train - ...
        text = str(page)
        if name != "retrograd":
            text += "\n.SH SEE ALSO\nretrograd(1)\n"
        out[name] = text
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a page is out of date")
    args = ap.parse_args()
    pages = render_all()
    stale = [n for n, t in pages.items() if not (OUT / f"{n}.1").exists() or (OUT / f"{n}.1").read_text() != t]
    extra = sorted(p.stem for p in OUT.glob("*.1") if p.stem not in pages)
    if args.check:
        for n in stale + extra:
            print(f"out of date: man/man1/{n}.1", file=sys.stderr)
        return 1 if stale or extra else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for n, t in pages.items():
        (OUT / f"{n}.1").write_text(t)
    for n in extra:
        (OUT / f"{n}.1").unlink()
    print(f"wrote {len(pages)} pages to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
