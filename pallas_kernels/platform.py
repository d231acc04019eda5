"""Device facts and helpers shared by the Mosaic GPU kernels.

Kernel shapes that depend on the hardware (how many CTAs keep the GPU busy) are derived here from
the device JAX runs on. When no GPU is present (interpret mode, or lowering for CUDA on a CPU host)
the defaults describe an H100 / H200, the GPUs the kernels are tuned for. No kernel's *result*
depends on these numbers: they only choose how work is split (tested with several split counts).
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

WARPGROUP_SIZE = 128          # threads of one Mosaic GPU CTA (one warpgroup)
DEFAULT_NUM_SMS = 132         # H100 SXM and H200; used when tracing without a GPU
# Resident 128-thread CTAs per SM that the split heuristics aim for: Hopper holds at most 2048
# threads (16 warpgroups) per SM; register use lowers the real figure, so this oversubscribes.
CTAS_PER_SM = 16


def store_unoptimized(ref, value: jax.Array) -> None:
    """Stores ``value`` (any register layout) to the GMEM ``ref`` with Mosaic's unoptimized
    (element-wise) GMEM store, which takes shapes the optimized store rejects (e.g. a tiled layout
    over ``[5, 96]``). jax >= 0.12 spells it ``plgpu.store(..., optimized=False)``; jax 0.11 has no
    ``plgpu.store`` and lowers ``ref[...] = value`` of a tiled value to that same store."""
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def interpret_params(interpret: bool):
    """The ``interpret=`` argument of ``plgpu.kernel``: the GPU simulator on CPU, or native."""
    return plgpu.InterpretGPUParams() if interpret else None


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of JAX's first device when it is a GPU (``core_count``), else
    ``DEFAULT_NUM_SMS``."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return DEFAULT_NUM_SMS
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else DEFAULT_NUM_SMS


def target_ctas() -> int:
    """CTAs a grid should offer to fill the GPU: ``CTAS_PER_SM * num_sms()``."""
    return CTAS_PER_SM * num_sms()
