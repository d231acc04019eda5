"""A draft model's host half: it drafts inside the step (chains, ``DraftModelChain``; EAGLE-2 trees,
``DraftModelTree``; an EAGLE head's chains, ``HeadChain``), so the host only sizes each step and moves
the draft cache's lag (``positions``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from scv_jax.decoding.plan import Drafts
from scv_jax.decoding.positions import lag_after_step
from scv_jax.decoding.proposers.base import Proposer, smallest_fitting


class DraftModelChain(Proposer):
    """Chains of k drafts from a draft model (the chain verifier); ``allowed_k``: the k values a step may
    choose (0 is always compiled: a budget's end, or the controller's choice)."""

    has_draft_model = True

    def __init__(self, allowed_k: Sequence[int]):
        self.step_ks = tuple(sorted(set(allowed_k) | {0}))
        self.max_depth = self.step_ks[-1]

    def drafts(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], caps: np.ndarray,
               guessing: np.ndarray | None = None) -> Drafts:
        return Drafts(caps, smallest_fitting(self.step_ks, int(caps.max(initial=0))))

    def lag_after_step(self, lag: np.ndarray, num_accepted: np.ndarray, step_k: int) -> np.ndarray:
        return lag_after_step(lag, num_accepted, step_k)

    def committed(self, length: np.ndarray, lag: np.ndarray) -> np.ndarray:
        """The draft cache's positions, [0, length - lag) (``positions``)."""
        return length - lag


def head_lag_after_step(lag: np.ndarray, num_accepted: np.ndarray, step_k: int) -> np.ndarray:
    """An EAGLE head's lag after a step (``decoding.head_step``): the tokens the step emitted, whose
    rows it runs next (it runs every step, k = 0 included, so it never lags more)."""
    return num_accepted + 1


class HeadRows:
    """What an EAGLE head's proposers share (``decoding.head_step``): it runs every step, k = 0 included,
    over the rows its previous step emitted, so it lags by ``num_accepted + 1`` (at most its deepest
    step + 1, all on the device: never caught up on the host), and by none after a prefill. Its row at
    position p pairs p's feature with token p + 1: the head cache holds the rows of positions
    [0, length - 1 - lag), and a cached block's rows depend on the token after the block (``lookahead``)."""

    has_draft_model = False
    every_step = True
    lookahead = 1
    lag_after_prefill = 0
    lag_after_step = staticmethod(head_lag_after_step)

    def committed(self, length: np.ndarray, lag: np.ndarray) -> np.ndarray:
        """The head cache's rows, [0, length - 1 - lag)."""
        return length - 1 - lag


class HeadChain(HeadRows, DraftModelChain):
    """Chains from an EAGLE head (``HeadRows``)."""

    def __init__(self, allowed_k: Sequence[int]):
        super().__init__(allowed_k)
        self.max_lag = self.max_depth + 1


class DraftModelTree(Proposer):
    """EAGLE-2 dynamic trees from a draft model (the tree verifier): every step with drafts builds a tree
    of ``tree.draft_nodes()`` nodes, each request accepting at most its cap."""

    verifier = "tree"
    has_draft_model = True

    def __init__(self, tree):
        self.step_ks = (0, tree.draft_nodes())
        self.max_depth = tree.max_depth

    def depth_for(self, k: int) -> int:
        return self.max_depth

    def drafts(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], caps: np.ndarray,
               guessing: np.ndarray | None = None) -> Drafts:
        return Drafts(caps, self.step_ks[-1] if caps.max(initial=0) > 0 else 0)

    def lag_after_step(self, lag: np.ndarray, num_accepted: np.ndarray, step_k: int) -> np.ndarray:
        """1, or 2 when a node was accepted: the last accepted node's K/V is not committed (the draft may
        never have run it); a k = 0 step adds its token to the lag."""
        return lag + 1 if step_k == 0 else 1 + (num_accepted > 0)

    def committed(self, length: np.ndarray, lag: np.ndarray) -> np.ndarray:
        """The draft cache's positions, [0, length - lag)."""
        return length - lag


class HeadTree(HeadRows, DraftModelTree):
    """EAGLE-2 dynamic trees from an EAGLE head (``decoding.head_step.HeadTreeVerifier``; ``HeadRows``)."""

    def __init__(self, tree):
        super().__init__(tree)
        self.max_lag = self.max_depth + 1
