"""``make_proposer``: the one place a drafter kind is named. A ``draft`` argument (None, ``"ngram"``, a
``HostDrafter`` or a draft model) and the decoder's config choose the proposer and its verifier."""

from __future__ import annotations

from typing import Any

from scv_jax.decoding.proposers.base import HostDrafter, Proposer
from scv_jax.decoding.proposers.draft_model import DraftModelChain, DraftModelTree, HeadChain, HeadTree
from scv_jax.decoding.proposers.host import HostChains, HostTrees
from scv_jax.decoding.proposers.ngram import NgramDrafter


def draft_model_of(draft: Any) -> Any | None:
    """The draft model among the drafter arguments (None for no drafter, ``"ngram"`` or a ``HostDrafter``);
    raises ValueError for a string other than "ngram"."""
    if isinstance(draft, str):
        if draft != "ngram":
            raise ValueError(f'draft must be a model, a HostDrafter (e.g. an NgramDrafter) or "ngram", got {draft!r}')
        return None
    return None if draft is None or isinstance(draft, HostDrafter) else draft


def is_head(draft: Any) -> bool:
    """Whether ``draft`` is an EAGLE head (``scv_jax.models.Eagle3Head``: it reads the target's taps at
    ``aux_layers`` through ``combine``)."""
    return hasattr(draft, "aux_layers") and callable(getattr(draft, "combine", None))


def make_proposer(draft: Any, allowed_k: tuple[int, ...], tree, vocab_size: int) -> Proposer:
    """The proposer of ``draft`` for steps of ``allowed_k`` chains, or ``tree`` (a ``TreeConfig``) trees:
    none (plain decoding), a draft model's chains or trees, or a host drafter's chains or trees
    (``"ngram"`` is ``NgramDrafter()``), or an EAGLE head's chains."""
    if draft is None:
        return Proposer()
    host = NgramDrafter() if isinstance(draft, str) else draft if isinstance(draft, HostDrafter) else None
    if host is not None:
        return HostChains(host, allowed_k, vocab_size) if tree is None else HostTrees(host, tree, vocab_size)
    if is_head(draft):
        return HeadChain(allowed_k) if tree is None else HeadTree(tree)
    return DraftModelChain(allowed_k) if tree is None else DraftModelTree(tree)
