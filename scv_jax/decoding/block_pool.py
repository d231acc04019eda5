"""A free pool of KV-cache blocks (host side); ``requests.RequestBatch`` holds the block tables."""

from __future__ import annotations


class CacheFullError(RuntimeError):
    """The paged KV cache has no free block left for a request."""


class BlockPool:
    """Hands out block ids in [0, num_blocks) and takes them back when requests finish or are preempted.

    Blocks are allocated on demand, as a request's tokens (and a step's drafts) need them; the scheduler
    checks ``num_free`` before a step and preempts a request when the running ones would not fit.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` free blocks; CacheFullError when fewer are free."""
        if count > len(self._free):
            raise CacheFullError(f"KV cache full: need {count} blocks, {len(self._free)} of {self.num_blocks} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        if len(set(blocks)) != len(blocks) or any(not 0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"BlockPool.free: invalid or duplicate block ids {blocks}")
        self._free.extend(reversed(blocks))
