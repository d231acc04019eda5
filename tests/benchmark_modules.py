"""A script of ``benchmarks/`` imported as a module (its own imports, e.g. ``harness``, resolve there)."""

import importlib
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` as a module."""
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
