"""The one error type every part of retrograd raises for a problem the user can fix.

A RetrogradError is one line that names the file, line, key or field at fault; `exit_code` is what
the command line exits with: 2 for configuration and usage mistakes (the command was asked for
something it cannot mean), 1 for everything else (the data, a model, a checkpoint, a device, a
run that cannot go on). The CLI catches exactly this type, so an exception that is not one is a
bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class RetrogradError(Exception):
    """A failure to report as one `error:` line with a non-zero exit."""

    exit_code = 1


class ConfigError(RetrogradError, ValueError):
    """A configuration file or key is wrong: file, key, what was expected."""

    exit_code = 2


class GenerationError(RetrogradError):
    """llama.cpp could not load a model, make a context or take an adapter."""


class UsageError(RetrogradError, ValueError):
    """A command-line flag is wrong or missing."""

    exit_code = 2


def reported(fn: Callable[[], int], prefix: str = "error") -> int:
    """Run a command body: a RetrogradError becomes one `prefix: message` line on stderr and its
    exit code, Ctrl-C exits 130; anything else is a bug and keeps its traceback."""
    try:
        return fn()
    except RetrogradError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
