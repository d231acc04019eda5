"""Suffix decoding (arXiv 2411.04975; Arctic Inference, vLLM's ``method="suffix"``): a model-free
``HostDrafter`` that drafts from the request's own text and from the outputs of the requests served before.

Each step, for each request, the longest suffix of its last ``max_depth`` tokens is looked up twice: in its
own prompt + output (one ``TokenIndex`` per running request) and in the outputs of finished requests (one
``TokenIndex`` shared by all, the most recent ``max_cached_requests`` outputs, oldest dropped first). From
the occurrences that reach the longest match (the suffix tree's node), the draft follows the most frequent
next token, then the most frequent after that among the occurrences that agree so far, and so on: at most
``max_spec_factor`` x the match length and the request's cap, stopping before a token whose cumulative
empirical probability (the product of each chosen token's share of the occurrences still agreeing) falls
under ``min_token_prob``. Of the two drafts, the one with the larger score (the sum of those cumulative
probabilities: the tokens it expects accepted) wins, the request's own on a tie. No match: no drafts.

With ``DecoderConfig(tree=...)`` it proposes trees: from the better node, continuations are added best
first by cumulative probability (at least ``min_token_prob``), up to the tree's node and depth caps.

Drafts are a deterministic function of the texts seen, verified as a point mass, so greedy output equals
the target's alone and sampling keeps the target's distribution. The cost per step is O(candidates x
``max_depth``) whatever a text's length; appending a step's tokens costs O(tokens x levels).

    engine = Engine(target, SuffixDrafter(), config=DecoderConfig(k=8))
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from scv_jax.arguments import require_int
from scv_jax.decoding.proposers.base import HostDrafter, Trie
from scv_jax.decoding.proposers.suffix_index import Match, TokenIndex


def greedy_chain(continuations: list[list[int]], width: int, min_token_prob: float) -> tuple[list[int], float]:
    """The chain (at most ``width`` long) following the most frequent next token (ties: the most recent
    occurrence's) among the occurrences that agree so far, and its score (the sum of the chosen tokens'
    cumulative probabilities).

    Args:
      continuations: each occurrence's next tokens, most recent first (one that ends before a depth
        leaves the count there).
      min_token_prob: the chain stops before a token whose cumulative probability falls under it.
    """
    chain: list[int] = []
    prob, score = 1.0, 0.0
    for depth in range(width):
        if len(continuations) == 1:                  # one occurrence left: it is followed to its end
            rest = continuations[0][depth:width]
            return chain + rest, score + prob * len(rest)
        groups = _by_token(continuations, depth)
        if not groups:
            break
        token, group = max(groups.items(), key=lambda item: len(item[1]))   # the first most frequent
        share = len(group) / sum(map(len, groups.values()))
        if prob * share < min_token_prob:
            break
        prob *= share
        score += prob
        chain.append(token)
        continuations = group
    return chain, score


def best_first_tree(continuations: list[list[int]], width: int, max_nodes: int,
                    min_token_prob: float) -> tuple[Trie, float]:
    """The tree of the occurrences' continuations (``greedy_chain``'s) with the (at most ``max_nodes``)
    most probable prefixes of at most ``width`` tokens, each at least ``min_token_prob`` (a prefix's
    cumulative probability: the product of each token's share among the occurrences that agree up to its
    parent), parents before children, siblings by count; and its score (the sum of its nodes'
    probabilities)."""
    trie = Trie([], [])
    depths: list[int] = []
    score, order = 0.0, 0
    frontier: list[tuple[float, int, int, int, list[list[int]]]] = []    # (-prob, order, parent, token, agreeing)

    def push_children(parent: int, prob: float, agreeing: list[list[int]], depth: int) -> None:
        nonlocal order
        groups = _by_token(agreeing, depth) if depth < width else {}
        known = sum(map(len, groups.values()))
        for token, group in sorted(groups.items(), key=lambda item: -len(item[1])):   # stable: recency on ties
            child = prob * len(group) / known
            if child >= min_token_prob:
                heapq.heappush(frontier, (-child, order, parent, token, group))
                order += 1

    push_children(-1, 1.0, continuations, 0)
    while frontier and len(trie.tokens) < max_nodes:
        neg_prob, _, parent, token, group = heapq.heappop(frontier)
        trie.tokens.append(token)
        trie.parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        score -= neg_prob
        push_children(len(trie.tokens) - 1, -neg_prob, group, depths[-1])
    return trie, score


def _by_token(continuations: list[list[int]], depth: int) -> dict[int, list[list[int]]]:
    """The continuations that go on past ``depth``, grouped by their token there (in order of first
    appearance, the order kept within each group)."""
    groups: dict[int, list[list[int]]] = {}
    for c in continuations:
        if len(c) > depth:
            groups.setdefault(c[depth], []).append(c)
    return groups


@dataclass
class _Running:
    """A running request's own index (prompt + output) and its prompt's length."""

    index: TokenIndex
    prompt_len: int


@dataclass(frozen=True)
class SuffixDrafter(HostDrafter):
    """Suffix decoding (vLLM's ``suffix_decoding_*`` settings), a ``HostDrafter``.

    Attributes:
      max_depth: the longest suffix of a request's text matched (tokens).
      max_spec_factor: drafts per step at most this x the match length (and the request's cap).
      min_token_prob: a draft's cumulative empirical probability must stay at least this (0 to 1).
      max_cached_requests: the finished requests whose outputs are kept to draft from (0: none; the
        oldest is dropped first). The cache lives as long as the drafter (an engine's, a server's life).
    """

    max_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 10000
    _running: dict[str, _Running] = field(default_factory=dict, init=False, repr=False, compare=False)
    _finished: TokenIndex = field(default_factory=TokenIndex, init=False, repr=False, compare=False)

    def __post_init__(self):
        require_int("SuffixDrafter", "max_depth", self.max_depth, minimum=1)
        require_int("SuffixDrafter", "max_cached_requests", self.max_cached_requests, minimum=0)
        for name, low, high in (("max_spec_factor", 0.0, math.inf), ("min_token_prob", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"SuffixDrafter: {name} must be a number in [{low}, {high}], got {value!r}")

    @property
    def num_running(self) -> int:
        """The requests started and not yet finished (each holds its own index)."""
        return len(self._running)

    @property
    def cached_requests(self) -> int:
        """The finished requests whose outputs are kept (at most ``max_cached_requests``)."""
        return self._finished.num_segments

    @property
    def cached_tokens(self) -> int:
        """The tokens of those outputs (with one separator each)."""
        return self._finished.num_tokens

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        index = TokenIndex()
        index.extend(prompt_token_ids)
        self._running[request_id] = _Running(index, index.end)

    def extend(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._running[request_id].index.extend(new_token_ids)

    def finish(self, request_id: str) -> None:
        """Drops the request's own index; its output joins the finished outputs."""
        running = self._running.pop(request_id, None)
        if running is None or not self.max_cached_requests:
            return
        output = running.index.tokens(running.prompt_len)
        if output:
            self._finished.extend(output)
            self._finished.close_segment()
            while self._finished.num_segments > self.max_cached_requests:
                self._finished.drop_oldest()

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray],
                max_drafts: np.ndarray) -> list[list[int]]:
        """Each request's draft chain: the better of its own text's and the finished outputs'."""
        def chain(continuations: list[list[int]], width: int) -> tuple[list[int], float]:
            return greedy_chain(continuations, width, self.min_token_prob)

        return [self._better(r, t, cap, chain, []) for r, t, cap in zip(request_ids, token_ids, max_drafts.tolist())]

    def propose_tree(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], max_nodes: int,
                     max_depth: np.ndarray) -> list[Trie]:
        """Each request's draft tree: the better of its own text's and the finished outputs'."""
        def tree(continuations: list[list[int]], width: int) -> tuple[Trie, float]:
            return best_first_tree(continuations, width, max_nodes, self.min_token_prob)

        return [self._better(r, t, cap, tree, Trie([], []))
                for r, t, cap in zip(request_ids, token_ids, max_depth.tolist())]

    def _better(self, request_id: str, tokens: np.ndarray, cap: int,
                draft: Callable[[list[list[int]], int], tuple[Any, float]], empty: Any) -> Any:
        """The higher-scoring of ``draft(continuations, width)`` from the request's own text and from the
        finished outputs (its own on a tie), or ``empty``: no match, or ``cap`` 0."""
        best, best_score = empty, 0.0
        for index, match in self._matches(request_id, tokens) if cap > 0 else ():
            width = self._width(match, cap)
            drafted, score = draft(index.continuations(match.ends, width), width)
            if score > best_score:
                best, best_score = drafted, score
        return best

    def _width(self, match: Match, cap: int) -> int:
        """The most drafts from a match: ``max_spec_factor`` x its length, at most ``cap``."""
        return min(cap, int(self.max_spec_factor * match.length + 1e-9))

    def _matches(self, request_id: str, tokens: np.ndarray) -> list[tuple[TokenIndex, Match]]:
        """The longest match of the request's last ``max_depth`` tokens in its own text (before its end)
        and in the finished outputs, where found."""
        running = self._running.get(request_id)
        if running is None:                       # a request this drafter was not told of: index it now
            running = _Running(TokenIndex(), len(tokens))
            running.index.extend(tokens)
        context = tokens[-self.max_depth:].tolist()
        found = [(running.index, running.index.match(context, before=running.index.end)),
                 (self._finished, self._finished.match(context))]
        return [(index, match) for index, match in found if match is not None]
