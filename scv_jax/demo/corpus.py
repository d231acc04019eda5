"""Training text every machine has: the Python standard library's source files, as bytes."""

from __future__ import annotations

import pathlib
import sysconfig

import numpy as np


def stdlib_bytes(max_bytes: int = 8_000_000, seed: int = 0) -> np.ndarray:
    """uint8[N]: a random selection of stdlib ``.py`` files (no tests), concatenated."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "test" not in p.parts and "site-packages" not in p.parts and "idlelib" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no .py files under {root}")
    order = np.random.default_rng(seed).permutation(len(files))
    chunks, total = [], 0
    for i in order:
        try:
            data = files[i].read_bytes()
        except OSError:
            continue
        chunks.append(data + b"\n\n")
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), np.uint8)


def split_corpus(data: np.ndarray, holdout_fraction: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(data) * (1 - holdout_fraction))
    return data[:cut], data[cut:]


def random_windows(data: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """int32[batch, length] windows starting at random offsets."""
    starts = rng.integers(0, len(data) - length, size=batch)
    return np.stack([data[s:s + length] for s in starts]).astype(np.int32)
