"""The one table of what the specification names and this version does not have yet. Every
command, algorithm and binary that is not built refuses through `refuse` with the same words; the
table shrinks as features land."""

from __future__ import annotations

from typing import NoReturn

from retrograd.errors import NotBuiltError

NOT_BUILT: dict[str, str] = {}       # everything the specification names is built


def is_built(name: str) -> bool:
    return name not in NOT_BUILT


def refuse(name: str) -> NoReturn:
    raise NotBuiltError(f"not built yet in this version: {NOT_BUILT[name]}")
