"""Where each request's tokens are, and the one rule that moves the draft's cache length.

Request b has n tokens; the last one is *pending*: the target has not run it yet. The target cache
holds positions [0, n - 1) (its context length, ``n - 1``). The draft cache lags further: it holds
[0, n - lag) with 1 <= lag <= ``MAX_CATCH_UP``; its ``lag`` missing tokens (the pending one last) are
the first thing the draft runs in the next step (the *catch-up* forward).

A step with k > 0 drafts runs the draft over its lag tokens and d_1 .. d_{k-1} (it never runs d_k,
which it only proposes), stages their K/V, and commits the lag rows plus the rows of the accepted
drafts among them: ``lag + min(num_accepted, k - 1)`` rows. After the step the request has
n + num_accepted + 1 tokens, so the new lag is 1, or 2 when all k drafts were accepted (d_k was never
run). A k = 0 step runs and commits the lag tokens only, leaving lag 1.

These functions work on Python ints, numpy arrays and (traced) JAX arrays alike, so the device step
and the host loop share them.
"""

from __future__ import annotations

MAX_CATCH_UP = 2   # the most tokens the draft can lag behind (the catch-up forward's width)


def draft_rows_committed(lag, num_accepted, k: int):
    """Rows of the draft's staging buffer a step with ``k`` drafts commits (per request)."""
    if k == 0:
        return lag
    return lag + num_accepted - (num_accepted == k)     # lag + min(num_accepted, k - 1)


def lag_after_step(lag, num_accepted, k: int):
    """The draft's lag after a step: its old lag, plus the emitted tokens, minus the committed rows."""
    return lag + num_accepted + 1 - draft_rows_committed(lag, num_accepted, k)
