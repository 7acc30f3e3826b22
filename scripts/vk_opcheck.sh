#!/usr/bin/env bash
# Builds scripts/vk_opcheck.c against the Vulkan build's ggml (.venv-vulkan, from build_vulkan.sh)
# and runs it on the first Vulkan device (lavapipe here): each training-graph op on the device
# against the CPU, a crash named by its op. TOKENS="16 64 100" runs several micro-batch sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
lib=$(echo .venv-vulkan/lib/python*/site-packages/llama_cpp/lib)
[ -e "$lib/libggml-vulkan.so" ] || { echo "error: no Vulkan build: run bash scripts/build_vulkan.sh" >&2; exit 1; }
[ -d vendor/llama.cpp ] || python3 scripts/fetch_vendor.py
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
gcc -O1 -std=c11 -D_DEFAULT_SOURCE scripts/vk_opcheck.c -Ivendor/llama.cpp/ggml/include -L"$lib" \
    -Wl,-rpath,"$(cd "$lib" && pwd)" -lggml -lggml-base -lm -o "$out/vk_opcheck"
for t in ${TOKENS:-64}; do GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0} "$out/vk_opcheck" "$t" || true; done
