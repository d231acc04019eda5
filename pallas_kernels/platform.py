"""Helpers shared by the Mosaic GPU kernels."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(interpret: bool):
    """The ``interpret=`` argument of ``plgpu.kernel``: the GPU simulator on CPU, or native."""
    return plgpu.InterpretGPUParams() if interpret else None
