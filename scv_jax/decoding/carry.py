"""The carry: how a decode step dispatched before the host fetched the step before it (one step in flight,
``DecoderConfig.overlap``) learns what that step did.

The host builds a step's ``StepRow``s from what it knows: for a request the in-flight step also runs,
its row one step stale. The decoder keeps a device-resident carry, int32[slots, ``CarryColumn.WIDTH``]
(a row per ``RequestBatch`` slot, donated through every step like the caches): each step writes, for
each of its requests, the tokens it appended (cut at the request's budget and first stop id, exactly as
the host's ``RequestBatch.advance`` cuts them), whether the request ended, the drafter's lag after it and
the request's last tokens. The next step moves each row marked ``StepRow.CARRIED`` on by its slot's
carry (``carried_inputs``): the context grows by the tokens appended, the budget and ``min_tokens``
shrink by them, the lag and last tokens are the carry's, drafts stop at the budget. A request that ended
in the step before runs as padding (no drafts, no blocks: it writes nothing); the host drops its output.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from scv_jax.decoding.plan import MAX_CATCH_UP, CarryColumn, SamplingColumn, StepRow

LagRule = Callable[[jax.Array, jax.Array, int], jax.Array]    # (lag, num_accepted, k) -> the lag after a step


def zeros(num_slots: int) -> np.ndarray:
    """int32[num_slots, CarryColumn.WIDTH] a carry no step wrote (every row is exact before the first), on the
    host: the placement puts it on its devices (``jnp.zeros`` would compile a computation at an engine's
    first step)."""
    return np.zeros((num_slots, CarryColumn.WIDTH), np.int32)


def carried_inputs(carry: jax.Array, rows: jax.Array, sampling: jax.Array, block_tables: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A step's (rows int32[B, StepRow.WIDTH], sampling float32[B, SamplingColumn.WIDTH], block_tables
    int32[B, W]) with each row marked ``StepRow.CARRIED`` moved on by its slot's ``carry`` (see the module
    docstring); the other rows as given."""
    on = rows[:, StepRow.CARRIED] > 0
    moved = carry[jnp.clip(rows[:, StepRow.SLOT], 0, carry.shape[0] - 1)]
    emitted = jnp.where(on, moved[:, CarryColumn.EMITTED], 0)
    done = on & (moved[:, CarryColumn.DONE] > 0)
    budget = rows[:, StepRow.BUDGET] - emitted
    num_drafts = jnp.where(done, 0, jnp.clip(rows[:, StepRow.NUM_DRAFTS], 0, jnp.maximum(budget - 1, 0)))
    rows = rows.at[:, StepRow.CONTEXT].add(emitted)
    rows = rows.at[:, StepRow.BUDGET].set(jnp.where(done, 0, budget))
    rows = rows.at[:, StepRow.NUM_DRAFTS].set(num_drafts)
    rows = rows.at[:, StepRow.LAG].set(jnp.where(on, moved[:, CarryColumn.LAG], rows[:, StepRow.LAG]))
    rows = rows.at[:, StepRow.TOKENS:].set(jnp.where(on[:, None], moved[:, CarryColumn.TOKENS:],
                                                      rows[:, StepRow.TOKENS:]))
    min_tokens = jnp.maximum(sampling[:, SamplingColumn.MIN_TOKENS] - emitted.astype(sampling.dtype), 0)
    sampling = sampling.at[:, SamplingColumn.MIN_TOKENS].set(min_tokens)
    return rows, sampling, jnp.where(done[:, None], -1, block_tables)


def carry_after_step(carry: jax.Array, rows: jax.Array, packed: jax.Array, request_mask: jax.Array,
                     lag_rule: LagRule, k: int, max_lag: int) -> jax.Array:
    """``carry`` with the rows of a step's requests written: ``rows`` its (carried) int32[B, StepRow.WIDTH]
    rows, ``packed`` its ``StepSummary.packed`` int32[B, K + 4], ``request_mask`` bool[B]; ``lag_rule``
    the proposer's ``lag_after_step`` at the step's static ``k``, capped at ``max_lag``. Rows with no
    budget left (padding, and requests that ended a step ago) write nothing."""
    tokens, num_accepted, num_emitted = packed[:, :-3], packed[:, -3], packed[:, -2]
    budget, stops = rows[:, StepRow.BUDGET], rows[:, StepRow.STOP:StepRow.TOKENS]
    count = jnp.minimum(num_emitted, budget)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    hit = jnp.any((tokens[:, :, None] == stops[:, None, :]) & (stops[:, None, :] >= 0), axis=2)
    hit &= positions[None, :] < count[:, None]
    stopped = jnp.any(hit, axis=1)
    count = jnp.where(stopped, jnp.argmax(hit, axis=1).astype(jnp.int32) + 1, count)
    done = stopped | (budget - count <= 0)
    history = jnp.concatenate([rows[:, StepRow.TOKENS:], tokens], axis=1)      # the last tokens, then the new
    tail = jnp.take_along_axis(history, count[:, None] + jnp.arange(MAX_CATCH_UP, dtype=jnp.int32)[None, :], axis=1)
    lag = jnp.minimum(lag_rule(rows[:, StepRow.LAG], num_accepted, k), max_lag)
    written = jnp.concatenate([count[:, None], done[:, None].astype(jnp.int32), lag[:, None].astype(jnp.int32),
                               tail], axis=1)
    slots = jnp.where(request_mask & (budget > 0), rows[:, StepRow.SLOT], carry.shape[0])
    return carry.at[slots].set(written, mode="drop")
