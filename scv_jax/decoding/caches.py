"""``ModelCaches``: the target's and the draft's paged KV caches, owned by the decoder and handed to
the donating step calls (which update them in place and hand them back); an EAGLE head's draft cache is
a ``HeadCache``."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from scv_jax.ops.commit.kv_cache import PagedKVCache


def single_device_cache(role: str, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                        head_dim: int, dtype: str) -> PagedKVCache:
    """A zero cache on the default device (``role`` is not used)."""
    cache = PagedKVCache.create(num_layers, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    # distinct K and V buffers: a donating call may not receive one buffer twice
    return cache.replace(v_pages=jnp.zeros_like(cache.v_pages))


class HeadCache(NamedTuple):
    """An EAGLE head's draft cache: its paged K/V and, paged the same way (slot = block * block_size +
    offset, through the shared block tables), what its next rows read from the target's verified tokens.

    Attributes:
      kv: the head's ``PagedKVCache`` (one layer).
      features: [num_blocks, block_size, d_model] the target's combined taps (``head.combine``) of each
        verified position, in the head's dtype.
      tokens: int32[num_blocks, block_size] the accepted drafts at their positions (the rows of a
        catch-up read them; the pending token comes with the step).
    """

    kv: PagedKVCache
    features: jax.Array
    tokens: jax.Array

    @classmethod
    def wrap(cls, kv: PagedKVCache, num_blocks: int, block_size: int, feature_dim: int, dtype) -> "HeadCache":
        """``kv`` (of ``num_blocks`` blocks of ``block_size``) with zero features and tokens."""
        return cls(kv, jnp.zeros((num_blocks, block_size, feature_dim), dtype),
                   jnp.zeros((num_blocks, block_size), jnp.int32))


# (role "target" or "draft", num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, features) -> a zero
# cache (features: an EAGLE head's (d_model, dtype), its cache then a ``HeadCache``; else None)
CacheFactory = Callable[[str, int, int, int, int, int, str, tuple[int, object] | None], PagedKVCache | HeadCache]


class ModelCaches:
    """Holds both caches between steps; a call that failed after donating them leaves none, and the
    next ``take`` then starts from empty caches (the requests in flight were lost with them).

    ``factory`` creates each cache (on one device, or sharded over a mesh: ``placement``);
    ``draft_features``: an EAGLE head's (d_model, dtype), its cache then a ``HeadCache``.
    """

    def __init__(self, num_blocks: int, block_size: int, cache_dtype: str,
                 target_dims: tuple[int, int, int], draft_dims: tuple[int, int, int] | None, *,
                 factory: CacheFactory, draft_features: tuple[int, object] | None = None):
        self._geometry = (num_blocks, block_size, cache_dtype)
        self._dims = (target_dims, draft_dims)
        self._factory = factory
        self._draft_features = draft_features      # an EAGLE head's (d_model, dtype): its cache a HeadCache
        self._caches: tuple[PagedKVCache, PagedKVCache | None] | None = None

    def _new(self, role: str, dims: tuple[int, int, int], features: tuple[int, object] | None = None
             ) -> PagedKVCache | HeadCache:
        num_layers, kv_heads, head_dim = dims
        num_blocks, block_size, dtype = self._geometry
        return self._factory(role, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, features)

    def take(self) -> tuple[PagedKVCache, PagedKVCache | HeadCache | None]:
        """(target, draft) caches for one donating call; give the results back with ``put``."""
        caches, self._caches = self._caches, None
        if caches is None:
            target_dims, draft_dims = self._dims
            caches = (self._new("target", target_dims),
                      None if draft_dims is None else self._new("draft", draft_dims, self._draft_features))
        return caches

    def put(self, target: PagedKVCache, draft: PagedKVCache | HeadCache | None) -> None:
        self._caches = (target, draft)
