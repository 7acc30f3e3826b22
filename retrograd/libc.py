"""The C library's functions that retrograd calls through ctypes (the generator's fmemopen,
fopencookie, setvbuf and fclose), bound at their first call rather than at import: a module that
uses one imports on a C library without it (fopencookie is glibc's; macOS and old musl have none),
and only the call that needs it fails, with a GenerationError that names the function."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

from retrograd.errors import GenerationError


@functools.cache
def _process() -> ctypes.CDLL:
    return ctypes.CDLL(None)            # the symbols already loaded in the process: the C library's


class Lazy:
    """A C library function bound, with its signature, the first time it is called."""

    def __init__(self, name: str, restype: Any, argtypes: Sequence[Any]) -> None:
        self.name, self.restype, self.argtypes = name, restype, list(argtypes)
        self._fn: Any = None

    def bind(self) -> Any:
        if self._fn is None:
            try:
                fn = getattr(_process(), self.name)
            except (OSError, AttributeError):
                raise GenerationError(f"this C library has no {self.name}, which llama.cpp's adapter loading "
                                      "needs here (glibc has it)") from None
            fn.restype, fn.argtypes = self.restype, self.argtypes
            self._fn = fn
        return self._fn

    def __call__(self, *args: Any) -> Any:
        return self.bind()(*args)
