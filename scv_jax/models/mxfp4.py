"""MXFP4 weights as gpt-oss publishes its experts (OCP microscaling FP4: blocks of 32 E2M1 values
sharing one power-of-two scale), dequantized on load.

A tensor ``W`` [..., rows, cols] is stored as ``<name>_blocks`` uint8[..., rows, cols / 32, 16] (two
4-bit E2M1 codes per byte, the low nibble first) and ``<name>_scales`` uint8[..., rows, cols / 32]
(the shared exponent, biased by 127): ``W[..., r, 32 g + i] = E2M1[code i of block (r, g)] * 2 **
(scale[r, g] - 127)``. Every such value (two significant bits times a power of two in [2^-127, 2^128])
is exact in float32 and in bfloat16 (6 * 2^128 overflows to inf in both, as in transformers).
"""

from __future__ import annotations

import numpy as np

# the 16 E2M1 codes: sign bit 3, then exponent and mantissa bits
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32                     # values per shared scale


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32[..., rows, groups * 32] from ``blocks`` uint8[..., rows, groups, 16] and ``scales``
    uint8[..., rows, groups]. ValueError naming the argument for a wrong dtype or shape."""
    for name, array in (("blocks", blocks), ("scales", scales)):
        if array.dtype != np.uint8:
            raise ValueError(f"dequantize_mxfp4: {name} must be uint8, got {array.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"dequantize_mxfp4: blocks must be [..., groups, {BLOCK // 2}] over scales [..., groups], "
                         f"got {blocks.shape} and {scales.shape}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)              # [..., groups, 16, 2]: low nibble first
    values = E2M1_VALUES[codes].reshape(*scales.shape, BLOCK)            # [..., groups, 32]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)
