"""Suffix decoding on the host (``SuffixDrafter``, ``TokenIndex``): matches, chains and trees against a
brute-force reference on random token streams, incremental updates, the cache of finished outputs and its
bound, and argument errors. (End to end in the engine: test_suffix_engine.py.)"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scv_jax import SuffixDrafter
from scv_jax.decoding.proposers.suffix import best_first_tree, greedy_chain
from scv_jax.decoding.proposers.suffix_index import LEVELS, MAX_CANDIDATES, TokenIndex

small_texts = st.lists(st.integers(0, 3), max_size=60)          # a small alphabet: many repeats


def reference_match(segments: list[list[int]], context: list[int], exclude_end: bool):
    """(longest match, [(segment, end) reaching it], most recent first) by brute force, or None: the
    occurrences of the longest n-gram of ``LEVELS`` ending the context (``exclude_end``: not the one
    ending the last segment), its ``MAX_CANDIDATES`` most recent ones, each measured backwards."""
    for n in reversed(LEVELS):
        if n > len(context):
            continue
        found = [(s, end) for s, seg in enumerate(segments) for end in range(n, len(seg) + 1)
                 if seg[end - n:end] == context[-n:] and not (exclude_end and s == len(segments) - 1 and end == len(seg))]
        if found:
            break
    else:
        return None
    candidates = found[::-1][:MAX_CANDIDATES]

    def length(s: int, end: int) -> int:
        common = 0
        while common < len(context) and common < end and segments[s][end - 1 - common] == context[-1 - common]:
            common += 1
        return common

    longest = max(length(*c) for c in candidates)
    return longest, [c for c in candidates if length(*c) == longest]


def reference_chain(continuations: list[list[int]], width: int, min_prob: float) -> tuple[list[int], float]:
    """The greedy chain by counting: at each depth the most common next token among the continuations
    that agree so far (the most recent on ties), its share of those that go on."""
    chain, prob, score, agreeing = [], 1.0, 0.0, continuations
    for depth in range(width):
        going = [c for c in agreeing if len(c) > depth]
        if not going:
            break
        counts = Counter(c[depth] for c in going)
        top = max(counts.values())
        token = next(c[depth] for c in going if counts[c[depth]] == top)
        if prob * top / len(going) < min_prob:
            break
        prob *= top / len(going)
        score += prob
        chain.append(token)
        agreeing = [c for c in going if c[depth] == token]
    return chain, score


def prefix_probabilities(continuations: list[list[int]], width: int) -> dict[tuple, float]:
    """Every prefix (at most ``width`` long) of the continuations and its cumulative probability."""
    out: dict[tuple, float] = {}
    for c in continuations:
        for d in range(1, min(width, len(c)) + 1):
            prefix = tuple(c[:d])
            if prefix in out:
                continue
            prob = 1.0
            for j in range(d):
                going = [x for x in continuations if len(x) > j and tuple(x[:j]) == prefix[:j]]
                prob *= sum(x[j] == prefix[j] for x in going) / len(going)
            out[prefix] = prob
    return out


@given(st.lists(small_texts, min_size=1, max_size=4), st.lists(st.integers(0, 3), min_size=1, max_size=24),
       st.booleans())
@example([[0] * 60, [0] * 40], [0] * 20, False)            # more candidates than MAX_CANDIDATES
@example([[1, 2, 3, 1, 2, 3, 1, 2]], [1, 2, 3, 1, 2], False)
def test_a_match_is_the_brute_force_one(segments, context, exclude_end):
    index = TokenIndex()
    for i, segment in enumerate(segments):
        index.extend(segment)
        if i < len(segments) - 1:
            index.close_segment()
    starts = np.cumsum([0] + [len(s) + bool(s) for s in segments]).tolist()   # a separator after each nonempty one
    if exclude_end:
        context = segments[-1][-24:]
    found = index.match(context, before=index.end if exclude_end else None)
    expected = reference_match(segments, context, exclude_end)
    if expected is None or expected[0] == 0:
        assert found is None
    else:
        assert found is not None and found.length == expected[0]
        assert found.ends == [starts[s] + end for s, end in expected[1]]
        continuations = index.continuations(found.ends, 5)
        assert continuations == [segments[s][end:end + 5] for s, end in expected[1]]


@given(st.lists(st.lists(st.integers(0, 2), max_size=6), max_size=8), st.integers(0, 6),
       st.floats(0.0, 1.0))
def test_the_chain_is_the_greedy_one_by_counting(continuations, width, min_prob):
    (chain, score), (expected, expected_score) = (greedy_chain(continuations, width, min_prob),
                                                  reference_chain(continuations, width, min_prob))
    assert chain == expected and score == pytest.approx(expected_score)


@given(st.lists(st.lists(st.integers(0, 2), max_size=5), min_size=1, max_size=8), st.integers(0, 5),
       st.integers(1, 8), st.sampled_from([0.0, 0.1, 0.3]))
def test_the_tree_holds_the_most_probable_prefixes(continuations, width, max_nodes, min_prob):
    trie, score = best_first_tree(continuations, width, max_nodes, min_prob)
    probs = prefix_probabilities(continuations, width)
    paths: list[tuple] = []
    for token, parent in zip(trie.tokens, trie.parents):
        assert -1 <= parent < len(paths)                      # parents before children
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    assert len(set(paths)) == len(paths) <= max_nodes and all(p in probs for p in paths)
    eligible = sorted((p for p in probs.values() if p >= min_prob), reverse=True)
    assert sorted((probs[p] for p in paths), reverse=True) == pytest.approx(eligible[:max_nodes])
    assert score == pytest.approx(sum(probs[p] for p in paths))
    chain, _ = greedy_chain(continuations, width, min_prob)
    if max_nodes >= width and chain:                         # the greedy chain is a path of a big enough tree
        assert tuple(chain[:1]) in paths


def reference_propose(drafter: SuffixDrafter, text: list[int], finished: list[list[int]], cap: int) -> list[int]:
    """A drafter's chain by brute force: the better (by score; the request's own on a tie) of the greedy
    chains from its own text's and the kept finished outputs' longest matches."""
    if cap <= 0:
        return []
    context = text[-drafter.max_depth:]
    best: tuple[list[int], float] = ([], 0.0)
    kept = finished[max(0, len(finished) - drafter.max_cached_requests):] if drafter.max_cached_requests else []
    for segments, exclude_end in (([text], True), (kept, False)):
        found = reference_match(segments, context, exclude_end) if segments else None
        if found is None or found[0] == 0:
            continue
        width = min(cap, int(drafter.max_spec_factor * found[0] + 1e-9))
        chain, score = reference_chain([segments[s][end:end + width] for s, end in found[1]], width,
                                       drafter.min_token_prob)
        if score > best[1]:
            best = (chain, score)
    return best[0]


requests_st = st.lists(st.tuples(small_texts, st.lists(st.lists(st.integers(0, 3), max_size=4), max_size=5)),
                       min_size=1, max_size=6)


@settings(deadline=None)
@given(requests_st, st.integers(1, 8), st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.0, 0.1, 0.5]),
       st.integers(0, 3), st.integers(0, 6))
def test_proposals_equal_the_reference_as_requests_come_and_go(requests, max_depth, factor, min_prob, cached, cap):
    """Requests served one after another (prompt, then steps' tokens); before each step the proposal
    equals the brute-force one over the request's text and the finished outputs kept."""
    drafter = SuffixDrafter(max_depth=max_depth, max_spec_factor=factor, min_token_prob=min_prob,
                            max_cached_requests=cached)
    finished: list[list[int]] = []
    for i, (prompt, steps) in enumerate(requests):
        drafter.start(str(i), prompt)
        text = list(prompt)
        for piece in steps + [[]]:
            if text:
                proposal = drafter.propose([str(i)], [np.asarray(text)], np.array([cap]))
                assert proposal == [reference_propose(drafter, text, finished, cap)]
            drafter.extend(str(i), piece)
            text += piece
        drafter.finish(str(i))
        if len(text) > len(prompt):
            finished.append(text[len(prompt):])
        assert drafter.cached_requests == min(cached, len(finished))
        kept = finished[len(finished) - drafter.cached_requests:]
        assert drafter.cached_tokens == sum(len(f) + 1 for f in kept)
        assert drafter.num_running == 0


def test_an_unknown_request_is_indexed_from_its_text():
    drafter = SuffixDrafter()
    text = np.array([5, 6, 7, 8, 5, 6, 7])
    assert drafter.propose(["never-started"], [text], np.array([3])) == [[8, 5, 6]]
    assert drafter.num_running == 0


def test_a_finished_output_drafts_for_a_later_request_and_eviction_forgets_it():
    drafter = SuffixDrafter(max_cached_requests=1)
    drafter.start("a", [1, 2])
    drafter.extend("a", [9, 8, 7, 6, 5, 4])
    drafter.finish("a")
    drafter.start("b", [3, 9, 8, 7])                  # "9 8 7" was "a"'s output: "6 5 4" follows (cap 3)
    assert drafter.propose(["b"], [np.array([3, 9, 8, 7])], np.array([5])) == [[6, 5, 4]]
    drafter.extend("b", [0])
    drafter.finish("b")                                # "b"'s output [0] pushes "a"'s out
    assert (drafter.cached_requests, drafter.cached_tokens) == (1, 2)
    drafter.start("c", [9, 8, 7])
    assert drafter.propose(["c"], [np.array([9, 8, 7])], np.array([5])) == [[]]


def test_a_tree_offers_the_branches_seen():
    drafter = SuffixDrafter(min_token_prob=0.0)
    text = [7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2, 3, 6, 1, 2]   # "1 2" was followed by "3 8", "4 9", "3 6"
    drafter.start("a", text)
    trie, = drafter.propose_tree(["a"], [np.asarray(text)], 4, np.array([2]))
    assert trie == ([3, 4, 6, 8], [-1, -1, 0, 0])       # by probability: 2/3, then 1/3 each (most recent first)
    assert drafter.propose(["a"], [np.asarray(text)], np.array([2])) == [[3, 6]]   # a tie: the most recent


def test_a_dropped_output_leaves_no_trace_in_the_index():
    index = TokenIndex()
    for segment in ([1, 2, 3, 4], [2, 3, 5], [7, 7]):
        index.extend(segment)
        index.close_segment()
    index.drop_oldest()
    index.drop_oldest()
    assert index.match([2, 3]) is None and index.match([7, 7]).ends == [index.end - 1]
    assert (index.num_segments, index.num_tokens) == (1, 3)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_depth": 0}, "SuffixDrafter: max_depth must be an int >= 1, got 0"),
    ({"max_cached_requests": -1}, "SuffixDrafter: max_cached_requests must be an int >= 0, got -1"),
    ({"max_spec_factor": -0.5}, r"SuffixDrafter: max_spec_factor must be a number in \[0.0, inf\], got -0.5"),
    ({"min_token_prob": 1.5}, r"SuffixDrafter: min_token_prob must be a number in \[0.0, 1.0\], got 1.5"),
    ({"min_token_prob": "0.1"}, "SuffixDrafter: min_token_prob must be a number"),
])
def test_bad_arguments_get_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuffixDrafter(**kwargs)
