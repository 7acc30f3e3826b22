"""Pinned versions of what retrograd builds against (read by setup scripts, no imports)."""

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
