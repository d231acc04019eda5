"""Mosaic GPU kernel: per-split argmax of the target's logits, for greedy acceptance from logits.

Grid (T, S): CTA (t, s) streams split s of row t (``vocab_tiles.stream_best``; scores are the
logits as float32) and writes the split's maximum and its first token id. The accept scan combines
a slot's S winners when it visits the slot, so [T, V] is read exactly once and no [T] argmax array
makes a round trip through an extra launch. NaN never wins; a row of only NaN / -inf gives 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.platform import interpret_params
from pallas_kernels.vocab_tiles import SplitPlan, pad_vocab, plan_splits, stream_best


def _argmax_body(plan: SplitPlan, logits_ref, max_ref, index_ref):
    t = lax.axis_index("t")
    s = lax.axis_index("s")

    def scores(load_start, token_ids):
        del token_ids
        return logits_ref[t, pl.ds(load_start, plan.tile)].astype(jnp.float32)

    best, index = stream_best(scores, plan, s)
    max_ref[t, s] = best
    index_ref[t, s] = index


def argmax_splits(logits: jax.Array, *, num_splits: int | None = None,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Per (slot, vocabulary split): the largest logit and its first token id.

    Args:
      logits: float[T, V] (any float dtype; probabilities work too).
      num_splits: splits per row (default: fill the GPU); the combined winner does not depend on it.
    Returns:
      float32[T, S] split maxima (-inf for a split without a non-NaN value above -inf) and int32[T, S]
      their token ids.
    """
    num_slots, vocab_size = logits.shape
    plan = plan_splits(num_slots, vocab_size, num_splits)
    out_type = (jax.ShapeDtypeStruct((num_slots, plan.num_splits), jnp.float32),
                jax.ShapeDtypeStruct((num_slots, plan.num_splits), jnp.int32))
    return plgpu.kernel(functools.partial(_argmax_body, plan), out_type=out_type,
                        grid=(num_slots, plan.num_splits), grid_names=("t", "s"),
                        interpret=interpret_params(interpret))(pad_vocab(logits, plan))
