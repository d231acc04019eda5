"""The draft-lag rule (``positions``): what a step commits to the draft cache and where it leaves it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scv_jax.decoding.positions import MAX_CATCH_UP, catch_up_rows, draft_rows_committed, lag_after_step

K_MAX = 8


@st.composite
def steps(draw):
    """A sequence of (static k, drafts verified, drafts accepted) steps."""
    out = []
    for _ in range(draw(st.integers(1, 30))):
        k = draw(st.sampled_from([0, 1, 2, 4, K_MAX]))
        verified = draw(st.integers(0, k))
        out.append((k, verified, draw(st.integers(0, verified))))
    return out


@given(steps())
def test_the_draft_cache_holds_what_its_forwards_ran(sequence):
    """Replays steps on token counts: the draft cache must hold exactly the tokens its forwards ran and
    committed, never a rejected draft's, and lag never exceeds MAX_CATCH_UP when the draft runs."""
    tokens, draft_len, lag = 5, 4, 1            # tokens known; draft cache length; lag = tokens - draft_len
    for k, verified, accepted in sequence:
        if k:                                   # a step that runs the draft first catches up
            missing = catch_up_rows(lag)
            draft_len, lag = draft_len + missing, lag - missing
            assert 1 <= lag <= MAX_CATCH_UP
            # it runs the lag tokens and d_1 .. d_{k-1}; of those, the accepted ones are the request's text
            ran_and_kept = lag + min(accepted, k - 1)
            assert draft_rows_committed(lag, accepted, k) == ran_and_kept
        else:
            assert draft_rows_committed(lag, accepted, k) == 0
        committed = draft_rows_committed(lag, accepted, k)
        draft_len += committed
        tokens += accepted + 1
        lag = lag_after_step(lag, accepted, k)
        assert lag == tokens - draft_len >= 1
        if k and verified < k:
            assert lag == 1                     # every accepted draft had been run by the draft


def test_catch_up_rows():
    assert [catch_up_rows(lag) for lag in range(1, 6)] == [0, 0, 2, 3, 4]
