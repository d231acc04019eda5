"""Host-side request state: prompt checks, and ``RequestBatch``, the tokens, cache positions, block
tables and sampling rows of the running requests as arrays (one row a slot), so a step touches them
with a few numpy operations instead of a Python loop over requests."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from scv_jax.arguments import is_int
from scv_jax.decoding.block_pool import BlockPool, chain_hashes
from scv_jax.decoding.plan import SamplingColumn
from scv_jax.sampling_params import MAX_STOP_IDS, SamplingParams


def check_prompt(op: str, what: str, prompt: Any, vocab_size: int) -> list[int]:
    """One prompt (``what``, e.g. "prompt 3") as a list of ints; raises ValueError naming the problem."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"{op}: {what} is {type(prompt).__name__}, not token ids: tokenize it "
                         "first (for the byte-level demo models: list(b'...') or list(text.encode()))")
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"{op}: {what} must be a non-empty 1-D sequence of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{op}: {what} must hold integer token ids, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        j = int(np.argmax(bad))
        raise ValueError(f"{op}: {what} has token id {int(ids[j])} at index {j}, outside "
                         f"[0, vocab_size={vocab_size})")
    return ids.astype(np.int64).tolist()


def check_prompts(prompts: Any, vocab_size: int) -> list[list[int]]:
    """The prompts as lists of ints; raises ValueError naming the first problem (and how to fix it)."""
    hint = "prompts must be a list of token-id sequences, e.g. [[1, 2, 3]]"
    if isinstance(prompts, (str, bytes)) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
        raise ValueError(f"generate: {hint}, got a single {type(prompts).__name__}")
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(f"generate: {hint}, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("generate: prompts must hold at least one prompt")
    checked = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (int, np.integer)):
            raise ValueError(f"generate: {hint}, got a flat list of ints (wrap one prompt as [[...]])")
        checked.append(check_prompt("generate", f"prompt {i}", prompt, vocab_size))
    return checked


def check_eos(eos_token_id: Any, vocab_size: int, op: str = "generate") -> tuple[int, ...]:
    """``eos_token_id`` (None, an int or a sequence of ints, each in [0, vocab_size)) as a tuple of ints
    (() for None); raises a one-line ValueError naming ``eos_token_id`` otherwise."""
    if eos_token_id is None:
        return ()
    many = isinstance(eos_token_id, (list, tuple, range)) or (isinstance(eos_token_id, np.ndarray)
                                                             and eos_token_id.ndim == 1)
    ids = list(eos_token_id) if many else [eos_token_id]
    if not all(is_int(i, 0) and i < vocab_size for i in ids):
        raise ValueError(f"{op}: eos_token_id must be None, an int or a sequence of ints in "
                         f"[0, vocab_size={vocab_size}), got {eos_token_id!r}")
    return tuple(int(i) for i in ids)


SEED_RANGE = 2 ** 32


def check_seed(seed: Any) -> int:
    """``seed`` as a Python int in [0, 2**32); raises a one-line ValueError naming ``seed`` otherwise."""
    if not (is_int(seed, 0) and seed < SEED_RANGE):
        raise ValueError(f"generate: seed must be an int in [0, 2**32), got {seed!r}")
    return int(seed)


class RequestBatch:
    """The running requests, one row (slot) each (see ``positions`` for lengths and lags): ``start``
    fills a free row, ``finish`` frees it.

    Attributes:
      tokens: int32[S, capacity] each request's prompt then generated tokens (``length`` of them;
        entries past ``length`` are scratch).
      length, prompt_len: int64[S]; budget: int64[S] tokens each request may still emit;
      lag: int64[S] tokens the draft cache lacks.
      computed: int64[S] positions of each request's tokens in its caches (the draft's lacks ``lag`` - 1
        more): ``length`` - 1 once its prompt is prefilled, fewer while it is prefilled in chunks.
      sampling: float32[S, SamplingColumn.WIDTH] each request's filters (greedy: all 0).
      keys: int32[S, 2] each request's random stream (uint32 key data as int32 bits).
      stops: int32[S, MAX_STOP_IDS] the token ids that end each request (-1 = none).
      controls: each row's ``SamplingParams`` when they have logit controls (its row of the device's
        control state is written when it is admitted), else None.
      active: int64[n] rows of the running requests, in admission order (``decoding``: those prefilled).
      epoch: int64[S] how many requests each row has started (a step planned for a row's request is about
        another one when the row's epoch moved on since).
      may_lag: whether a k = 0 step may have left some lag above ``MAX_CATCH_UP`` (``positions``).
      blocks: int32[S, max_blocks] KV blocks (shared by both caches), -1 past ``num_blocks``, allocated
        from the request's pool as its positions need them (``ensure``), the first ones possibly cached
        blocks of its prefix; shards: int64[S] the data shard of each request's pool, ``pools[shard]``
        (0 on one device).
      span: the farthest back any layer of the models attends (their largest sliding window, when every
        layer has one), or None; released: int64[S] each request's first blocks, outside every layer's
        window from its next query on, that it gave back to its pool (``release_behind``; -1 in
        ``blocks``).
      prefix_root: the hash block hashes chain from (``block_pool.prefix_root``), None when prefix
        caching is off; hashes: each row's chained hashes of its blocks cached so far (``register``);
        lookahead: the tokens after a block hashed with it (``block_pool.chain_hashes``; an EAGLE head's: 1).
    """

    def __init__(self, num_slots: int, capacity: int, block_size: int, max_blocks: int, pools: Sequence[BlockPool],
                 prefix_root: bytes | None = None, lookahead: int = 0, span: int | None = None):
        self.tokens = np.zeros((num_slots, capacity), np.int32)
        self.length, self.prompt_len, self.budget = (np.zeros(num_slots, np.int64) for _ in range(3))
        self.lag = np.ones(num_slots, np.int64)
        self.computed = np.zeros(num_slots, np.int64)
        self.sampling = np.zeros((num_slots, SamplingColumn.WIDTH), np.float32)
        self.keys = np.zeros((num_slots, 2), np.int32)
        self.stops = np.full((num_slots, MAX_STOP_IDS), -1, np.int32)
        self.controls: list[SamplingParams | None] = [None] * num_slots
        self.may_lag = False
        self.blocks = np.full((num_slots, max_blocks), -1, np.int32)
        self.num_blocks = np.zeros(num_slots, np.int64)
        self.span = span
        self.released = np.zeros(num_slots, np.int64)
        self.shards = np.zeros(num_slots, np.int64)
        self.pools = list(pools)
        self.prefix_root = prefix_root
        self.hashes: list[list[bytes]] = [[] for _ in range(num_slots)]
        self.lookahead = lookahead
        self._block_size = block_size
        self.active = np.zeros(0, np.int64)
        self.epoch = np.zeros(num_slots, np.int64)

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def block_size(self) -> int:
        return self._block_size

    def to_prefill(self, rows: np.ndarray) -> np.ndarray:
        """int64[len(rows)] the tokens each request still has to prefill (all but the pending one; 0 once
        it decodes)."""
        return self.length[rows] - 1 - self.computed[rows]

    @property
    def decoding(self) -> np.ndarray:
        """int64[n] the rows of the running requests whose tokens are all in the caches but the pending
        one (their prompts prefilled), in admission order."""
        return self.active[self.to_prefill(self.active) <= 0]

    @property
    def prefilling(self) -> np.ndarray:
        """int64[n] the rows of the running requests whose prompts are still being prefilled, in
        admission order."""
        return self.active[self.to_prefill(self.active) > 0]

    def blocks_needed(self, positions: int) -> int:
        """Blocks that hold ``positions`` cache positions."""
        return -(-positions // self._block_size)

    def blocks_short(self, rows: np.ndarray, num_positions: np.ndarray) -> np.ndarray:
        """int64[len(rows)] the blocks each request lacks to address ``num_positions`` positions."""
        return np.maximum(-(-num_positions // self._block_size) - self.num_blocks[rows], 0)

    def prefix_hashes(self, tokens: list[int]) -> list[bytes]:
        """The chained hashes of the full blocks of ``tokens`` but the last (always computed: it is the
        pending one), the prefix a request may find cached ([] when prefix caching is off); each block
        hashed with the ``lookahead`` tokens after it (the pending one may be one of them)."""
        if self.prefix_root is None:
            return []
        return chain_hashes(self.prefix_root, np.asarray(tokens[:len(tokens) - 1 + self.lookahead]), self._block_size,
                            self.lookahead)

    def start(self, tokens: list[int], prompt_len: int, budget: int, shard: int, sampling: np.ndarray,
              keys: np.ndarray, stops: tuple[int, ...], controls: SamplingParams | None = None,
              cached: Sequence[int] = (), hashes: Sequence[bytes] = (), lag: int = 1) -> int:
        """Runs a request in the lowest free row: ``tokens`` its prompt (``prompt_len`` tokens) and what it
        generated before it was preempted, ``budget`` the tokens it may still emit, ``shard`` its pool;
        ``controls``: its params when it has logit controls; ``cached``: the cached blocks of its prefix
        it holds (``BlockPool.hold``) and their ``hashes``; ``lag``: its draft cache's lag once prefilled
        (``Proposer.lag_after_prefill``). Returns the row."""
        free = np.setdiff1d(np.arange(self.num_slots), self.active)
        if not free.size:
            raise RuntimeError("RequestBatch.start: every row runs a request")
        row = int(free[0])
        self.epoch[row] += 1
        self.shards[row] = shard
        self.blocks[row, :len(cached)] = cached
        self.num_blocks[row] = len(cached)
        self.hashes[row] = list(hashes)
        self.tokens[row, :len(tokens)] = tokens
        self.length[row], self.prompt_len[row] = len(tokens), prompt_len
        self.budget[row], self.lag[row] = budget, lag
        self.computed[row] = len(cached) * self._block_size
        self.sampling[row], self.keys[row] = sampling, keys
        self.stops[row] = -1
        self.stops[row, :len(stops)] = stops
        self.controls[row] = controls
        self.active = np.append(self.active, row)
        return row

    def generated(self, row: int) -> list[int]:
        """The tokens ``row``'s request generated so far (its stop token included)."""
        return self.tokens[row, self.prompt_len[row]:self.length[row]].tolist()

    def ensure(self, rows: np.ndarray, num_positions: np.ndarray) -> None:
        """Makes positions [0, num_positions[b]) of each request addressable (allocates blocks from
        its pool; CacheFullError when it has too few free: the scheduler makes room first)."""
        short = self.blocks_short(rows, num_positions)
        for row, count in zip(rows[short > 0].tolist(), short[short > 0].tolist()):
            have = int(self.num_blocks[row])
            self.blocks[row, have:have + count] = self.pools[self.shards[row]].allocate(count)
            self.num_blocks[row] = have + count

    def finish(self, rows: np.ndarray) -> None:
        """Ends (or preempts) the requests of ``rows``: their blocks go back to the pool, the rows are free."""
        for row in rows.tolist():
            count, released = int(self.num_blocks[row]), int(self.released[row])
            self.pools[self.shards[row]].free(self.blocks[row, released:count].tolist())
            self.blocks[row, :count] = -1
            self.num_blocks[row] = self.released[row] = 0
            self.controls[row] = None
            self.hashes[row] = []
        self.active = self.active[~np.isin(self.active, rows)]

    def release_behind(self, rows: np.ndarray, first_query: np.ndarray) -> None:
        """Gives back to their pools the blocks of ``rows`` that hold only positions no query from
        ``first_query`` (int64[len(rows)], the lowest position any cache of each request has yet to fill) on
        attends to: those before every layer's window (``span``); with prefix caching, only blocks already
        cached, which stay cached until the pool needs them. No-op when some layer attends to every
        earlier position (``span`` None)."""
        if self.span is None:
            return
        dead = np.maximum(first_query - self.span + 1, 0) // self._block_size
        for row, upto in zip(rows.tolist(), dead.tolist()):
            if self.prefix_root is not None:
                upto = min(upto, len(self.hashes[row]))
            start = int(self.released[row])
            if upto <= start:
                continue
            self.pools[self.shards[row]].free(self.blocks[row, start:upto].tolist())
            self.blocks[row, start:upto] = -1
            self.released[row] = upto

    def register(self, rows: np.ndarray, committed: np.ndarray) -> None:
        """Caches the blocks of ``rows`` now full of verified tokens in every cache (those below
        ``committed``, int64[len(rows)] the positions every cache holds, at most ``length`` - ``lookahead``)
        under their chained hashes."""
        if self.prefix_root is None:
            return
        bs = self._block_size
        for row, full in zip(rows.tolist(), (committed // bs).tolist()):
            hashes = self.hashes[row]
            if full <= len(hashes):
                continue
            start = len(hashes)
            hashes += chain_hashes(hashes[-1] if hashes else self.prefix_root,
                                   self.tokens[row, start * bs:full * bs + self.lookahead], bs, self.lookahead)
            pool = self.pools[self.shards[row]]
            for j in range(start, full):
                pool.register(int(self.blocks[row, j]), hashes[j])

    def advance(self, rows: np.ndarray, emitted: np.ndarray, num_emitted: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Appends each request's emitted tokens (int32[B, K + 1], ``num_emitted`` of them), trimmed to
        its budget and after its first stop id (``stops``); the draft lag is the proposer's to move
        (``Proposer.lag_after_step``). Returns int64[B] the tokens appended, bool[B] the requests done, bool[B] those ended
        by a stop id (the others done reached their budget)."""
        budget = self.budget[rows]
        count = np.minimum(num_emitted, budget)
        stops = self.stops[rows]
        hit = np.any((emitted[:, :, None] == stops[:, None, :]) & (stops[:, None, :] >= 0), axis=2)
        hit &= np.arange(emitted.shape[1]) < count[:, None]
        stopped = hit.any(axis=1)
        count = np.where(stopped, np.argmax(hit, axis=1) + 1, count)
        budget = np.where(stopped, 0, budget - count)
        length = self.length[rows]
        self.tokens[rows[:, None], length[:, None] + np.arange(emitted.shape[1])] = emitted   # past count: scratch
        self.length[rows] = length + count
        self.computed[rows] = length + count - 1
        self.budget[rows] = budget
        return count, budget <= 0, stopped
