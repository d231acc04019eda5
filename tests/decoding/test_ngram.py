"""Prompt-lookup drafting on the host: proposals match vLLM's rule, the index is incremental, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scv_jax import NgramDrafter
from scv_jax.decoding.proposers.ngram import UnverifiedProposals, propose_batch


def reference_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's n-gram proposer, by brute force: the longest n in [min_n, max_n] whose suffix occurs
    earlier in the text, its earliest occurrence, and up to k tokens that followed it."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


texts = st.lists(st.integers(0, 3), min_size=0, max_size=40)   # a small alphabet: many repeats


@given(texts, st.integers(1, 3), st.integers(0, 3), st.integers(0, 6))
def test_proposals_match_the_brute_force_rule(tokens, min_n, extra, k):
    drafter = NgramDrafter(min_n=min_n, max_n=min_n + extra)
    assert drafter.index(tokens).propose(k) == reference_proposal(tokens, min_n, min_n + extra, k)


@given(texts, st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=6), st.integers(1, 5))
def test_extending_the_index_equals_indexing_the_whole_text(prompt, pieces, k):
    drafter = NgramDrafter(min_n=1, max_n=3)
    index, text = drafter.index(prompt), list(prompt)
    for piece in pieces:
        index.extend(piece)
        text += piece
        assert index.propose(k) == drafter.index(text).propose(k) == reference_proposal(text, 1, 3, k)


def test_examples():
    drafter = NgramDrafter(min_n=2, max_n=3)
    assert drafter.index([1, 2, 3, 4, 2, 3]).propose(4) == [4, 2, 3]   # vLLM's docstring example
    assert drafter.index([1, 2, 3]).propose(4) == []                    # no earlier match
    assert NgramDrafter(1, 1).index([5, 6, 5]).propose(3) == [6, 5]     # at most up to the end
    proposals = propose_batch([drafter.index([1, 2, 1, 2]), drafter.index([7])], np.array([1, 3]))
    assert proposals == [[1], []]


@pytest.mark.parametrize("kwargs, match", [
    ({"min_n": 0}, "NgramDrafter: min_n must be an int >= 1, got 0"),
    ({"max_n": 2.5}, "NgramDrafter: max_n must be an int >= 1"),
    ({"min_n": 3, "max_n": 2}, r"NgramDrafter: min_n \(3\) must be <= max_n \(2\)"),
    ({"min_n": True}, "NgramDrafter: min_n"),
])
def test_bad_settings_raise_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NgramDrafter(**kwargs)


def matched_prefix(proposal: list[int], following: list[int]) -> int:
    """How many leading drafts of ``proposal`` the tokens that ``following`` holds repeat."""
    count = 0
    while count < min(len(proposal), len(following)) and proposal[count] == following[count]:
        count += 1
    return count


@given(st.lists(st.tuples(texts, texts, st.integers(0, 6), st.integers(0, 8)), min_size=1, max_size=5),
       st.integers(0, 2 ** 32 - 1))
def test_unverified_proposals_count_the_drafts_the_next_tokens_repeat(requests, seed):
    """Proposals made at a k = 0 step, checked once the following steps emitted their tokens: offered
    is each request's cap, accepted the proposal's prefix the emitted tokens repeat (only tokens
    emitted count; the rows past a request's length are scratch)."""
    drafter = NgramDrafter(min_n=1, max_n=2)
    rng = np.random.default_rng(seed)
    capacity = max(len(text) + len(after) for text, after, _, _ in requests) + 10
    tokens = rng.integers(0, 4, (len(requests), capacity)).astype(np.int32)     # scratch everywhere
    rows = rng.permutation(len(requests))[:max(1, len(requests) - 1)]
    lengths = np.zeros(len(requests), np.int64)
    for row, (text, after, emitted, _) in enumerate(requests):
        full = text + after[:emitted]
        tokens[row, :len(full)] = full
        lengths[row] = len(full)
    starts = np.array([len(requests[r][0]) for r in rows.tolist()], np.int64)
    caps = np.array([requests[r][3] for r in rows.tolist()], np.int64)
    indexes = [drafter.index(requests[r][0]) for r in rows.tolist()]
    proposals = [reference_proposal(requests[r][0], 1, 2, cap) for r, cap in zip(rows.tolist(), caps.tolist())]
    pending = UnverifiedProposals.of(propose_batch(indexes, caps), rows, starts, caps)
    assert pending.due == max(1, *map(len, proposals))
    offered, accepted = pending.check(tokens, lengths)
    np.testing.assert_array_equal(offered, caps)
    expected = [matched_prefix(p, requests[r][1][:requests[r][2]]) for p, r in zip(proposals, rows.tolist())]
    np.testing.assert_array_equal(accepted, expected)
