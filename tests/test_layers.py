"""The package's imports flow one way. Each module belongs to a layer; a module may import its own
layer and the layers below, never above, and no set of modules imports itself round in a cycle.
Read from the source with ast (imports inside functions count too), so the test fails the moment
someone reaches up a layer, whatever the import looks like at run time."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "retrograd"

# lowest first; a module's layer is the first prefix that matches its dotted name
LAYERS: list[tuple[str, ...]] = [
    ("errors", "fsutil", "_pins", "batch", "models", "logs", "memory", "libc"),  # no dependencies on the rest
    ("config", "sections"),
    ("run_setup", "report", "trackers"),
    ("data",),
    ("native",),
    ("adapter", "engine", "checkpoint", "teacher", "context"),      # the trainable model and its files
    ("generation",),                                                # llama.cpp
    ("distributed",),                                               # Ray workers: replicas, remote sampling
    ("rewards", "losses"),                                          # pure functions over text and log-probs
    ("eval",),                                                      # measurements
    ("agent",),                                                     # tools, scenarios, multi-turn rollouts
    ("algorithms",),                                                # recipes
    ("trainer",),                                                   # the loop
    ("serve",),
    ("commands",),
    ("cli",),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(name: str) -> int:
    if name == "retrograd":
        return 0                       # the package's __init__ holds only the version
    short = name.split(".", 1)[1]
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if short == p or short.startswith(p + "."):
                return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in tests/test_layers.py")


def _is_module(dotted: str) -> bool:
    p = PACKAGE.parent / dotted.replace(".", "/")
    return p.with_suffix(".py").exists() or p.is_dir()


def imports_of(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("retrograd"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.startswith("retrograd"):
                found.add(mod)
                # `from retrograd import checkpoint` names a module, not an attribute
                found.update(f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}"))
    return {m for m in found if m != "retrograd._native"}


def graph() -> dict[str, set[str]]:
    mods = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out = {}
    for name, path in mods.items():
        deps = set()
        for m in imports_of(path, name):
            # importing a package means its __init__; importing a module inside means that module
            target = m if m in mods else m.rsplit(".", 1)[0]
            if target in mods and target != name:
                deps.add(target)
        out[name] = deps
    return out


def test_every_module_has_a_layer_and_imports_only_downwards():
    bad = []
    for name, deps in graph().items():
        for d in deps:
            if layer_of(d) > layer_of(name):
                bad.append(f"{name} (layer {layer_of(name)}) imports {d} (layer {layer_of(d)})")
    assert not bad, "imports that run up the layers:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(g[n]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_violation(tmp_path):
    """The test is not vacuous: an upward import in a module is found."""
    name = "retrograd.data.formats"
    assert layer_of("retrograd.trainer") > layer_of(name)
    fake = tmp_path / "formats.py"
    fake.write_text("def f():\n    from retrograd.trainer import train\n")
    assert "retrograd.trainer" in imports_of(fake, name)
