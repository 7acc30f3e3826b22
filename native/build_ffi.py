"""cffi builder for retrograd._native: compiles native/*.c against vendor/llama.cpp's headers and
links them to the libggml* that llama-cpp-python installed, so the process holds one ggml.

The cdef is the block between RG_CDEF_BEGIN and RG_CDEF_END of native/retrograd.h (the ABI) and of
native/retrograd_test.h (the entry points for tests and benchmarks), plus the one Python callback
the engine calls back into.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENDOR = ROOT / "vendor" / "llama.cpp"
ORIGIN = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"


def llama_cpp_lib_dir() -> Path:
    """The directory holding llama-cpp-python's libggml*.so, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: llama-cpp-python is not installed in this environment; "
                 "install it first (see README: scripts/setup.sh)")
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    if not (lib / "libggml-base.so").exists() and not (lib / "libggml-base.dylib").exists():
        sys.exit(f"error: {lib} has no libggml-base; llama-cpp-python was built without shared ggml")
    return lib


HEADERS = ("retrograd.h", "retrograd_test.h")
#: the C flags of the real build (scripts/check_arm.sh reads this list to cross-compile with the same)
COMPILE_ARGS = ["-O3", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Wno-unused-parameter"]
DEBUG_COMPILE_ARGS = ["-O0", "-g", "-std=c11", "-D_GNU_SOURCE", "-Wall"]       # RETRO_NATIVE_DEBUG=1


def cdef_block(name: str) -> str:
    header = (HERE / name).read_text()
    begin = header.index("/* RG_CDEF_BEGIN */") + len("/* RG_CDEF_BEGIN */")
    end = header.index("/* RG_CDEF_END */")
    return header[begin:end]


def cdef_text() -> str:
    return "".join(cdef_block(h) for h in HEADERS) + """
extern "Python" int rg_py_coeff(void *, int32_t, const float *, const float *, float *,
                                int32_t, int32_t, const float *, float *);
"""


def make_ffi() -> FFI:
    if not (VENDOR / "ggml" / "include" / "ggml.h").exists():
        sys.exit("error: vendor/llama.cpp is missing; run: python scripts/fetch_vendor.py")
    lib = llama_cpp_lib_dir()
    ffi = FFI()
    ffi.cdef(cdef_text())
    # setuptools insists on paths relative to setup.py
    sources = sorted(os.path.relpath(p, ROOT) for p in HERE.glob("*.c"))
    extra_compile = DEBUG_COMPILE_ARGS if os.environ.get("RETRO_NATIVE_DEBUG") else COMPILE_ARGS
    ffi.set_source(
        "retrograd._native",
        "".join(f'#include "{h}"\n' for h in HEADERS),
        sources=sources,
        include_dirs=[str(HERE), str(VENDOR / "ggml" / "include")],
        library_dirs=[str(lib)],
        libraries=["ggml", "ggml-base", "ggml-cpu"],
        extra_compile_args=extra_compile,
        # first the llama-cpp-python beside the installed package (a wheel installed anywhere), then the
        # one it was built against (an editable install in the source tree)
        extra_link_args=[f"-Wl,-rpath,{ORIGIN}/../llama_cpp/lib", f"-Wl,-rpath,{lib}"],
    )
    return ffi


ffibuilder = make_ffi()

