"""The result type of the tree acceptance ops."""

from __future__ import annotations

from typing import NamedTuple

import jax


class TreeAcceptResult(NamedTuple):
    """What verifying one draft tree per request decided (a pytree).

    Attributes:
      output_token_ids: int32[B, max_depth + 1]; the emitted tokens, left-aligned: the accepted
        nodes' tokens, then the target's token after the last accepted node; -1 after.
      num_accepted: int32[B]; accepted nodes per request (emitted = num_accepted + 1).
      accepted_nodes: int32[B, max_depth]; the node accepted at each depth (a root-to-leaf path of
        the tree), -1 after the last.
    """

    output_token_ids: jax.Array
    num_accepted: jax.Array
    accepted_nodes: jax.Array
