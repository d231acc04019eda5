"""A ``HostDrafter``'s host half: it asks the drafter for each step's chains (the chain verifier,
``HostChains``) or trees (the tree verifier, ``HostTrees``), checks them, and lays them out as the step's
``drafts`` input. No draft model runs, so there is no draft cache and no lag. A request with a prediction
(predicted outputs, ``proposers.prediction``) drafts from it where it lines up, the drafter otherwise."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from scv_jax.decoding.plan import Drafts
from scv_jax.decoding.proposers.base import (HostDrafter, Proposer, Trie, checked_chains, checked_tries, path_trie,
                                             smallest_fitting)
from scv_jax.decoding.proposers.ngram import draft_grid
from scv_jax.decoding.proposers.ngram_trie import trie_grid
from scv_jax.decoding.proposers.prediction import Predictions


def with_predictions(predictions: Predictions, request_ids: Sequence[str], token_ids: Sequence[np.ndarray],
                     caps: np.ndarray, draft: Callable[[list[str], list[np.ndarray], np.ndarray], list]
                     ) -> tuple[list, np.ndarray | None]:
    """Each request's drafts: its prediction's chain where it offers one, ``draft``'s answer for the
    others (asked for those alone, if any); and bool[B] which came from a prediction (None: none did)."""
    if not predictions:
        return draft(list(request_ids), list(token_ids), caps), None
    chains = predictions.propose(request_ids, token_ids, caps)
    predicted = np.array([bool(chain) for chain in chains], np.bool_)
    rest = np.flatnonzero(~predicted)
    answers = draft([request_ids[i] for i in rest], [token_ids[i] for i in rest], caps[rest]) if rest.size else []
    for i, answer in zip(rest.tolist(), answers):
        chains[i] = answer
    return chains, predicted if predicted.any() else None


class HostChains(Proposer):
    """Chains from ``drafter`` of at most the chosen k drafts each; steps compile ``allowed_k`` and 0."""

    host_chains = True

    def __init__(self, drafter: HostDrafter, allowed_k: Sequence[int], vocab_size: int):
        self.host, self.vocab_size, self.predictions = drafter, vocab_size, Predictions()
        self.step_ks = tuple(sorted(set(allowed_k) | {0}))
        self.max_depth = self.step_ks[-1]

    def _chains(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray],
                caps: np.ndarray) -> tuple[list[list[int]], np.ndarray | None]:
        """The predictions' and the drafter's checked chains, and which came from a prediction."""
        return with_predictions(self.predictions, request_ids, token_ids, caps, lambda ids, tokens, caps: checked_chains(
            self.host, self.host.propose(ids, tokens, caps), caps, self.vocab_size))

    def chains(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], caps: np.ndarray) -> list[list[int]]:
        """The checked chains (also what the scheduler checks a k = 0 step's proposals with)."""
        return self._chains(request_ids, token_ids, caps)[0]

    def drafts(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], caps: np.ndarray,
               guessing: np.ndarray | None = None) -> Drafts:
        asked = caps if guessing is None else caps + guessing
        chains, predicted = (self._chains(request_ids, token_ids, asked) if asked.max(initial=0) > 0
                             else ([[] for _ in caps], None))
        guesses = None
        if guessing is not None:
            guesses = [list(chain[:1]) if guess else [] for chain, guess in zip(chains, guessing.tolist())]
            chains = [list(chain[1:]) if guess else chain for chain, guess in zip(chains, guessing.tolist())]
        num_drafts = np.array([len(c) for c in chains], np.int64)
        return Drafts(num_drafts, smallest_fitting(self.step_ks, int(num_drafts.max(initial=0))), chains, predicted,
                      guesses)

    def drafts_input(self, drafts: Drafts, positions: np.ndarray, size: int) -> np.ndarray:
        return draft_grid(drafts.host, positions, size, drafts.step_k)


class HostTrees(Proposer):
    """Trees from ``drafter.propose_tree`` of at most ``tree.max_nodes`` nodes; steps compile node-count
    buckets (``TreeConfig.node_buckets``) and 0."""

    verifier = "tree"

    def __init__(self, drafter: HostDrafter, tree, vocab_size: int):
        self.host, self.vocab_size, self.max_nodes = drafter, vocab_size, tree.max_nodes
        self.predictions = Predictions()
        self.step_ks = (0, *tree.node_buckets())
        self.max_depth = tree.max_depth

    def depth_for(self, k: int) -> int:
        return self.max_depth

    def _tries(self, request_ids: list[str], token_ids: list[np.ndarray], caps: np.ndarray) -> list[Trie]:
        """The drafter's checked trees."""
        if type(self.host).propose_tree is HostDrafter.propose_tree:     # its chains (caps <= max_nodes)
            return [path_trie(chain) for chain in checked_chains(
                self.host, self.host.propose(request_ids, token_ids, caps), caps, self.vocab_size)]
        return checked_tries(self.host, self.host.propose_tree(request_ids, token_ids, self.max_nodes, caps),
                             self.max_nodes, caps, self.vocab_size)

    def drafts(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], caps: np.ndarray,
               guessing: np.ndarray | None = None) -> Drafts:
        tries, predicted = with_predictions(self.predictions, request_ids, token_ids,
                                            np.minimum(caps, self.max_nodes), self._tries)
        tries = [trie if isinstance(trie, Trie) else path_trie(trie) for trie in tries]     # a prediction's chain
        num_drafts = np.minimum([t.depth for t in tries], caps).astype(np.int64)   # the deepest path it offers
        return Drafts(num_drafts, smallest_fitting(self.step_ks, max((len(t.tokens) for t in tries), default=0)), tries,
                      predicted)

    def drafts_input(self, drafts: Drafts, positions: np.ndarray, size: int) -> np.ndarray:
        return trie_grid(drafts.host, positions, size, drafts.step_k)
