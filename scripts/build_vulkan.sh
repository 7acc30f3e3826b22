#!/usr/bin/env bash
# A second backend for real: the Vulkan build of llama-cpp-python (and retrograd's native library
# linked to its ggml) in .venv-vulkan, runnable here on Mesa's lavapipe (a Vulkan device on the CPU).
#   1. Debian's mesa-vulkan-drivers, libvulkan-dev, glslc, spirv-headers and vulkan-tools (apt-get, when root)
#   1b. the pinned llama.cpp needs newer Vulkan-Hpp headers than Debian 12's libvulkan-dev (1.3.239 lacks
#      vk::LayerSettingEXT): when the installed vulkan.hpp lacks it, Debian 13's libvulkan-dev is
#      downloaded from Debian's archive and unpacked into .vulkan-headers/ (headers only: nothing is
#      installed, the system's loader library stays), and CMake is pointed at it
#   1c. Mesa's lavapipe before 25 faults now and then while it trains (issue 38, docs/building.md):
#      where the system's is older (Debian 12 has 22.3), Mesa 25's lavapipe from Debian's
#      bookworm-backports is unpacked into .vulkan-mesa/ (nothing is installed) with an ICD file
#      naming it; tests/test_vulkan.py runs on it (`.vulkan-mesa/env` holds the two variables that
#      select it, for a shell: `env $(cat .vulkan-mesa/env) .venv-vulkan/bin/retrograd ...`)
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
# debs of another Debian suite, downloaded (not installed) into $2: fetch_debs SUITE DIR PACKAGE...
fetch_debs() {
  local suite=$1 dest=$2 apt_dir
  shift 2
  apt_dir=$(mktemp -d)
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$dest"
  echo "deb http://deb.debian.org/debian $suite main" > "$apt_dir/sources.list"
  local apt_opts=(-o Dir::Etc::sourcelist="$apt_dir/sources.list" -o Dir::Etc::sourceparts=/dev/null
                  -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache" -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -q >/dev/null && (cd "$dest" && apt-get "${apt_opts[@]}" download "$@" >/dev/null)
  local rc=$?
  rm -rf "$apt_dir"
  return $rc
}
vk_args=""
if ! grep -rqs "LayerSettingEXT" /usr/include/vulkan/; then
  if [ ! -e .vulkan-headers/usr/include/vulkan/vulkan.hpp ]; then
    echo "the system's Vulkan headers are too old for the pinned llama.cpp; fetching Debian 13's libvulkan-dev headers"
    debs=$(mktemp -d)
    fetch_debs trixie "$debs" libvulkan-dev
    dpkg -x "$debs"/libvulkan-dev_*.deb .vulkan-headers
    rm -rf "$debs"
  fi
  vk_args="-DVulkan_INCLUDE_DIR=$root/.vulkan-headers/usr/include"
fi
mesa=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)
if [ -n "$mesa" ] && dpkg --compare-versions "$mesa" lt 25 && [ ! -e .vulkan-mesa/env ]; then
  echo "the system's lavapipe is Mesa $mesa (faults now and then in training); fetching Mesa 25's from bookworm-backports"
  debs=$(mktemp -d)
  if fetch_debs bookworm-backports "$debs" mesa-vulkan-drivers libdrm2 libdrm-amdgpu1; then
    rm -rf .vulkan-mesa
    for deb in "$debs"/*.deb; do dpkg -x "$deb" .vulkan-mesa; done
    lib=$(dirname "$(find "$root/.vulkan-mesa" -name libvulkan_lvp.so | head -1)")
    sed "s#\"library_path\": *\"[^\"]*\"#\"library_path\": \"$lib/libvulkan_lvp.so\"#" \
      .vulkan-mesa/usr/share/vulkan/icd.d/lvp_icd.json > .vulkan-mesa/lvp_icd.json
    echo "VK_ICD_FILENAMES=$root/.vulkan-mesa/lvp_icd.json LD_LIBRARY_PATH=$lib" > .vulkan-mesa/env
  else
    echo "warning: Mesa 25's lavapipe could not be fetched; the tests run on the system's Mesa $mesa" >&2
  fi
  rm -rf "$debs"
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
# shellcheck disable=SC2046
env $(cat "$root/.vulkan-mesa/env" 2>/dev/null) GGML_VK_VISIBLE_DEVICES=0 "$root/.venv-vulkan/bin/python" -c "
from retrograd import native
print('devices:', ', '.join(f'{d.name} ({d.kind})' for d in native.devices()))
print('gpu:', native.select_device('gpu').name)"
