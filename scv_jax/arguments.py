"""Checks of plain Python arguments (counts and sizes), free of jax: the host-side modules (the adaptive
controller, the n-gram drafter, the decoding loop, model config readers) share them with the ops."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np


def is_int(value: Any, minimum: int) -> bool:
    """Whether ``value`` is an int >= ``minimum`` (numpy ints count, bools and floats do not)."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and bool(value >= minimum)


def require_int(where: str, name: str, value: Any, *, minimum: int, static: bool = False) -> int:
    """``value`` as a Python int >= ``minimum``, or a one-line ValueError naming ``where`` and ``name``.
    ``static``: a jit-static argument of an op (the message says it must be a Python int)."""
    if not is_int(value, minimum):
        kind = "a Python int" if static else "an int"
        raise ValueError(f"{where}: {name} must be {kind} >= {minimum}{' (static)' if static else ''}, got {value!r}")
    return int(value)


class OneLineParser(argparse.ArgumentParser):
    """Reports a user's mistake in one line (no usage dump, no traceback) and exits with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
