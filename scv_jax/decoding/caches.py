"""``ModelCaches``: the target's and the draft's paged KV caches, owned by the decoder and handed to
the donating step calls (which update them in place and hand them back)."""

from __future__ import annotations

import jax.numpy as jnp

from scv_jax.ops.commit.kv_cache import PagedKVCache


class ModelCaches:
    """Holds both caches between steps; a call that failed after donating them leaves none, and the
    next ``take`` then starts from empty caches (the requests in flight were lost with them)."""

    def __init__(self, num_blocks: int, block_size: int, cache_dtype: str,
                 target_dims: tuple[int, int, int], draft_dims: tuple[int, int, int] | None):
        self._geometry = (num_blocks, block_size, cache_dtype)
        self._dims = (target_dims, draft_dims)
        self._caches: tuple[PagedKVCache, PagedKVCache | None] | None = None

    def _new(self, dims: tuple[int, int, int]) -> PagedKVCache:
        num_layers, kv_heads, head_dim = dims
        num_blocks, block_size, dtype = self._geometry
        cache = PagedKVCache.create(num_layers, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        # distinct K and V buffers: a donating call may not receive one buffer twice
        return cache.replace(v_pages=jnp.zeros_like(cache.v_pages))

    def take(self) -> tuple[PagedKVCache, PagedKVCache | None]:
        """(target, draft) caches for one donating call; give the results back with ``put``."""
        caches, self._caches = self._caches, None
        if caches is None:
            target_dims, draft_dims = self._dims
            caches = (self._new(target_dims), None if draft_dims is None else self._new(draft_dims))
        return caches

    def put(self, target: PagedKVCache, draft: PagedKVCache | None) -> None:
        self._caches = (target, draft)
