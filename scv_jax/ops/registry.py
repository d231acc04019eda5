"""Backend selection: one place that decides which implementation of an op runs.

Every op accepts ``backend=`` with one of:
  * ``"auto"``      the Pallas kernel on a CUDA GPU when the kernel supports the inputs, else XLA;
  * ``"pallas"``    the Pallas (Mosaic GPU) kernel; an error where no CUDA GPU is present;
  * ``"xla"``       the pure-JAX reference, compiled by XLA for any platform;
  * ``"interpret"`` the Pallas kernel in Mosaic GPU interpret mode (a CPU simulator; tests only).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

Backend = Literal["auto", "pallas", "xla", "interpret"]
BACKENDS: tuple[str, ...] = ("auto", "pallas", "xla", "interpret")


@functools.cache
def cuda_available() -> bool:
    """True when JAX's default backend is an NVIDIA GPU."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and "cuda" in device.client.platform_version.lower()


def resolve_backend(backend: str, *, op: str, kernel_supported: bool = True,
                    why_unsupported: str = "") -> str:
    """Turns a user's ``backend`` choice into ``"pallas"``, ``"xla"`` or ``"interpret"``.

    Args:
      backend: the user's choice, one of ``BACKENDS``.
      op: the op's name, for error messages.
      kernel_supported: whether the Pallas kernel handles these (static) inputs.
      why_unsupported: the reason when it does not, for error messages.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if (kernel_supported and cuda_available()) else "xla"
    if backend in ("pallas", "interpret") and not kernel_supported:
        raise ValueError(f"{op}: the Pallas kernel does not support these inputs: {why_unsupported}; "
                         "use backend='xla' or 'auto'")
    if backend == "pallas" and not cuda_available():
        raise ValueError(f"{op}: backend='pallas' needs a CUDA GPU (JAX's default backend is "
                         f"{jax.default_backend()!r}); use 'auto', 'xla', or 'interpret' on CPU")
    return backend
