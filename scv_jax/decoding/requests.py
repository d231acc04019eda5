"""Host-side request state: prompt checks, per-request tokens and block tables, and the numpy inputs
of one decode step."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from scv_jax.decoding.block_pool import BlockTable, stack_block_tables
from scv_jax.decoding.positions import MAX_CATCH_UP


@dataclasses.dataclass
class Request:
    """One request's tokens (prompt and generated) and where its caches stand (``positions``)."""

    index: int
    tokens: list[int]
    prompt_len: int
    table: BlockTable
    lag: int = 1              # trailing tokens the draft cache does not hold yet
    done: bool = False

    @property
    def context_len(self) -> int:
        """Positions in the target cache: every token but the pending last one."""
        return len(self.tokens) - 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


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


def step_inputs(requests: list[Request]) -> dict[str, np.ndarray]:
    """The per-request numpy inputs of a decode step (see ``device_step.decode_step``)."""
    batch = len(requests)
    lag = np.fromiter((r.lag for r in requests), np.int32, batch)
    lag_tokens = np.zeros((batch, MAX_CATCH_UP), np.int32)
    for row, r in zip(lag_tokens, requests):
        row[:r.lag] = r.tokens[len(r.tokens) - r.lag:]
    return dict(block_tables=stack_block_tables([r.table for r in requests],
                                                max(len(r.table.blocks) for r in requests)),
                lag_tokens=lag_tokens, lag=lag,
                context_lens=np.fromiter((r.context_len for r in requests), np.int32, batch),
                request_ids=np.fromiter((r.index for r in requests), np.int32, batch))
