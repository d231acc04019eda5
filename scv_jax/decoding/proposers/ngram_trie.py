"""n-gram trie drafting (host, numpy): several continuations of a request's suffix merged into a token tree.

The longest suffix of the request's text (n from ``max_n`` down to ``min_n``) that occurred before is looked
up at all its earlier occurrences (the most recent ``MAX_OCCURRENCES``); the tokens that followed each one
(up to the depth cap) are merged into a trie. Its nodes are the prefixes most often seen (a prefix is seen
at least as often as its extensions, so ties go to the shallower one, then the more recent): at most
``max_nodes`` of them, parents before children, siblings by count. The candidates are a deterministic
function of the text, so ``tree_rejection_sample`` keeps the target's distribution.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from scv_jax.decoding.proposers.base import Trie

MAX_OCCURRENCES = 64


class SuffixIndex(Protocol):
    """What a trie is built from: a request's text and the suffix lengths looked up (``NgramIndex``)."""

    tokens: list[int]
    suffix_sizes: tuple[int, ...]


def continuations(text: np.ndarray, sizes: Sequence[int], length: int) -> list[np.ndarray]:
    """The (at most ``length``) tokens after each earlier occurrence of ``text``'s longest suffix of one of
    ``sizes`` (longest first) that occurred before, most recent first; [] when none did."""
    for n in sizes:
        if n >= len(text):
            continue
        windows = np.lib.stride_tricks.sliding_window_view(text[:-1], n)    # windows ending before the last token
        ends = np.flatnonzero((windows == text[-n:]).all(axis=1)) + n       # the position after each occurrence
        if ends.size:
            return [text[end:end + length] for end in ends[::-1][:MAX_OCCURRENCES]]
    return []


def build_trie(paths: Sequence[np.ndarray], max_nodes: int) -> Trie:
    """The trie of ``paths`` (most recent first) with at most ``max_nodes`` nodes, the most frequent
    prefixes (then the shallower, then the more recent), parents before children, siblings by count."""
    seen: dict[tuple[int, ...], list[int]] = {}           # prefix -> [count, first path]
    for i, path in enumerate(paths):
        for d in range(1, len(path) + 1):
            entry = seen.setdefault(tuple(path[:d].tolist()), [0, i])
            entry[0] += 1
    ranked = sorted(seen, key=lambda prefix: (-seen[prefix][0], len(prefix), seen[prefix][1]))[:max_nodes]
    node = {prefix: i for i, prefix in enumerate(ranked)}
    return Trie([prefix[-1] for prefix in ranked], [node.get(prefix[:-1], -1) for prefix in ranked])


def propose_tries(indexes: Sequence[SuffixIndex], max_nodes: int, depth_caps: np.ndarray) -> list[Trie]:
    """Each request's trie: at most ``max_nodes`` nodes and ``depth_caps[b]`` deep."""
    tries = []
    for index, cap in zip(indexes, depth_caps.tolist()):
        paths = continuations(np.asarray(index.tokens, np.int64), index.suffix_sizes, cap) if cap > 0 else []
        tries.append(build_trie(paths, max_nodes))
    return tries


def trie_grid(tries: Sequence[Trie], positions: np.ndarray, batch: int, num_nodes: int) -> np.ndarray:
    """int32[batch, 2, num_nodes]: request i's trie tokens (row 0) and parents (row 1) at batch row
    ``positions[i]``; padding nodes have token 0 and parent -2 (never accepted)."""
    out = np.zeros((batch, 2, num_nodes), np.int32)
    out[:, 1] = -2
    for row, trie in zip(positions.tolist(), tries):
        out[row, 0, :len(trie.tokens)] = trie.tokens
        out[row, 1, :len(trie.parents)] = trie.parents
    return out
