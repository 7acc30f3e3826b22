#!/usr/bin/env bash
# The installed product on its own: build retrograd's wheel, install it into a fresh virtual
# environment outside the source tree (with the pinned llama-cpp-python, from pip's cache when set-up
# already built it), fetch the default model and train two steps on a small data set there; then
# check that the console scripts and the manual pages came with it. Run after scripts/setup.sh:
#     bash scripts/check_wheel.sh        (CI: RETRO_CI_WHEEL=1 bash .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip=(-m pip -q --disable-pip-version-check)
echo "building the wheel from the committed files..."
mkdir "$work/src"
git ls-files -z | xargs -0 cp --parents -t "$work/src"     # no build outputs of this tree
ln -s "$root/vendor" "$work/src/vendor"
(cd "$work/src" && "$root/.venv/bin/python" "${pip[@]}" wheel --no-build-isolation --no-deps -w "$work/dist" . 2>&1 |
  sed '/is ignored/d')
wheel=$(ls "$work"/dist/retrograd-*.whl)
python3 -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel" > "$work/listing"
for f in retrograd/_native share/man/man1/retrograd-train.1 retrograd/serve/web/index.html; do
  grep -q "$f" "$work/listing" || { echo "the wheel lacks $f" >&2; exit 1; }
done
echo "installing it into a fresh environment..."
python3 -m venv "$work/venv"
version=$(.venv/bin/python -c 'exec(open("retrograd/_pins.py").read()); print(LLAMA_CPP_PYTHON_VERSION)')
"$work/venv/bin/python" "${pip[@]}" install "llama-cpp-python==$version" "$wheel" 2>&1 | sed '/is ignored/d'
cd "$work"                      # nothing from the source tree from here on
export PATH="$work/venv/bin:$PATH"
python - "$root" "$work" <<'PY'
import sys
import retrograd.native  # noqa: F401 - loads the native library and the ggml it links
root, work = sys.argv[1], sys.argv[2]
assert not retrograd.native.__file__.startswith(root), retrograd.native.__file__
ggml = {line.split()[-1] for line in open("/proc/self/maps") if "libggml-base" in line}
assert ggml and all(p.startswith(work) for p in ggml), f"ggml comes from outside the new environment: {ggml}"
print(f"retrograd from {retrograd.native.__file__}, ggml from {ggml.pop()}")
PY
retrograd models fetch
python - <<'PY'
import json
rows = [{"messages": [{"role": "user", "content": f"Code {i}?"}, {"role": "assistant", "content": "ZEBRA-7"}]}
        for i in range(8)]
open("train.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))
open("run.toml", "w").write('[model]\nctx = 128\n[lora]\nrank = 4\nalpha = 8\n[data]\ntrain = "train.jsonl"\n'
                            '[training]\nmax_steps = 2\nbatch_size = 2\n[checkpoint]\nevery_steps = 1\n')
PY
RETRO_THREADS=${RETRO_THREADS:-2} retrograd train run.toml
test -s runs/run/adapter.gguf || { echo "no adapter after training" >&2; exit 1; }
retrograd-server --help >/dev/null
retrograd-profile --help >/dev/null
test -f "$work/venv/share/man/man1/retrograd-train.1" || { echo "the manual pages were not installed" >&2; exit 1; }
if command -v man >/dev/null; then
  MANPAGER=cat man -M "$work/venv/share/man" retrograd-train > "$work/man.txt" 2>/dev/null
  grep -q -- "--resume" "$work/man.txt" || { echo "man retrograd-train does not work from the installed package" >&2; exit 1; }
fi
echo "the wheel works on its own: trained runs/run/adapter.gguf in a fresh environment"
