#!/usr/bin/env bash
# Set up retrograd on a fresh machine, idempotently:
#   1. a virtual environment in .venv
#   2. llama-cpp-python at the pinned version (built from source: ~10 minutes on 2 cores the first
#      time; pip caches the wheel; GPU builds: CMAKE_ARGS="-DGGML_VULKAN=on" bash scripts/setup.sh)
#   3. vendor/llama.cpp headers from that version's source distribution
#   4. retrograd itself (editable), which compiles native/ against those headers
#   5. the embedded default model (and, with --test, Gemma 3 270M for the tests)
#   6. with --test: Debian's chromium for the web page's browser test (apt-get, when root)
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    *) echo "usage: scripts/setup.sh [--test]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)
"${pip[@]}" install --upgrade pip "setuptools>=77" wheel "cffi>=1.16" 2>&1 | sed '/is ignored/d'
version=$(.venv/bin/python -c 'exec(open("retrograd/_pins.py").read()); print(LLAMA_CPP_PYTHON_VERSION)')
if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('llama-cpp-python') == '$version'" 2>/dev/null; then
  echo "building llama-cpp-python $version (about 10 minutes on 2 cores the first time)..."
  "${pip[@]}" install "llama-cpp-python==$version" 2>&1 | sed '/is ignored/d'
fi
.venv/bin/python -c "import llama_cpp" || { echo "llama-cpp-python did not install" >&2; exit 1; }
.venv/bin/python scripts/fetch_vendor.py
extras=""
[ "$want_test" = 1 ] && extras="[test]"
"${pip[@]}" install --no-build-isolation -e ".$extras" 2>&1 | sed '/is ignored/d'
.venv/bin/python -c "import retrograd.native" || { echo "the native library did not build" >&2; exit 1; }
# an editable install leaves the data files out: put the manual pages where man finds them for a
# PATH holding .venv/bin (man-db looks in BIN/../share/man), or MANPATH=.venv/share/man
mkdir -p .venv/share/man/man1 && cp man/man1/*.1 .venv/share/man/man1/
if [ "$want_test" = 1 ]; then
  .venv/bin/retrograd models fetch --gemma 2>&1 | sed '/is ignored/d'
else
  .venv/bin/retrograd models fetch 2>&1 | sed '/is ignored/d'
fi
if [ "$want_test" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing Debian's chromium for the browser tests..."
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null; }; } ||
      echo "warning: chromium did not install; the browser tests will fail (RETRO_NO_BROWSER=1 skips them)" >&2
  else
    echo "note: the browser tests need Chromium on PATH (apt-get install chromium), or RETRO_NO_BROWSER=1" >&2
  fi
fi
echo "retrograd is set up: .venv/bin/retrograd --help"
