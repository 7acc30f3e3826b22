"""The native sources' layout: no cycle between C files, the environment read in one place, and an
ABI (native/retrograd.h) whose every function is defined and used, apart from the entry points for
tests and benchmarks (native/retrograd_test.h).

A file depends on another when a function it defines calls (or takes the address of) a function the
other defines; those dependencies must form no cycle, so each file can be read, tested and changed
knowing only the files below it. Read from the source with a small parser (comments, strings and
preprocessor lines dropped, brace blocks at file level taken as function bodies), so the test fails
the moment someone reaches back up, whatever the build makes of it. The parser itself is checked on
small files written here, so a parser that finds nothing cannot pass the real check."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"

_NOT_FUNCTIONS = {"if", "for", "while", "switch", "return", "sizeof", "defined"}
_ATTRIBUTE = re.compile(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)")


def _blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group())


def strip(text: str) -> str:
    """C source without comments, string and character literals, or preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", _blank, text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(\\.|[^'\\\n])*'", "''", text)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", text, flags=re.M)


def defined_name(head: str) -> str | None:
    """The function a brace block at file level defines, from the text before its brace: the name
    right before the last parenthesised group that ends the text (None: a struct, an enum, an
    initializer)."""
    head = _ATTRIBUTE.sub(" ", head).rstrip()
    if not head.endswith(")"):
        return None
    depth = 0
    for i in range(len(head) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(head[i], 0)
        if depth == 0:
            m = re.search(r"([A-Za-z_]\w*)\s*$", head[:i])
            return m.group(1) if m and m.group(1) not in _NOT_FUNCTIONS else None
    return None


def functions(text: str) -> dict[str, tuple[bool, str]]:
    """Functions defined in a C file: name -> (static, body)."""
    text = strip(text)
    out, depth, start, end = {}, 0, 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                head = text[end:start].rsplit(";", 1)[-1]
                name = defined_name(head)
                if name:
                    out[name] = (re.search(r"\bstatic\b", head) is not None, text[start:i + 1])
                end = i + 1
    return out


def dependencies(sources: dict[str, str]) -> dict[str, dict[str, set[str]]]:
    """file -> {file it depends on: the functions it uses there}. A name a file defines itself (a
    static helper) is its own even where another file has one of that name."""
    parsed = {name: functions(text) for name, text in sources.items()}
    where: dict[str, list[str]] = {}
    for name, defs in parsed.items():
        for fn, (static, _) in defs.items():
            if not static:
                where.setdefault(fn, []).append(name)
    deps: dict[str, dict[str, set[str]]] = {name: {} for name in sources}
    for name, defs in parsed.items():
        for _, body in defs.values():
            for ident in set(re.findall(r"[A-Za-z_]\w*", body)) - defs.keys():
                for other in where.get(ident, []):
                    if other != name:
                        deps[name].setdefault(other, set()).add(ident)
    return deps


def cycle(deps: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of files (the first file repeated at the end), or None."""
    state: dict[str, int] = {}        # 1 on the path, 2 done
    path: list[str] = []

    def visit(f: str) -> list[str] | None:
        state[f] = 1
        path.append(f)
        for g in sorted(deps.get(f, {})):
            if state.get(g) == 1:
                return path[path.index(g):] + [g]
            if g not in state and (found := visit(g)):
                return found
        path.pop()
        state[f] = 2
        return None

    for f in sorted(deps):
        if f not in state and (found := visit(f)):
            return found
    return None


def native_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(NATIVE.glob("*.c"))}


def test_the_parser_finds_definitions_and_uses():
    src = {
        "a.c": '/* b_only() in a comment */\nstatic int helper(int x) { return x; }\n'
               'int a_entry(void) {\n    const char * s = "b_only()";\n    return helper(b_only(1));\n}\n'
               'static const int table[2] = { 1, 2 };\n',
        "b.c": "int b_only(int x) {\n    if (x) { return x; }\n    return 0;\n}\n"
               "static int helper(int x) { return -x; }\n"
               "__attribute__((target(\"avx2,fma\")))\nstatic void kern(float (*f)(int), int n) { }\n"
               "typedef struct { int x; } b_pair;\nstatic const b_pair one = (b_pair) { 1 };\n"
               "void * b_pick(void) { return (void *) kern; }\n",
    }
    a, b = functions(src["a.c"]), functions(src["b.c"])
    assert set(a) == {"helper", "a_entry"} and a["helper"][0] and not a["a_entry"][0]
    assert set(b) == {"b_only", "helper", "kern", "b_pick"}
    # a calls b's b_only; its own static helper is not b's; comments and strings name nothing
    assert dependencies(src) == {"a.c": {"b.c": {"b_only"}}, "b.c": {}}
    assert cycle(dependencies(src)) is None


def test_a_cycle_between_files_is_found():
    src = {
        "a.c": "int a_entry(void) { return b_mid(); }\n",
        "b.c": "int b_mid(void) { return c_low(); }\n",
        "c.c": "int c_low(void) { return 0; }\nint c_back(void) { return a_entry(); }\n",
        "d.c": "static int d_own(void) { return c_low(); }\n",
    }
    found = cycle(dependencies(src))
    assert found == ["a.c", "b.c", "c.c", "a.c"]
    # a function pointer is a use too
    src["c.c"] = "int c_low(void) { return 0; }\nvoid * c_back(void) { return (void *) a_entry; }\n"
    assert cycle(dependencies(src)) == ["a.c", "b.c", "c.c", "a.c"]
    del src["c.c"]
    assert cycle(dependencies(src)) is None


def test_no_cycle_between_native_files():
    sources = native_sources()
    deps = dependencies(sources)
    # the parser sees the real tree: the engine's files use the others, and util.c uses none
    assert {"microbatch.c", "recompute.c", "head.c", "util.c"} <= deps["engine.c"].keys()
    assert deps["util.c"] == {}
    found = cycle(deps)
    assert found is None, "native files depend on each other round in a cycle: " + " -> ".join(
        f"{f} ({', '.join(sorted(deps[f][g]))})" for f, g in zip(found, found[1:])) + f" -> {found[-1]}"



def test_the_environment_is_read_in_one_place():
    """Settings reach the engine through its setters, never from the environment of a hot path: the
    variables the library reads (RETRO_TRACE_NODES and RETRO_VK_NO_SYNC, debugging switches for a
    whole process) are read once, in util.c."""
    readers = [name for name, text in native_sources().items() if re.search(r"\bgetenv\s*\(", strip(text))]
    assert readers == ["util.c"]


def declared(header: str) -> dict[str, str]:
    """Functions declared in a header's cffi block: name -> return type."""
    text = (NATIVE / header).read_text()
    block = strip(text[text.index("/* RG_CDEF_BEGIN */"):text.index("/* RG_CDEF_END */")])
    return {m.group(2): " ".join(m.group(1).split()) for m in re.finditer(r"([\w\s*]+?)\b(rg_\w+)\s*\(", block)
            if not m.group(1).strip().startswith("typedef")}


def used_from(*folders: str) -> str:
    return "".join(p.read_text() for f in folders for p in sorted((ROOT / f).rglob("*.py")))


def test_every_exported_function_is_defined_and_used():
    """retrograd.h is the whole ABI: each function it declares is defined by a native file and called
    by the package (through native.py's cffi); the test and benchmark entry points are declared in
    retrograd_test.h instead, each called by the package, the tests or the scripts. Setters answer
    with a status, as every fallible call does."""
    abi, testing = declared("retrograd.h"), declared("retrograd_test.h")
    assert "rg_engine_accumulate" in abi and "rg_gemm_check" in testing and "rg_rows_quantize" in abi
    assert not abi.keys() & testing.keys()
    defined = {fn for text in native_sources().values() for fn, (static, _) in functions(text).items() if not static}
    assert not (abi.keys() | testing.keys()) - defined, "declared but not defined"
    package, everywhere = used_from("retrograd"), used_from("retrograd", "tests", "scripts")
    def unused(names, text):
        return [f for f in names if not re.search(rf"\blib\.{f}\b", text)]

    assert not unused(abi, package), "in the ABI, used by nobody in the package"
    assert not unused(testing, everywhere), "declared for tests, used by nobody"
    setters = {f: ret for f, ret in {**abi, **testing}.items() if "_set_" in f}
    assert len(setters) >= 6 and all(ret == "rg_status" for ret in setters.values()), setters
