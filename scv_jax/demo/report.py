"""Markdown result sections with the machine, versions and command: used by ``scv-jax bench`` and the
scripts in ``benchmarks/`` (through ``benchmarks/harness.py``)."""

from __future__ import annotations

import datetime
import os
import platform

import jax

from scv_jax.ops.registry import cuda_available


def machine() -> str:
    """The accelerator (or CPU) and host core count, e.g. "NVIDIA H200, 16-core host"."""
    if cuda_available():
        return f"{jax.devices()[0].device_kind}, {os.cpu_count()}-core host"
    return f"{os.cpu_count()}-core CPU, no GPU"


def results_header(title: str, command: str, details: str = "") -> str:
    """A section header with date, machine, versions and the command."""
    return (f"\n## {title} ({datetime.date.today()})\n\n"
            f"Machine: {machine()}; jax {jax.__version__}; Python {platform.python_version()}. "
            f"{details}Command: `{command}`\n\n")


def append_markdown(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text.rstrip("\n") + "\n")
