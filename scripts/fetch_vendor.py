"""Populate vendor/llama.cpp from the pinned llama-cpp-python source distribution.

The C library in native/ must compile against the headers of exactly the llama.cpp commit that
the installed llama-cpp-python was built from, so we take them from that version's sdist on the
package index (never from a git checkout, never edited). Idempotent: a stamp file records the
version that is already there.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = ROOT / "retrograd" / "_pins.py"
# Only what the native build needs (headers) plus the ggml/llama sources for reading.
KEEP = ("include/", "ggml/include/", "ggml/src/", "src/", "LICENSE")


def pinned_version() -> str:
    ns: dict = {}
    exec(PIN_FILE.read_text(), ns)
    return ns["LLAMA_CPP_PYTHON_VERSION"]


def fetch(version: str, dest: Path, sdist: Path | None) -> None:
    stamp = dest / ".retrograd-version"
    if stamp.exists() and stamp.read_text().strip() == version:
        print(f"vendor/llama.cpp already at llama-cpp-python {version}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                   "llama-cpp-python", f"llama-cpp-python=={version}", "-d", tmp, "-q"]
            print("fetching llama-cpp-python", version, "sdist from the package index")
            subprocess.run(cmd, check=True)
            found = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if not found:
                sys.exit("error: pip download did not produce a llama_cpp_python sdist")
            sdist = found[0]
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        n = 0
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if not member.name.startswith(prefix) or not member.isfile():
                    continue
                rel = member.name[len(prefix):]
                if not rel.startswith(KEEP):
                    continue
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                n += 1
        if n == 0:
            sys.exit(f"error: {sdist} holds no {prefix} tree")
        stamp.write_text(version + "\n")
        print(f"vendor/llama.cpp: {n} files from llama-cpp-python {version}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, help="use this already downloaded sdist")
    args = ap.parse_args()
    fetch(pinned_version(), ROOT / "vendor" / "llama.cpp", args.sdist)


if __name__ == "__main__":
    main()
