"""Host-side request state: prompt checks, and ``RequestBatch``, the tokens, cache positions and block
tables of one ``generate`` call's requests as arrays, so a step touches them with a few numpy
operations instead of a Python loop over requests."""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np

from scv_jax.arguments import is_int
from scv_jax.decoding.block_pool import BlockPool
from scv_jax.decoding.positions import lag_after_step


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
        if isinstance(prompt, (str, bytes)):
            raise ValueError(f"generate: prompt {i} is {type(prompt).__name__}, not token ids: tokenize it "
                             "first (for the byte-level demo models: list(b'...') or list(text.encode()))")
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"generate: prompt {i} must be a non-empty 1-D sequence of token ids, "
                             f"got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"generate: prompt {i} must hold integer token ids, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"generate: prompt {i} has token id {int(ids[j])} at index {j}, outside "
                             f"[0, vocab_size={vocab_size})")
        checked.append(ids.astype(np.int64).tolist())
    return checked


def check_eos(eos_token_id: Any, vocab_size: int) -> tuple[int, ...]:
    """``eos_token_id`` (None, an int or a sequence of ints, each in [0, vocab_size)) as a tuple of ints
    (() for None); raises a one-line ValueError naming ``eos_token_id`` otherwise."""
    if eos_token_id is None:
        return ()
    many = isinstance(eos_token_id, (list, tuple, range)) or (isinstance(eos_token_id, np.ndarray)
                                                             and eos_token_id.ndim == 1)
    ids = list(eos_token_id) if many else [eos_token_id]
    if not all(is_int(i, 0) and i < vocab_size for i in ids):
        raise ValueError(f"generate: eos_token_id must be None, an int or a sequence of ints in "
                         f"[0, vocab_size={vocab_size}), got {eos_token_id!r}")
    return tuple(int(i) for i in ids)


SEED_RANGE = 2 ** 32


def check_seed(seed: Any) -> int:
    """``seed`` as a Python int in [0, 2**32); raises a one-line ValueError naming ``seed`` otherwise."""
    if not (is_int(seed, 0) and seed < SEED_RANGE):
        raise ValueError(f"generate: seed must be an int in [0, 2**32), got {seed!r}")
    return int(seed)


class RequestBatch:
    """The requests of one ``generate`` call, one row each (see ``positions`` for lengths and lags).

    Attributes:
      tokens: int32[R, capacity] each request's prompt then generated tokens (``length`` of them;
        entries past ``length`` are scratch).
      length, prompt_len: int64[R]; budget: int64[R] tokens each request may still emit;
      lag: int64[R] tokens the draft cache lacks.
      active: int64[B] rows of the running requests; waiting: int64[W] rows of the requests not yet
        admitted, in admission order (``admit``: at most ``max_running`` run at once and at most
        ``per_shard`` on one data shard, the largest batch bucket's rows there).
      may_lag: whether a k = 0 step may have left some lag above ``MAX_CATCH_UP`` (``positions``).
      blocks: int32[R, max_blocks] KV blocks (shared by both caches), -1 past ``num_blocks``, from the
        request's pool; shards: int64[R] the data shard of each request's pool (0 on one device).
    """

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, pools: list[BlockPool], shards: list[int],
                 block_size: int, max_blocks: int, max_drafts: int, max_running: int | None = None,
                 per_shard: int | None = None):
        rows = len(prompts)
        self.prompt_len = np.array([len(p) for p in prompts], np.int64)
        self.length = self.prompt_len.copy()
        self.budget = np.full(rows, max_new_tokens, np.int64)
        # a step writes its max_drafts + 1 emitted tokens at once (``advance``)
        self.tokens = np.zeros((rows, int(self.prompt_len.max()) + max_new_tokens + max_drafts + 1), np.int32)
        for row, prompt in zip(self.tokens, prompts):
            row[:len(prompt)] = prompt
        self.lag = np.ones(rows, np.int64)
        self.may_lag = False
        self.blocks = np.full((rows, max_blocks), -1, np.int32)
        self.num_blocks = np.zeros(rows, np.int64)
        self._addressable = np.zeros(rows, np.int64)     # num_blocks * block_size
        self.shards = np.array(shards, np.int64)
        self._pools, self._block_size, self._per_shard = pools, block_size, per_shard
        self.active, self.waiting = np.zeros(0, np.int64), np.arange(rows)
        self.admit(rows if max_running is None else max_running)

    def admit(self, count: int) -> np.ndarray:
        """Moves up to ``count`` waiting requests to the running ones, in order, passing over those whose
        data shard already runs ``per_shard`` requests; returns int64[n] their rows."""
        if self._per_shard is None:
            admitted, self.waiting = self.waiting[:count], self.waiting[count:]
        else:
            load, chosen = collections.Counter(self.shards[self.active].tolist()), []
            for row, shard in zip(self.waiting.tolist(), self.shards[self.waiting].tolist()):
                if len(chosen) == count:
                    break
                if load[shard] < self._per_shard:
                    load[shard] += 1
                    chosen.append(row)
            admitted = np.array(chosen, np.int64)
            self.waiting = self.waiting[~np.isin(self.waiting, admitted)]
        self.active = np.concatenate([self.active, admitted])
        return admitted

    def outputs(self) -> list[list[int]]:
        """The generated tokens of each request (EOS included)."""
        return [row[p:n].tolist() for row, p, n in zip(self.tokens, self.prompt_len, self.length)]

    def ensure(self, rows: np.ndarray, num_positions: np.ndarray) -> None:
        """Makes positions [0, num_positions[b]) of each request addressable (allocates blocks)."""
        short = self._addressable[rows] < num_positions
        if not short.any():
            return
        for row, positions in zip(rows[short].tolist(), num_positions[short].tolist()):
            have = int(self.num_blocks[row])
            count = -(-positions // self._block_size) - have
            self.blocks[row, have:have + count] = self._pools[row].allocate(count)
            self.num_blocks[row] = have + count
            self._addressable[row] = (have + count) * self._block_size

    def release(self, rows: np.ndarray) -> None:
        """Returns the blocks of ``rows`` to the pool."""
        for row in rows.tolist():
            count = int(self.num_blocks[row])
            if count:
                self._pools[row].free(self.blocks[row, :count].tolist())
                self.blocks[row, :count] = -1
                self.num_blocks[row] = self._addressable[row] = 0

    def advance(self, rows: np.ndarray, emitted: np.ndarray, num_emitted: np.ndarray, num_accepted: np.ndarray,
                k: int, eos_token_id: int | Sequence[int] | None) -> np.ndarray:
        """Appends each request's emitted tokens (int32[B, K + 1], ``num_emitted`` of them), trimmed to
        its budget and after the first of ``eos_token_id`` (None, one id or a sequence of ids); moves its
        draft lag by a step with static ``k``; finishes and releases requests that are done. Returns
        int64[B] the tokens appended per row."""
        budget = self.budget[rows]
        count = np.minimum(num_emitted, budget)
        eos = np.asarray(() if eos_token_id is None else eos_token_id, np.int64).reshape(-1)
        if eos.size:
            hit = np.isin(emitted, eos) & (np.arange(emitted.shape[1]) < count[:, None])
            stopped = hit.any(axis=1)
            count = np.where(stopped, np.argmax(hit, axis=1) + 1, count)
            budget = np.where(stopped, 0, budget - count)
        else:
            budget = budget - count
        length = self.length[rows]
        self.tokens[rows[:, None], length[:, None] + np.arange(emitted.shape[1])] = emitted   # past count: scratch
        self.length[rows] = length + count
        self.budget[rows] = budget
        self.lag[rows] = lag_after_step(self.lag[rows], num_accepted, k)
        self.may_lag |= k == 0
        finished = budget <= 0
        if finished.any():
            self.release(rows[finished])
            self.active = rows[~finished]
        return count

