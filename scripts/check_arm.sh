#!/usr/bin/env bash
# Does the native library build for ARM (aarch64, e.g. Apple Silicon under Linux, Graviton, a
# Raspberry Pi 5)? Cross-compiles every native/*.c with Debian's aarch64 toolchain against the same
# ggml headers and flags as the real build (native/build_ffi.py), with warnings as errors. The x86
# kernels (gemm.c, gemm_avx2.c, gemm_amx.c, outer.c, matmul.c' dispatch) are behind
# `defined(__x86_64__)`, so on ARM the graph takes ggml's own products; this proves that the
# fallback compiles cleanly, not how fast it is (no ARM machine here).
#
#   bash scripts/check_arm.sh          # installs gcc-aarch64-linux-gnu with apt if it is missing
set -euo pipefail
cd "$(dirname "$0")/.."
CC=aarch64-linux-gnu-gcc
if ! command -v "$CC" >/dev/null; then
    echo "installing Debian's gcc-aarch64-linux-gnu (apt-get)"
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu >/dev/null
fi
[ -f vendor/llama.cpp/ggml/include/ggml.h ] || .venv/bin/python scripts/fetch_vendor.py
# the real build's flags, read from native/build_ffi.py without importing it (that sets up the cffi build)
FLAGS=$(python3 -c '
import ast
tree = ast.parse(open("native/build_ffi.py").read())
print(" ".join(next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "COMPILE_ARGS")))')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
n=0
for src in native/*.c; do
    # shellcheck disable=SC2086
    "$CC" $FLAGS -Werror -fPIC -Inative -Ivendor/llama.cpp/ggml/include -c "$src" -o "$out/$(basename "$src" .c).o"
    n=$((n + 1))
done
# one shared object: every symbol the library defines resolves, ggml's are left to the loader
"$CC" -shared -o "$out/libretrograd-aarch64.so" "$out"/*.o -Wl,--allow-shlib-undefined
echo "aarch64: $n sources compiled with -Werror and linked ($("$CC" --version | head -1))"
