"""A free pool of KV-cache blocks and per-request block tables (host side)."""

from __future__ import annotations

import numpy as np


class CacheFullError(RuntimeError):
    """The paged KV cache has no free block left for a request."""


class BlockPool:
    """Hands out block ids in [0, num_blocks) and takes them back when requests finish."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CacheFullError(f"KV cache full: need {count} more blocks, {len(self._free)} of "
                                 f"{self.num_blocks} free (raise DecoderConfig.num_blocks)")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        if len(set(blocks)) != len(blocks) or any(not 0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"BlockPool.free: invalid or duplicate block ids {blocks}")
        self._free.extend(reversed(blocks))


class BlockTable:
    """The blocks of one request; grows on demand from a ``BlockPool``."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size, self.blocks = pool, block_size, []

    def ensure(self, num_positions: int) -> None:
        """Makes positions [0, num_positions) addressable."""
        needed = -(-num_positions // self.block_size) - len(self.blocks)
        if needed > 0:
            self.blocks.extend(self.pool.allocate(needed))

    def release(self) -> None:
        self.pool.free(self.blocks)
        self.blocks = []


def stack_block_tables(tables: list[BlockTable], width: int) -> np.ndarray:
    """int32[B, width] block ids, -1 past each request's last block."""
    out = np.full((len(tables), width), -1, np.int32)
    for row, table in zip(out, tables):
        row[:len(table.blocks)] = table.blocks
    return out
