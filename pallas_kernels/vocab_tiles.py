"""Streaming rows of a [rows, V] array through Mosaic GPU CTAs and keeping the first maximum.

Shared by the recovered-token race (``recovered_tokens``) and the fused greedy argmax
(``target_argmax``). A grid (rows, S) gives each row S vocabulary splits of whole tiles; CTA (r, s)
reads its tiles straight from global memory (coalesced 16-byte loads across the warpgroup). The last
tile is read shifted back to end at V, so no load is ever out of bounds; tokens an earlier tile
already covered are masked out. Each lane keeps its running best score and the token id where it
first reached it (strict ``>``: ties keep the smaller id, NaN never wins); one cross-lane reduction at
the end gives the CTA's winner. Split winners are combined in split order with the same strict rule,
so the result is the first index of the row maximum for every split count
(``sampling_math.argmax_ignoring_nan``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.platform import WARPGROUP_SIZE, target_ctas

VECTOR = 4                           # 32-bit elements per 16-byte load
SMALL_TILE = WARPGROUP_SIZE * VECTOR
LARGE_TILE = 4 * SMALL_TILE          # 16 elements per thread per array
_NO_INDEX = 2**30

# (first vocabulary id of the loaded tile, int32[tile] token ids) -> float32[tile] scores
TileScores = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How rows of ``vocab_size`` tokens are tiled and split over CTAs (all static)."""

    vocab_size: int        # after padding: at least one tile
    tile: int
    num_tiles: int
    tiles_per_split: int
    num_splits: int


def plan_splits(num_rows: int, vocab_size: int, num_splits: int | None = None) -> SplitPlan:
    """Tiles and splits for ``num_rows`` rows of ``vocab_size`` tokens.

    Args:
      num_splits: splits per row; default: enough CTAs to fill the GPU (``platform.target_ctas``).
        Capped at one tile per split; results do not depend on it.
    """
    tile = LARGE_TILE if vocab_size >= LARGE_TILE else SMALL_TILE
    padded = max(vocab_size, tile)
    num_tiles = -(-padded // tile)
    wanted = num_splits if num_splits is not None else -(-target_ctas() // max(num_rows, 1))
    splits = max(1, min(num_tiles, wanted))
    tiles_per_split = -(-num_tiles // splits)
    return SplitPlan(padded, tile, num_tiles, tiles_per_split, -(-num_tiles // tiles_per_split))


def pad_vocab(x: jax.Array | None, plan: SplitPlan) -> jax.Array | None:
    """Pads rows shorter than one tile with NaN (never a winner) up to ``plan.vocab_size``."""
    if x is None or x.shape[-1] == plan.vocab_size:
        return x
    return jnp.pad(x, ((0, 0), (0, plan.vocab_size - x.shape[-1])), constant_values=jnp.nan)


def stream_best(scores: TileScores, plan: SplitPlan, split: jax.Array,
                active: jax.Array | bool = True) -> tuple[jax.Array, jax.Array]:
    """Inside a kernel: the best score of ``split``'s tiles and its first token id.

    Returns (-inf, 0) when the split is empty, ``active`` is False, or no score beats -inf.
    """
    tile = plan.tile
    layout = plgpu.Layout.WG_STRIDED((tile,), vec_size=VECTOR)
    lane_ids = plgpu.broadcasted_iota(jnp.int32, (tile,), 0, layout=layout)
    first_tile = split * plan.tiles_per_split
    last_tile = jnp.minimum(first_tile + plan.tiles_per_split, plan.num_tiles)
    last_tile = jnp.where(active, last_tile, first_tile)

    def step(j, carry):
        lane_best, lane_index = carry
        tile_start = j * tile
        load_start = jnp.minimum(tile_start, plan.vocab_size - tile)
        token_ids = lane_ids + load_start
        tile_scores = scores(load_start, token_ids)
        better = (tile_scores > lane_best) & (token_ids >= tile_start)
        return jnp.where(better, tile_scores, lane_best), jnp.where(better, token_ids, lane_index)

    zeros = lane_ids * 0
    lane_best, lane_index = lax.fori_loop(first_tile, last_tile, step,
                                          (zeros.astype(jnp.float32) - jnp.inf, zeros))
    best = jnp.max(lane_best)
    return best, jnp.min(jnp.where(lane_best == best, lane_index, _NO_INDEX))


def combine_splits(score: Callable[[jax.Array], jax.Array], index: Callable[[jax.Array], jax.Array],
                   num_splits: int) -> tuple[jax.Array, jax.Array]:
    """Inside a kernel: the first split's winner among the best (scalar loop over S splits)."""

    def step(s, carry):
        best, best_index = carry
        candidate = score(s)
        better = candidate > best
        return jnp.where(better, candidate, best), jnp.where(better, index(s), best_index)

    return lax.fori_loop(0, num_splits, step, (jnp.float32(-jnp.inf), jnp.int32(0)))
