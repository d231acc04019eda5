"""Prompt-lookup (n-gram) drafting: drafts copied from the request's own text, no draft model.

Like vLLM's ``"ngram"`` speculative method: the last n tokens of a request (n from ``max_n`` down to
``min_n``) are looked up in its prompt and generated text; the longest suffix that occurred before,
at its earliest occurrence, proposes the (up to) k tokens that followed it there. Proposals may be
shorter than k (the match is near the end) or empty (no match): the decode step verifies each
request's own number of drafts, with greedy acceptance or ``rejection_sample(draft_probs=None)``
(the draft's distribution is a point mass), so the output keeps the target's distribution exactly.

Host-side and incremental: each request keeps a dict from n-gram to the position after its earliest
occurrence, extended with the tokens each step emits, so a proposal costs O(max_n) dict lookups
whatever the text's length.

    decoder = SpeculativeDecoder(target, NgramDrafter(min_n=1, max_n=3), config=DecoderConfig(k=4))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from scv_jax.arguments import require_int
from scv_jax.decoding.proposers.base import HostDrafter, Trie
from scv_jax.decoding.proposers.ngram_trie import propose_tries


@dataclass(frozen=True)
class NgramDrafter(HostDrafter):
    """Prompt-lookup drafting (vLLM: ``prompt_lookup_min`` / ``prompt_lookup_max``), a ``HostDrafter``
    keeping one ``NgramIndex`` per running request; with ``DecoderConfig(tree=...)`` it proposes n-gram
    tries (``ngram_trie``).

    Attributes:
      min_n, max_n: the shortest and longest suffix matched (1 <= min_n <= max_n).
    """

    min_n: int = 1
    max_n: int = 3
    _indexes: dict[str, "NgramIndex"] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("min_n", "max_n"):
            require_int("NgramDrafter", name, getattr(self, name), minimum=1)
        if self.min_n > self.max_n:
            raise ValueError(f"NgramDrafter: min_n ({self.min_n}) must be <= max_n ({self.max_n})")

    def index(self, tokens: Sequence[int]) -> "NgramIndex":
        """A lookup index over one request's tokens (its prompt), extended as it generates."""
        return NgramIndex(self, tokens)

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self._indexes[request_id] = self.index(list(prompt_token_ids))

    def extend(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._indexes[request_id].extend(new_token_ids)

    def finish(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def _index_of(self, request_id: str, tokens: np.ndarray) -> "NgramIndex":
        """The request's index (one over ``tokens`` for a request this drafter was not told of)."""
        index = self._indexes.get(request_id)
        return index if index is not None else self.index(tokens.tolist())

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray],
                max_drafts: np.ndarray) -> list[list[int]]:
        """Each request's prompt-lookup proposal, at most ``max_drafts[i]`` tokens."""
        return propose_batch([self._index_of(r, t) for r, t in zip(request_ids, token_ids)], max_drafts)

    def propose_tree(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], max_nodes: int,
                     max_depth: np.ndarray) -> list[Trie]:
        """Each request's n-gram trie (``ngram_trie.propose_tries``)."""
        return propose_tries([self._index_of(r, t) for r, t in zip(request_ids, token_ids)], max_nodes, max_depth)


class NgramIndex:
    """One request's text and its n-grams' earliest occurrences."""

    def __init__(self, drafter: NgramDrafter, tokens: Sequence[int]):
        self._sizes = range(drafter.min_n, drafter.max_n + 1)
        self._longest_first = tuple(reversed(self._sizes))
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}   # n-gram -> position just after its earliest occurrence
        self.extend(tokens)

    @property
    def suffix_sizes(self) -> tuple[int, ...]:
        """The suffix lengths looked up, longest first."""
        return self._longest_first

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens; indexes every n-gram that ends before the (new) last token."""
        text = self.tokens
        start = len(text)
        text.extend(tokens)
        after = self._after
        for end in range(max(start, 1), len(text)):     # n-grams text[end - n:end], followed by text[end]
            for n in self._sizes:
                if n > end:
                    break
                after.setdefault(tuple(text[end - n:end]), end)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the text's suffix."""
        text = self.tokens
        if k <= 0:
            return []
        for n in self._longest_first:
            if n <= len(text):
                end = self._after.get(tuple(text[-n:]))
                if end is not None:
                    return text[end:end + k]
        return []


def propose_batch(indexes: Sequence[NgramIndex], max_drafts: np.ndarray) -> list[list[int]]:
    """Each request's proposal, at most ``max_drafts[b]`` tokens."""
    return [index.propose(k) for index, k in zip(indexes, max_drafts.tolist())]


def draft_grid(proposals: list[list[int]], positions: np.ndarray, batch: int, k: int, fill: int = 0) -> np.ndarray:
    """int32[batch, k] drafts: request i's proposal (at most k tokens) left-aligned in row
    ``positions[i]``, ``fill`` elsewhere."""
    out = np.full((batch, k), fill, np.int32)
    for row, proposal in zip(positions.tolist(), proposals):
        out[row, :len(proposal)] = proposal[:k]
    return out


@dataclass
class UnverifiedProposals:
    """Proposals made at a k = 0 step (which verifies none), checked against the tokens the following
    k = 0 steps emit (one per request a step): how many drafts a step would have accepted.

    A proposal is a point mass, so the target's own token matches draft j with the chance rejection
    sampling would accept it (greedy: exactly when it would), and the matched prefix is distributed as
    the accepted drafts. The decoder gives these counts to the adaptive controller while it holds
    k = 0: otherwise a request that never drafts never shows that it should.

    Attributes:
      rows: int64[n] the requests' rows (``RequestBatch``); start: int64[n] their lengths when proposed.
      drafts: int32[n, L] the proposals, -1 past each one's end (L: the longest, >= 1).
      offered: int64[n] the drafts a step would have offered (its k within the budget; a short or
        empty proposal counts its missing drafts as rejected, as in a verified step).
      due: k = 0 steps until every proposal can be checked (L, at least 1).
    """

    rows: np.ndarray
    start: np.ndarray
    drafts: np.ndarray
    offered: np.ndarray
    due: int

    @classmethod
    def of(cls, proposals: list[list[int]], rows: np.ndarray, lengths: np.ndarray,
           max_drafts: np.ndarray) -> "UnverifiedProposals":
        """Each request's proposal of at most ``max_drafts[b]`` tokens (an empty one is news too: a
        step would have had none of its drafts accepted)."""
        longest = max(1, max(map(len, proposals), default=0))
        drafts = draft_grid(proposals, np.arange(len(proposals)), len(proposals), longest, fill=-1)
        return cls(rows, lengths.copy(), drafts, max_drafts.copy(), longest)

    def check(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64[n] (offered, accepted): each proposal's drafts and how many of them lead the tokens
        emitted after it (``tokens`` int32[R, capacity], ``lengths`` int64[R] of all requests). Check
        after ``due`` k = 0 steps: a request still running has then emitted every token its proposal
        needs (tokens not yet emitted count as mismatches)."""
        positions = self.start[:, None] + np.arange(self.drafts.shape[1])
        emitted = np.take_along_axis(tokens[self.rows], positions, axis=1)
        matched = (emitted == self.drafts) & (positions < lengths[self.rows][:, None])
        return self.offered, np.cumprod(matched, axis=1).sum(axis=1)
