"""Where each request's tokens are, and the one rule that moves the draft's cache length.

Request b has n tokens; the last one is *pending*: the target has not run it yet. The target cache
holds positions [0, n - 1) (its context length, ``n - 1``). The draft cache lags further: it holds
[0, n - lag) with lag >= 1; its ``lag`` missing tokens (the pending one last) are the first thing the
draft runs in its next forward.

A step has a static k (the drafts computed per request) and per request ``num_drafts <= k`` (the
drafts verified: ragged from an n-gram drafter, capped by a request's remaining budget).

* A step with k > 0 and a draft model runs the draft over the lag tokens (one catch-up forward of
  width ``MAX_CATCH_UP``) and d_1 .. d_{k-1} (it never runs d_k, which it only proposes) for every
  request, stages their K/V, and commits the lag rows plus the rows of the accepted drafts among
  them: ``lag + min(num_accepted, k - 1)`` rows. After the step the request has
  n + num_accepted + 1 tokens, so the new lag is 1, or 2 when all k drafts were accepted (d_k was
  never run). A request verifying ``num_drafts < k`` drafts has had every accepted draft run, so its
  new lag is 1.
* A step with k = 0 runs no draft forward and commits nothing to the draft cache: the lag grows by
  the one emitted token. Such a step costs exactly an autoregressive step.
* The catch-up forward has a static width of ``MAX_CATCH_UP`` tokens, so before a k > 0 step every
  request with ``lag > MAX_CATCH_UP`` first has its missing tokens but the pending one committed to
  the draft cache by a draft-only prefill (``catch_up_rows``), which leaves lag 1. A draft can thus
  fall behind by any number of tokens during a run of k = 0 steps; the cost is paid once, when
  speculation resumes: one draft forward over up to ``prefill_chunk`` missed tokens per request
  (requests of any lag share the call).

These functions work on Python ints, numpy arrays and (traced) JAX arrays alike, so the device step
and the host loop share them.
"""

from __future__ import annotations

from scv_jax.decoding.plan import MAX_CATCH_UP  # noqa: F401  (the catch-up forward's width)


def draft_rows_committed(lag, num_accepted, k: int):
    """Rows of the draft's staging buffer a step with static ``k`` drafts commits (per request)."""
    if k == 0:
        return 0 * lag
    return lag + num_accepted - (num_accepted == k)     # lag + min(num_accepted, k - 1)


def lag_after_step(lag, num_accepted, k: int):
    """The draft's lag after a step: its old lag, plus the emitted tokens (num_accepted + 1), minus the
    committed rows (``draft_rows_committed``): lag + 1 at k = 0, else 1 + (num_accepted == k)."""
    if k == 0:
        return lag + 1
    return 1 + (num_accepted == k)


def catch_up_rows(lag):
    """Tokens a draft-only prefill commits before a k > 0 step: every missing token but the pending
    one, for requests lagging more than ``MAX_CATCH_UP`` (0 for the others)."""
    return (lag > MAX_CATCH_UP) * (lag - 1)
