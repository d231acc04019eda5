"""A free pool of KV-cache blocks (host side) with reservations; ``requests.RequestBatch`` holds the
block tables."""

from __future__ import annotations


class CacheFullError(RuntimeError):
    """The paged KV cache has no free block left for a request."""


class BlockPool:
    """Hands out block ids in [0, num_blocks) and takes them back when requests finish.

    A request reserves the blocks it may ever need when it is admitted (``reserve``) and allocates
    them as it grows (``allocate`` draws on its reservation): admitted requests never run out, and
    ``num_available`` (free minus reserved) says whether another one fits.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first
        self.num_reserved = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Free blocks not reserved by a running request."""
        return len(self._free) - self.num_reserved

    def reserve(self, count: int) -> None:
        if count > self.num_available:
            raise CacheFullError(f"KV cache full: need {count} blocks, {self.num_available} of {self.num_blocks} "
                                 "available (raise DecoderConfig.num_blocks)")
        self.num_reserved += count

    def unreserve(self, count: int) -> None:
        self.num_reserved -= count

    def allocate(self, count: int) -> list[int]:
        """``count`` free blocks, drawn on reservations made with ``reserve``."""
        if count > self.num_reserved:
            raise CacheFullError(f"BlockPool.allocate: {count} blocks asked, {self.num_reserved} reserved")
        self.num_reserved -= count
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        if len(set(blocks)) != len(blocks) or any(not 0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"BlockPool.free: invalid or duplicate block ids {blocks}")
        self._free.extend(reversed(blocks))
