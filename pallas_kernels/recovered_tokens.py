"""Mosaic GPU kernel: per draft slot, the exponential-race winner of norm(max(p - q, 0)).

Grid (T, S): CTA (t, s) streams its share of the vocabulary in tiles of ``TILE`` tokens straight
from global memory (coalesced 16-byte vector loads across the warpgroup), computes race scores
w_v / E_v (``pallas_kernels.sampling_math``) and keeps the running best score and its first index. The S
per-split winners are combined by the accept scan, which reads only the rows it needs. The last
tile is read shifted back to end at V, so no load is ever out of bounds; tokens already seen are
masked out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.platform import interpret_params
from pallas_kernels.sampling_math import race_scores, race_weights

LANES = 128            # threads of one warpgroup
VECTOR = 4             # 32-bit elements per 16-byte load
SMALL_TILE = LANES * VECTOR
LARGE_TILE = 4 * SMALL_TILE
TARGET_CTAS = 16 * 132  # CTAs to keep an H100/H200's 132 SMs busy (one warpgroup per CTA hides little latency)
_NO_INDEX = 2**30


def tile_size(vocab_size: int) -> int:
    """Tokens per tile; vocabularies smaller than a tile are zero-padded to it by the caller."""
    return LARGE_TILE if vocab_size >= LARGE_TILE else SMALL_TILE


def num_splits(num_slots: int, vocab_size: int) -> int:
    """Vocabulary splits per slot: enough CTAs for the GPU, at least one tile per split."""
    num_tiles = -(-max(vocab_size, 1) // tile_size(vocab_size))
    wanted = -(-TARGET_CTAS // max(num_slots, 1))
    return max(1, min(num_tiles, wanted))


def _race_body(vocab_size: int, tile: int, tiles_per_split: int, num_tiles: int,
               has_draft_probs: bool, seed_ref, draft_ref, target_ref, *refs):
    *draft_probs_ref, score_ref, index_ref = refs
    t = lax.axis_index("t")
    s = lax.axis_index("s")
    seed = seed_ref[t]
    draft = draft_ref[t]
    layout = plgpu.Layout.WG_STRIDED((tile,), vec_size=VECTOR)
    lane_ids = plgpu.broadcasted_iota(jnp.int32, (tile,), 0, layout=layout)
    first_tile = s * tiles_per_split
    last_tile = jnp.minimum(first_tile + tiles_per_split, num_tiles)

    def step(j, carry):
        best_score, best_index = carry
        tile_start = j * tile
        load_start = jnp.minimum(tile_start, vocab_size - tile)
        token_ids = lane_ids + load_start
        p = target_ref[t, pl.ds(load_start, tile)]
        if has_draft_probs:
            q = draft_probs_ref[0][t, pl.ds(load_start, tile)]
        else:
            q = (token_ids == draft).astype(jnp.float32)
        scores = race_scores(race_weights(p, q), seed, token_ids)
        scores = jnp.where(token_ids >= tile_start, scores, -1.0)
        tile_best = jnp.max(scores)
        tile_index = jnp.min(jnp.where(scores == tile_best, token_ids, _NO_INDEX))
        better = tile_best > best_score
        return jnp.where(better, tile_best, best_score), jnp.where(better, tile_index, best_index)

    best_score, best_index = lax.fori_loop(first_tile, last_tile, step,
                                           (jnp.float32(-1.0), jnp.int32(0)))
    score_ref[t, s] = best_score
    index_ref[t, s] = best_index


def recovered_token_splits(draft_token_ids: jax.Array, draft_probs: jax.Array | None,
                           target_probs: jax.Array, seeds: jax.Array, *, interpret: bool = False
                           ) -> tuple[jax.Array, jax.Array]:
    """Race winners per (slot, vocab split).

    Args:
      draft_token_ids: int32[T]; draft_probs: float[T, V] or None (q = one-hot(draft));
      target_probs: float[T, V]; seeds: uint32[T].
    Returns:
      float32[T, S] best scores and int32[T, S] their token ids (-1 score: empty split).
    """
    num_slots, vocab_size = target_probs.shape
    tile = tile_size(vocab_size)
    if vocab_size < tile:  # tiny vocabularies: pad once to a whole tile (zeros never win a race)
        pad = ((0, 0), (0, tile - vocab_size))
        target_probs = jnp.pad(target_probs, pad)
        draft_probs = None if draft_probs is None else jnp.pad(draft_probs, pad)
    padded_vocab = target_probs.shape[1]
    num_tiles = -(-padded_vocab // tile)
    splits = num_splits(num_slots, padded_vocab)
    tiles_per_split = -(-num_tiles // splits)
    splits = -(-num_tiles // tiles_per_split)
    body = functools.partial(_race_body, padded_vocab, tile, tiles_per_split, num_tiles,
                             draft_probs is not None)
    inputs = (seeds, draft_token_ids, target_probs) + (() if draft_probs is None else (draft_probs,))
    out_type = (jax.ShapeDtypeStruct((num_slots, splits), jnp.float32),
                jax.ShapeDtypeStruct((num_slots, splits), jnp.int32))
    return plgpu.kernel(body, out_type=out_type, grid=(num_slots, splits), grid_names=("t", "s"),
                        interpret=interpret_params(interpret))(*inputs)
