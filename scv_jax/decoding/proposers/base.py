"""``HostDrafter``, the public extension point for drafters that run on the host, and ``Proposer``, a
drafter's host half as the scheduler sees it (one class per drafter kind, made by ``factory``).

    class Repeat(scv_jax.HostDrafter):          # a toy drafter: repeat the last token
        def propose(self, request_ids, token_ids, max_drafts):
            return [[int(t[-1])] * int(n) for t, n in zip(token_ids, max_drafts)]

    engine = scv_jax.Engine(target, Repeat(), config=scv_jax.DecoderConfig(k=4))

Host drafts are verified losslessly like any other: greedy output equals the target's alone, and a
sampled request keeps the target's distribution (the drafts are a point mass, ``q`` one-hot).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from scv_jax.decoding.plan import MAX_CATCH_UP, Drafts
from scv_jax.decoding.proposers.prediction import Predictions


class Trie(NamedTuple):
    """A request's draft tree: node tokens and parents (-1 = a child of the root, the pending token),
    parents before children."""

    tokens: list[int]
    parents: list[int]

    @property
    def depth(self) -> int:
        """The most nodes on a root-to-leaf path."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return max(depth, default=0)


def path_trie(chain: Sequence[int]) -> Trie:
    """A chain of drafts as a one-path tree."""
    return Trie(list(chain), list(range(-1, len(chain) - 1)))


class HostDrafter:
    """Base class of a drafter that proposes tokens on the host (n-gram lookup, suffix trees, a
    retrieval index, your own): override ``propose``, and the lifecycle hooks if it keeps per-request
    state. Pass an instance as the drafter: ``Engine(target, drafter, config=...)`` or
    ``SpeculativeDecoder(target, drafter, ...)``; with ``DecoderConfig(tree=...)`` its chains are
    verified as one-path trees (override ``propose_tree`` to offer real trees).

    An instance serves the requests of one engine at a time (request ids are unique within an engine).
    """

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray],
                max_drafts: np.ndarray) -> list[Sequence[int]]:
        """Each running request's chain of drafts for this step (possibly empty).

        Args:
          request_ids: the requests' ids.
          token_ids: each request's prompt + generated tokens so far, 1-D int arrays (read-only views:
            copy what you keep). With ``DecoderConfig.draft_ahead``, a request the step in flight runs
            ends with that step's drafts, assumed accepted: the first token of its chain is then a
            guess of the token that step ends with (not verified; ``extend`` tells what came).
          max_drafts: int64[B] the most drafts each request may offer now.
        Returns:
          one sequence of token ids per request, at most ``max_drafts[i]`` long, ids in [0, vocab).
        """
        raise NotImplementedError(f"{type(self).__name__}.propose: a HostDrafter must override propose")

    def propose_tree(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], max_nodes: int,
                     max_depth: np.ndarray) -> list[Trie]:
        """Each request's draft tree (at most ``max_nodes`` nodes, ``max_depth[i]`` deep) for a tree
        decoder; by default its ``propose`` chain (cut to ``max_nodes``) as a one-path tree."""
        return [path_trie(chain) for chain in self.propose(request_ids, token_ids, np.minimum(max_depth, max_nodes))]

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Called once when a request is admitted (before its first ``propose``)."""

    def extend(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        """Called after each step with exactly the tokens it emitted for the request (their concatenation
        is the request's output)."""

    def finish(self, request_id: str) -> None:
        """Called once when a started request ends, for any reason (length, stop, abort)."""


def checked_chains(drafter: HostDrafter, chains: object, max_drafts: np.ndarray, vocab_size: int) -> list:
    """``drafter.propose``'s answer, checked at once over all chains (one array); raises a one-line
    ValueError naming the drafter's class for a wrong count, a chain longer than its ``max_drafts`` or an
    id outside [0, vocab_size)."""
    name = type(drafter).__name__
    if not isinstance(chains, (list, tuple)) or len(chains) != len(max_drafts):
        raise ValueError(f"{name}.propose must return a list of one draft chain per request ({len(max_drafts)}), "
                         f"got {type(chains).__name__}{f' of {len(chains)}' if hasattr(chains, '__len__') else ''}")
    try:
        lengths = np.array([len(chain) for chain in chains], np.int64)
        flat = np.asarray([token for chain in chains for token in chain])
    except (TypeError, ValueError):
        flat = None
    if (flat is None or flat.ndim != 1 or (flat.size and not np.issubdtype(flat.dtype, np.integer))
            or np.any(lengths > max_drafts) or (flat.size and (flat.min() < 0 or flat.max() >= vocab_size))):
        _raise_first_bad_chain(name, chains, max_drafts, vocab_size)
    return list(chains)


def _raise_first_bad_chain(name: str, chains: Sequence, max_drafts: np.ndarray, vocab_size: int) -> None:
    """Raises the one-line ValueError of the first bad chain (``checked_chains`` found one)."""
    for i, (chain, cap) in enumerate(zip(chains, max_drafts.tolist())):
        ids = np.asarray(chain)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"{name}.propose: request {i}'s drafts must be a 1-D sequence of token ids, got {chain!r}")
        if ids.size > cap:
            raise ValueError(f"{name}.propose: request {i} offered {ids.size} drafts, more than its max_drafts {cap}")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{name}.propose: request {i} offered a token id outside [0, vocab_size={vocab_size}): "
                             f"{chain!r}")
    raise ValueError(f"{name}.propose: the drafts must be 1-D sequences of token ids, got {chains!r}")


def checked_tries(drafter: HostDrafter, tries: object, max_nodes: int, max_depth: np.ndarray,
                  vocab_size: int) -> list[Trie]:
    """``drafter.propose_tree``'s answer; raises a one-line ValueError naming the drafter's class for a
    wrong count, too many nodes, a parent not before its child, a tree deeper than allowed or a bad id."""
    name = type(drafter).__name__
    if not isinstance(tries, (list, tuple)) or len(tries) != len(max_depth):
        raise ValueError(f"{name}.propose_tree must return one Trie per request ({len(max_depth)})")
    out = []
    for i, (trie, cap) in enumerate(zip(tries, max_depth.tolist())):
        tokens, parents = list(trie[0]), list(trie[1])
        ok = (len(tokens) == len(parents) <= max_nodes and all(-1 <= p < j for j, p in enumerate(parents))
              and all(0 <= t < vocab_size for t in tokens))
        trie = Trie([int(t) for t in tokens], [int(p) for p in parents])
        if not ok or trie.depth > cap:
            raise ValueError(f"{name}.propose_tree: request {i}'s tree must have at most {max_nodes} nodes, depth "
                             f"<= {cap}, parents in [-1, node) and ids in [0, vocab_size={vocab_size})")
        out.append(trie)
    return out


def smallest_fitting(step_ks: tuple[int, ...], most: int) -> int:
    """The smallest compiled static k of ``step_ks`` (ascending) that holds ``most`` drafts."""
    return next(k for k in step_ks if k >= most)


class Proposer:
    """A drafter's host half: which verifier scores its drafts ("chain" or "tree"), the static k values
    its steps compile (``step_ks``, 0 first), the most drafts a step accepts, whether its device half
    runs a draft model (which keeps a draft cache that lags the target's, caught up on the host when it
    lags more than ``MAX_CATCH_UP``) or runs in every step (an EAGLE head, ``every_step``), and each
    step's ``Drafts``.

    The host drafter (``host``), if any, receives the request lifecycle hooks; a host proposer also keeps
    the requests' predictions (``predictions``: None where predicted outputs are not supported).
    """

    verifier: str = "chain"
    has_draft_model: bool = False
    every_step: bool = False        # its device half runs in every step, k = 0 included (an EAGLE head)
    max_lag: int = MAX_CATCH_UP     # the most tokens its device half may lag at a step (``positions``)
    host_chains: bool = False       # ``chains`` offers host chains (a k = 0 step's can be checked later)
    host: HostDrafter | None = None
    predictions: Predictions | None = None
    step_ks: tuple[int, ...] = (0,)
    max_depth: int = 0
    lookahead: int = 0              # tokens past a block its draft rows depend on (an EAGLE head: 1)
    lag_after_prefill: int = 1      # the draft cache's lag once all but the pending token are prefilled

    def committed(self, length: np.ndarray, lag: np.ndarray) -> np.ndarray:
        """int64[B] the positions every cache holds for requests of ``length`` tokens at ``lag``: the
        target's, all but the pending token (a draft cache may hold fewer)."""
        return length - 1

    @property
    def device_drafts(self) -> bool:
        """Whether its drafts are made on the device (a draft model's or an EAGLE head's chains or trees): a
        constrained request's drafts then follow its drafting automaton (``grammar_automaton``)."""
        return self.has_draft_model or self.every_step

    @property
    def device_chains(self) -> bool:
        """Whether its drafts are chains of a draft model or an EAGLE head (made on the device): a step
        with constrained requests then runs split (``Scheduler.mask_drafts``)."""
        return self.device_drafts and self.verifier == "chain"

    def depth_for(self, k: int) -> int:
        """The most drafts a step at the chosen ``k`` may verify per request."""
        return k

    def drafts(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], caps: np.ndarray,
               guessing: np.ndarray | None = None) -> Drafts:
        """The step's drafts for requests that may verify up to ``caps[i]`` drafts each; ``guessing``
        (host chains with a step in flight): bool[B] the requests whose ``token_ids`` end with the drafts
        of the step in flight, assumed accepted: their chain starts with a guess of the token that step
        ends with, kept in ``Drafts.guesses`` (the step verifies the chain after it)."""
        return Drafts(np.zeros(len(caps), np.int64), 0)

    def chains(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], caps: np.ndarray) -> list[list[int]]:
        """Host chains of at most ``caps[i]`` drafts (only where ``host_chains``)."""
        raise NotImplementedError(f"{type(self).__name__} offers no host chains")

    def drafts_input(self, drafts: Drafts, positions: np.ndarray, size: int) -> np.ndarray | None:
        """The step executable's ``drafts`` argument (host drafts at their batch rows), or None."""
        return None

    def lag_after_step(self, lag: np.ndarray, num_accepted: np.ndarray, step_k: int) -> np.ndarray:
        """The draft cache's lag after a step (``positions``): grows by one token at k = 0."""
        return lag + 1 if step_k == 0 else 0 * lag + 1      # (numpy or traced: the carry's too)
