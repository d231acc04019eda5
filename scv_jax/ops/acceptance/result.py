"""The result type of the acceptance ops."""

from __future__ import annotations

from typing import NamedTuple

import jax


class AcceptResult(NamedTuple):
    """What one verification step decided, per request (a pytree; vLLM-compatible layout).

    Attributes:
      output_token_ids: int32[B, max_spec_len + 1]; emitted tokens, left-aligned, -1 after the last.
      num_accepted: int32[B]; accepted drafts per request (emitted = num_accepted + 1 unless the
        request had no slot left to emit into, which cannot happen for valid input).
      accept_mask: bool[T]; True exactly at accepted draft slots (a prefix of each request).
    """

    output_token_ids: jax.Array
    num_accepted: jax.Array
    accept_mask: jax.Array
