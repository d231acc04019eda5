"""A pool of KV-cache blocks (host side) with a prefix cache: blocks full of verified tokens stay cached
under the hash of their prefix after their requests end, until the pool needs them back.
``requests.RequestBatch`` holds the block tables."""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class CacheFullError(RuntimeError):
    """The paged KV cache has no free block left for a request."""


def prefix_root(description: str) -> bytes:
    """The hash every block hash chains from: ``description`` names what a block's contents depend on
    besides its tokens (the models, the cache dtype, the block size)."""
    return hashlib.sha256(description.encode()).digest()


def chain_hashes(parent: bytes, tokens: np.ndarray, block_size: int, lookahead: int = 0) -> list[bytes]:
    """The hash of each full block of ``tokens`` (int[n]; (n - lookahead) // block_size blocks), each
    chained over the ones before it from ``parent`` (SHA-256: a collision would serve one prompt another's
    cache). ``lookahead``: tokens after a block its contents depend on, hashed with it (an EAGLE head's
    row at a block's last position pairs it with the next block's first token: 1)."""
    hashes, data = [], np.asarray(tokens, "<i4")
    for j in range(max(len(data) - lookahead, 0) // block_size):
        parent = hashlib.sha256(parent + data[j * block_size:(j + 1) * block_size + lookahead].tobytes()).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """Hands out block ids in [0, num_blocks), counts the requests holding each, and keeps the blocks no
    request holds any more that are full of verified tokens (``register``) cached under their hash,
    least recently used first, until ``allocate`` needs them (``num_free`` counts them as free).

    Blocks are allocated on demand, as a request's tokens (and a step's drafts) need them; the scheduler
    checks ``num_free`` before a step and preempts a request when the running ones would not fit.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._empty = list(range(num_blocks - 1, -1, -1))   # no reusable contents; pop() hands out low ids first
        self._holders = np.zeros(num_blocks, np.int64)      # requests holding each block
        self._hash_of: dict[int, bytes] = {}                 # cached block -> its hash
        self._block_of: dict[bytes, int] = {}                # hash -> cached block
        self._unheld: collections.OrderedDict[int, None] = collections.OrderedDict()   # cached, held by none: LRU

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: empty ones and cached ones no request holds."""
        return len(self._empty) + len(self._unheld)

    @property
    def num_cached(self) -> int:
        """Blocks cached under a hash (held by requests or not)."""
        return len(self._block_of)

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks for a request: empty ones first, then the least recently used cached ones no
        request holds (evicted from the cache); CacheFullError when fewer are free."""
        if count > self.num_free:
            raise CacheFullError(f"KV cache full: need {count} blocks, {self.num_free} of {self.num_blocks} free")
        blocks = []
        for _ in range(count):
            if self._empty:
                block = self._empty.pop()
            else:
                block, _ = self._unheld.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._holders[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """A request lets go of ``blocks`` (in table order): a block no request holds is empty again, or,
        when cached, the most recently used of the unheld (the table's tail evicted first)."""
        if len(set(blocks)) != len(blocks) or any(not 0 <= b < self.num_blocks or self._holders[b] < 1 for b in blocks):
            raise ValueError(f"BlockPool.free: invalid, unheld or duplicate block ids {blocks}")
        for block in reversed(blocks):
            self._holders[block] -= 1
            if self._holders[block]:
                continue
            if block in self._hash_of:
                self._unheld[block] = None
            else:
                self._empty.append(block)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (a request's chained block hashes)."""
        blocks = []
        for digest in hashes:
            block = self._block_of.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of ``blocks`` (cached) no request holds: taking them lowers ``num_free`` as much."""
        return sum(1 for block in blocks if not self._holders[block])

    def hold(self, blocks: list[int]) -> None:
        """A request takes cached ``blocks`` (from ``cached_prefix``) as the start of its block table."""
        for block in blocks:
            if not self._holders[block]:
                del self._unheld[block]
            self._holders[block] += 1

    @property
    def num_cached_held(self) -> int:
        """Cached blocks some request holds."""
        return len(self._block_of) - len(self._unheld)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (they are empty again); False, changing nothing, while a request
        holds a cached block."""
        if self.num_cached_held:
            return False
        self._empty.extend(reversed(sorted(self._unheld)))
        self._unheld.clear()
        self._block_of.clear()
        self._hash_of.clear()
        return True

    def register(self, block: int, digest: bytes) -> None:
        """Caches ``block`` (held, full of verified tokens) under ``digest`` (its chained hash), unless
        another block already holds that prefix."""
        if digest not in self._block_of and block not in self._hash_of:
            self._block_of[digest], self._hash_of[block] = block, digest
