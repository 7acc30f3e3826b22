"""User Python functions named as "file.py:function" (tools, verify functions): loading them, the JSON schema of
a tool function's arguments, and running a tool call in a thread.

The file is imported once per resolved path under a private module name, with its own directory on sys.path
while it is executed so that it can import its neighbours. Problems are `FunctionRefError`s without a location;
callers add the file, line or key they came from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import hashlib
import importlib.util
import inspect
import json
import os
import re
import sys
import threading
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from retrograd.errors import RetrogradError

_modules: dict[Path, ModuleType] = {}
_lock = threading.Lock()


class FunctionRefError(RetrogradError):
    """A "file.py:function" reference that is malformed, missing or not importable."""


def split_ref(ref: object) -> tuple[str, str]:
    """("file.py", "function") from "file.py:function"; FunctionRefError when the text has another shape."""
    if not isinstance(ref, str) or ref.count(":") < 1:
        raise FunctionRefError(f"expected \"file.py:function\", got {ref!r}")
    file, _, name = ref.rpartition(":")
    if not file or not name.isidentifier():
        raise FunctionRefError(f"expected \"file.py:function\", got {ref!r}")
    return file, name


def resolve_file(ref: str, base: Path) -> Path:
    file, _ = split_ref(ref)
    path = Path(file).expanduser()
    return (path if path.is_absolute() else Path(base) / path).resolve()


def load_function(ref: str, base: Path) -> Callable:
    """The function `ref` names, its file resolved against `base`."""
    _, name = split_ref(ref)
    path = resolve_file(ref, base)
    module = _import(path)
    fn = getattr(module, name, None)
    if fn is None:
        raise FunctionRefError(f"{path} has no function {name!r}")
    if not callable(fn):
        raise FunctionRefError(f"{path}: {name} is not a function ({type(fn).__name__})")
    return fn


def _import(path: Path) -> ModuleType:
    with _lock:
        if path in _modules:
            return _modules[path]
        if not path.is_file():
            raise FunctionRefError(f"{path}: no such file")
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
        mod_name = f"retrograd_user_{path.stem if path.stem.isidentifier() else 'mod'}_{digest}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise FunctionRefError(f"{path}: cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        added = str(path.parent) not in sys.path
        if added:
            sys.path.insert(0, str(path.parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise FunctionRefError(f"{path}: importing it failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if added:
                try:
                    sys.path.remove(str(path.parent))
                except ValueError:
                    pass
        _modules[path] = module
        return module


# --- tool schemas and calls ---------------------------------------------------------------------------------

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Params|Keyword Args|Returns?|Yields?|Raises|Examples?|Notes?|"
                      r"See Also)\s*:?\s*$")


def _type_schema(tp: Any) -> dict:
    if tp is inspect.Parameter.empty or tp is Any or tp is object:
        return {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        inner = _type_schema(args[0])
        for extra in args[1:]:
            desc = extra if isinstance(extra, str) else getattr(extra, "description", None)
            if isinstance(desc, str) and desc:
                inner = {**inner, "description": desc}
        return inner
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        parts = [a for a in args if a is not type(None)]
        if len(parts) == 1:
            return _type_schema(parts[0])
        return {"anyOf": [_type_schema(a) for a in parts]}
    if origin is typing.Literal:
        vals = list(args)
        out: dict = {"enum": vals}
        kinds = {_SCALARS.get(type(v)) for v in vals}
        if len(kinds) == 1 and None not in kinds:
            out["type"] = kinds.pop()
        return out
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp is Path or (isinstance(tp, type) and issubclass(tp, os.PathLike)):
        return {"type": "string"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if tp in (list, tuple, set, frozenset) or origin in (list, tuple, set, frozenset, Sequence, Iterable):
        out = {"type": "array"}
        if args and args[0] is not Ellipsis:
            out["items"] = _type_schema(args[0])
        return out
    if tp is dict or origin is dict or (origin is not None and getattr(origin, "__name__", "") == "Mapping"):
        return {"type": "object"}
    return {}


_PARAM_SECTIONS = ("args", "arguments", "parameters", "params", "keyword args")


def _parse_doc(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google, Sphinx or NumPy style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    section, current, base = "", "", None
    i = 0
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        i += 1
        m = _SECTION.match(stripped)
        underline = i < len(lines) and re.match(r"^\s*-{3,}\s*$", lines[i])
        if m and (stripped.endswith(":") or underline):
            section, current, base = m.group(1).lower(), "", None
            i += 1 if underline else 0
            continue
        sphinx = re.match(r"^:param\s+(?:[^:]*\s)?\*{0,2}(\w+)\s*:\s*(.*)$", stripped)
        if sphinx:
            section, current = "sphinx", sphinx.group(1)
            params[current] = sphinx.group(2).strip()
        elif stripped.startswith(":"):
            section, current = "sphinx-other", ""
        elif not section:
            summary.append(line)
        elif section == "sphinx" and current and stripped:
            params[current] = (params[current] + " " + stripped).strip()
        elif section in _PARAM_SECTIONS and stripped:
            indent = len(line) - len(line.lstrip())
            base = indent if base is None else base
            numpy = re.match(r"^\*{0,2}(\w+)\s+:(.*)$", stripped)
            google = re.match(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
            if indent <= base and numpy:
                current, params[numpy.group(1)] = numpy.group(1), ""
            elif indent <= base and google:
                current, params[google.group(1)] = google.group(1), google.group(2).strip()
            elif current:
                params[current] = (params[current] + " " + stripped).strip()
    paras = "\n".join(summary).strip().split("\n\n")
    description = "\n\n".join(" ".join(p.split()) for p in paras if p.strip())
    return description, params


def function_schema(fn: Callable) -> tuple[str, dict, bool]:
    """(description, JSON schema of the arguments, whether it takes the rollout's `state`) of a Python function,
    from its signature, type hints and docstring. The `state` parameter, *args and **kwargs are not part of the
    schema; a positional-only parameter is a FunctionRefError."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:
        hints = {}
    description, docs = _parse_doc(inspect.getdoc(fn) or "")
    props: dict[str, dict] = {}
    required: list[str] = []
    wants_state = False
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name == "state":
            if p.kind is p.POSITIONAL_ONLY:
                raise FunctionRefError(f"{fn.__qualname__}: the state parameter cannot be positional-only")
            wants_state = True
            continue
        if p.kind is p.POSITIONAL_ONLY:
            raise FunctionRefError(f"{fn.__qualname__}: parameter {p.name!r} is positional-only; tools take keywords")
        schema = dict(_type_schema(hints.get(p.name, p.annotation)))
        if docs.get(p.name) and "description" not in schema:
            schema["description"] = docs[p.name]
        if p.default is p.empty:
            required.append(p.name)
        else:
            try:
                json.dumps(p.default)
                schema["default"] = p.default
            except (TypeError, ValueError):
                pass
        props[p.name] = schema
    input_schema: dict = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        input_schema["required"] = required
    return description, input_schema, wants_state


def text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def call_in_thread(fn: Callable, kwargs: dict, name: str = "tool") -> concurrent.futures.Future:
    """Run a Python tool in a daemon thread (one that hangs past its deadline is abandoned, and cannot hold up
    the interpreter's exit)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            value = fn(**kwargs)
            if inspect.isawaitable(value):
                async def wait(v: Any = value) -> Any:
                    return await v
                value = asyncio.run(wait())
            fut.set_result(value)
        except Exception as exc:
            fut.set_exception(exc)
        except BaseException as exc:  # noqa: B036 - sys.exit() in a tool is its error, not the caller's exit
            fut.set_exception(RuntimeError(f"the tool raised {type(exc).__name__}({exc})"))

    threading.Thread(target=target, name=f"tool-{name}", daemon=True).start()
    return fut
