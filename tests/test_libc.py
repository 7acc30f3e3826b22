"""The generator's C library calls are bound at their first use: it imports on a C library that
lacks them, and the call that needs one fails with one line naming it. No model is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from retrograd.errors import GenerationError
from retrograd.libc import Lazy

# ctypes.CDLL(None), the process's C library, stands in for one without the functions
WITHOUT = """
import ctypes
real = ctypes.CDLL

class Bare:
    def __getattr__(self, name):
        raise AttributeError(name)

ctypes.CDLL = lambda name, *a, **k: Bare() if name is None else real(name, *a, **k)
import retrograd.generation.joint, retrograd.generation.adapter_slot
from retrograd.errors import GenerationError
try:
    retrograd.generation.adapter_slot._fmemopen(b"x", 1, b"rb")
except GenerationError as exc:
    print(exc)
"""


def test_the_generator_imports_on_a_c_library_without_them():
    out = subprocess.run([sys.executable, "-c", WITHOUT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("this C library has no fmemopen"), out.stdout


def test_a_bound_function_works_and_a_missing_one_names_itself():
    import ctypes

    strlen = Lazy("strlen", ctypes.c_size_t, [ctypes.c_char_p])
    assert strlen(b"retrograd") == 9 and strlen.bind() is strlen.bind()
    with pytest.raises(GenerationError, match="no no_such_function_here"):
        Lazy("no_such_function_here", None, [])()
