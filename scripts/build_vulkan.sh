#!/usr/bin/env bash
# A second backend for real: the Vulkan build of llama-cpp-python (and retrograd's native library
# linked to its ggml) in .venv-vulkan, runnable here on Mesa's lavapipe (a Vulkan device on the CPU).
#   1. Debian's mesa-vulkan-drivers, libvulkan-dev, glslc, spirv-headers and vulkan-tools (apt-get, when root)
#   1b. the pinned llama.cpp needs newer Vulkan-Hpp headers than Debian 12's libvulkan-dev (1.3.239 lacks
#      vk::LayerSettingEXT): when the installed vulkan.hpp lacks it, Debian 13's libvulkan-dev is
#      downloaded from Debian's archive and unpacked into .vulkan-headers/ (headers only: nothing is
#      installed, the system's loader library stays), and CMake is pointed at it
#   2. .venv-vulkan with llama-cpp-python built from source with CMAKE_ARGS="-DGGML_VULKAN=on"
#      (pip's cached CPU wheel must not be reused: --no-binary); about 20-30 minutes on 2 cores
#   3. retrograd's wheel from the committed files, installed there (its native library finds the
#      Vulkan ggml beside it)
# ggml-vulkan skips CPU-type devices such as lavapipe unless GGML_VK_VISIBLE_DEVICES names them:
#     GGML_VK_VISIBLE_DEVICES=0 .venv-vulkan/bin/retrograd inspect --model M --device gpu
# tests/test_vulkan.py uses it (RETRO_CI_VULKAN=1 bash .ci/run builds it and runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
if ! command -v glslc >/dev/null 2>&1 || [ ! -e /usr/include/vulkan/vulkan.h ] ||
   ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || [ ! -d /usr/share/cmake/SPIRV-Headers ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends mesa-vulkan-drivers libvulkan-dev glslc spirv-headers vulkan-tools >/dev/null ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends mesa-vulkan-drivers \
          libvulkan-dev glslc spirv-headers vulkan-tools >/dev/null; }
  else
    echo "error: install mesa-vulkan-drivers libvulkan-dev glslc spirv-headers vulkan-tools first" >&2
    exit 1
  fi
fi
vk_args=""
if ! grep -rqs "LayerSettingEXT" /usr/include/vulkan/; then
  if [ ! -e .vulkan-headers/usr/include/vulkan/vulkan.hpp ]; then
    echo "the system's Vulkan headers are too old for the pinned llama.cpp; fetching Debian 13's libvulkan-dev headers"
    apt_dir=$(mktemp -d)
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
    echo "deb http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
    apt_opts=(-o Dir::Etc::sourcelist="$apt_dir/sources.list" -o Dir::Etc::sourceparts=/dev/null
              -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache" -o APT::Sandbox::User=root)
    apt-get "${apt_opts[@]}" update -q >/dev/null
    (cd "$apt_dir" && apt-get "${apt_opts[@]}" download libvulkan-dev >/dev/null)
    dpkg -x "$apt_dir"/libvulkan-dev_*.deb .vulkan-headers
    rm -rf "$apt_dir"
  fi
  vk_args="-DVulkan_INCLUDE_DIR=$root/.vulkan-headers/usr/include"
fi
PY=${PYTHON:-python3}
[ -x .venv-vulkan/bin/python ] || "$PY" -m venv .venv-vulkan
pip=(.venv-vulkan/bin/python -m pip -q --disable-pip-version-check)
"${pip[@]}" install --upgrade pip "setuptools>=77" wheel "cffi>=1.16" 2>&1 | sed '/is ignored/d'
version=$(.venv-vulkan/bin/python -c 'exec(open("retrograd/_pins.py").read()); print(LLAMA_CPP_PYTHON_VERSION)')
if ! ls .venv-vulkan/lib/python*/site-packages/llama_cpp/lib/libggml-vulkan.* >/dev/null 2>&1; then
  echo "building llama-cpp-python $version with Vulkan (20-30 minutes on 2 cores)..."
  CMAKE_ARGS="-DGGML_VULKAN=on $vk_args" "${pip[@]}" install --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$version" 2>&1 | sed '/is ignored/d'
fi
ls .venv-vulkan/lib/python*/site-packages/llama_cpp/lib/libggml-vulkan.* >/dev/null ||
  { echo "error: llama-cpp-python has no Vulkan backend after the build" >&2; exit 1; }
[ -d vendor/llama.cpp ] || .venv-vulkan/bin/python scripts/fetch_vendor.py
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$work"
ln -s "$root/vendor" "$work/vendor"
(cd "$work" && "$root/.venv-vulkan/bin/python" -m pip -q wheel --no-build-isolation --no-deps -w "$work/dist" . 2>&1 |
  sed '/is ignored/d')
"${pip[@]}" install --force-reinstall --no-deps "$work"/dist/retrograd-*.whl 2>&1 | sed '/is ignored/d'
"${pip[@]}" install "$work"/dist/retrograd-*.whl 2>&1 | sed '/is ignored/d'       # its dependencies
cd /
GGML_VK_VISIBLE_DEVICES=0 "$root/.venv-vulkan/bin/python" -c "
from retrograd import native
print('devices:', ', '.join(f'{d.name} ({d.kind})' for d in native.devices()))
print('gpu:', native.select_device('gpu').name)"
