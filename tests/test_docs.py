"""The documentation keeps up with the tree: the README stays short, docs/architecture.md names
every C file and every package module, docs/configuration.md has a row for every key the code
accepts (with its default), and every relative link in README.md and docs/*.md reaches an
existing file inside the repository (and, with an anchor, an existing heading).

Everything is read at run time, so a file added, moved or removed elsewhere fails here until the
documentation says so."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 250

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines, more than {README_MAX_LINES}: move reference "
                                   "material to a page under docs/ and link it")


def test_the_architecture_names_every_c_file():
    text = (DOCS / "architecture.md").read_text()
    missing = [p.name for p in sorted((ROOT / "native").glob("*.c")) if f"`{p.name}`" not in text]
    assert not missing, f"native/ files not named in docs/architecture.md's table of sources: {missing}"


def package_modules() -> list[str]:
    """Every module of the package, relative to retrograd/ (an empty __init__.py is no module to describe)."""
    pkg = ROOT / "retrograd"
    out = []
    for p in sorted(pkg.rglob("*.py")):
        if p.name == "__init__.py" and not p.read_text().strip():
            continue
        out.append(p.relative_to(pkg).as_posix())
    return out


def test_the_architecture_names_every_module():
    text = (DOCS / "architecture.md").read_text()
    mods = package_modules()
    assert "logs.py" in mods and "agent/tools.py" in mods       # the walk finds subpackages too
    missing = [m for m in mods if f"`{m}`" not in text]
    assert not missing, f"modules not named in docs/architecture.md's table of modules: {missing}"


def test_every_relative_link_resolves_inside_the_repository():
    bad = []
    for doc in doc_files():
        for target in _LINK.findall(prose(doc.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: {target}"
            if ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{where} (outside the repository)")
            elif not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no such heading in {dest.name})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_no_page_points_outside_the_repository():
    bad = [f"{doc.relative_to(ROOT)}:{i}" for doc in doc_files()
           for i, line in enumerate(doc.read_text().splitlines(), 1) if "../shared" in line]
    assert not bad, f"paths outside the repository: {bad}"


# ---- docs/configuration.md ------------------------------------------------------------------------

def config_rows(text: str, heading_mark: str) -> dict[str, list[str]]:
    """key -> cells of every table row under a heading that contains `heading_mark`."""
    rows: dict[str, list[str]] = {}
    inside = False
    for line in text.splitlines():
        if line.startswith("#"):
            inside = heading_mark in line
        elif inside and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    return rows


def default_cell(cell: str) -> object:
    if cell == "unset":
        return None
    return tomllib.loads(f"v = {cell.strip('`')}")["v"]


def sections() -> list[tuple[str, object]]:
    from retrograd.config import Config

    out = []

    def walk(name: str, sec: object) -> None:
        out.append((name, sec))
        hints = typing.get_type_hints(type(sec))
        for f in dataclasses.fields(sec):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(f"{name}.{f.name}", getattr(sec, f.name))

    cfg = Config()
    for f in dataclasses.fields(Config):
        if f.name not in ("source", "base_dir"):
            walk(f.name, getattr(cfg, f.name))
    return out


def test_the_configuration_reference_has_every_key_with_its_default():
    text = (DOCS / "configuration.md").read_text()
    problems = []
    secs = sections()
    assert {"model", "training", "agent.judge", "distributed"} <= {n for n, _ in secs}
    for name, sec in secs:
        rows = config_rows(text, f"`[{name}]`")
        hints = typing.get_type_hints(type(sec))
        for f in dataclasses.fields(sec):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            if f.name not in rows:
                problems.append(f"[{name}].{f.name}: no row")
                continue
            default = getattr(sec, f.name)
            written = default_cell(rows[f.name][2])
            if written != default:
                problems.append(f"[{name}].{f.name}: the page says {rows[f.name][2]}, the code {default!r}")
    assert not problems, "docs/configuration.md is out of date:\n" + "\n".join(problems)


def test_the_configuration_reference_has_the_keys_of_rewards_and_servers():
    from retrograd.agent.servers import SERVER_KEYS
    from retrograd.rewards import BUILTINS

    text = (DOCS / "configuration.md").read_text()
    rewards = config_rows(text, "`[[grpo.rewards]]`")
    options = {k for _, allowed in BUILTINS.values() for k in allowed}
    missing = [k for k in ("name", "function", "weight", *sorted(options)) if k not in rewards]
    missing += [b for b in BUILTINS if f"`{b}`" not in rewards["name"][3]]
    servers = config_rows(text, "`[[agent.servers]]`")
    missing += [f"servers.{k}" for k in SERVER_KEYS if k not in servers]
    assert not missing, f"keys missing from docs/configuration.md: {missing}"
