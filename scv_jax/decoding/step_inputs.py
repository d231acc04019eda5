"""The numpy inputs of the device steps, built from a ``RequestBatch`` with a few array operations.

Decode-step inputs are built at their bucket's sizes, each request at its row of the placement's batch
layout (padding rows: no blocks, lag 1, no drafts), so the step executable is called with no further
planning or padding (``ExecutableCache.call_planned``), in three arrays: the block tables, one row of
numbers per request (``StepRow``) and its sampling filters (``SamplingColumn``).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from scv_jax.decoding.plan import SamplingColumn, StepRow
from scv_jax.decoding.positions import MAX_CATCH_UP
from scv_jax.decoding.requests import RequestBatch

_TAIL = np.arange(-MAX_CATCH_UP, 0)


def decode_inputs(state: RequestBatch, rows: np.ndarray, positions: np.ndarray, batch: int, width: int,
                  num_drafts: np.ndarray, max_lag: int = MAX_CATCH_UP) -> dict[str, np.ndarray]:
    """The per-request inputs of a decode step for ``rows`` (see ``device_step.decode_step``), request i
    at batch row ``positions[i]`` of ``batch`` rows, ``width`` blocks: ``block_tables``, ``rows``
    (``StepRow``, with the request's ``RequestBatch`` row as its control-state slot) and ``sampling``
    (``SamplingColumn``, ``min_tokens`` counted down by the tokens generated); the other rows are padding
    (greedy, no stop ids, no controls).

    The lag given to the step is capped at ``max_lag`` (the proposer's): with a draft model,
    ``MAX_CATCH_UP``: a step that runs the draft follows a catch-up (``positions.catch_up_rows``), and
    one that does not reads only the pending token.
    """
    length = state.length[rows]
    step_rows = np.zeros((batch, StepRow.WIDTH), np.int32)
    step_rows[:, StepRow.LAG] = 1
    step_rows[positions, StepRow.LAG] = np.minimum(state.lag[rows], max_lag)
    step_rows[positions, StepRow.CONTEXT] = length - 1
    step_rows[positions, StepRow.NUM_DRAFTS] = num_drafts
    step_rows[:, StepRow.STOP:StepRow.TOKENS] = -1
    step_rows[positions, StepRow.KEY:StepRow.KEY + 2] = state.keys[rows]
    step_rows[positions, StepRow.SLOT] = rows
    step_rows[positions, StepRow.BUDGET] = state.budget[rows]
    step_rows[positions, StepRow.STOP:StepRow.TOKENS] = state.stops[rows]
    # the last tokens (a 1-token request's column before its first is junk the step ignores: lag 1)
    step_rows[positions, StepRow.TOKENS:] = state.tokens[rows[:, None], length[:, None] + _TAIL]
    tables = np.full((batch, width), -1, np.int32)
    tables[positions] = state.blocks[rows, :width]
    sampling = np.zeros((batch, state.sampling.shape[1]), np.float32)
    sampling[positions] = state.sampling[rows]
    generated = length - state.prompt_len[rows]           # min_tokens -> the tokens before a stop may come
    sampling[positions, SamplingColumn.MIN_TOKENS] = np.maximum(sampling[positions, SamplingColumn.MIN_TOKENS]
                                                                - generated, 0)
    return dict(block_tables=tables, rows=step_rows, sampling=sampling)


def prefill_chunks(state: RequestBatch, rows: np.ndarray, begin: np.ndarray, count: np.ndarray,
                   chunk: int, lookahead: int = 0,
                   max_rows: int | None = None) -> Iterator[tuple[int, np.ndarray, dict[str, np.ndarray]]]:
    """Prefill-step inputs committing tokens [begin[b], begin[b] + count[b]) of each request in ``rows``,
    ``chunk`` tokens a call (``tokens`` int32[n, chunk + lookahead]: each call's chunk and the
    ``lookahead`` tokens after it, an EAGLE head's next token) and at most ``max_rows`` requests a call
    (None: all): yields (tokens committed so far, the call's rows, its inputs, one row per request in
    order)."""
    columns = np.arange(chunk + lookahead)
    for offset in range(0, int(count.max(initial=0)), chunk):
        live = np.flatnonzero(count > offset)
        per_call = max_rows or max(live.size, 1)
        for group in (live[i:i + per_call] for i in range(0, live.size, per_call)):
            sub = rows[group]
            start = begin[group] + offset
            take = np.minimum(count[group] - offset, chunk)
            positions = np.minimum(start[:, None] + columns, state.tokens.shape[1] - 1)
            tokens = np.where(columns < take[:, None] + lookahead, state.tokens[sub[:, None], positions], 0)
            width = int(state.num_blocks[sub].max())
            yield offset + chunk, sub, dict(block_tables=state.blocks[sub, :width], tokens=tokens.astype(np.int32),
                                            start=start.astype(np.int32), count=take.astype(np.int32))
