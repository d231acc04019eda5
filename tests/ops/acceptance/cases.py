"""Ragged draft batches for the acceptance tests: hypothesis strategies and a plain numpy oracle."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sampling_math import race_scores, race_weights


@dataclasses.dataclass
class DraftBatch:
    cu: np.ndarray          # int32[B + 1]
    draft: np.ndarray       # int32[T]
    target: np.ndarray      # int32[T]
    bonus: np.ndarray       # int32[B]
    max_spec_len: int
    vocab_size: int


@st.composite
def draft_batches(draw, spec_lens=(1, 2, 4, 6), batch_sizes=(1, 3, 6), vocab_sizes=(2, 5, 12)) -> DraftBatch:
    """Ragged batches with empty requests, full requests, padding slots and frequent matches.

    Shapes come from few choices (each compiles once); hypothesis varies the data inside them.
    """
    k = draw(st.sampled_from(spec_lens))
    b = draw(st.sampled_from(batch_sizes))
    counts = draw(st.lists(st.integers(0, k), min_size=b, max_size=b))
    vocab = draw(st.sampled_from(vocab_sizes))
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    t = max(8, -(-(int(cu[-1]) + draw(st.integers(0, 3))) // 8) * 8)  # padding slots, T a multiple of 8
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    draft = rng.integers(0, vocab, t).astype(np.int32)
    match_rate = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    target = np.where(rng.random(t) < match_rate, draft, rng.integers(0, vocab, t)).astype(np.int32)
    bonus = rng.integers(0, vocab, b).astype(np.int32)
    return DraftBatch(cu, draft, target, bonus, k, vocab)


def scan_oracle(cu, k, accepted, on_accept, on_reject, bonus, num_slots):
    """The specification as a plain loop: (tokens [B, k + 1], num_accepted [B], mask [T])."""
    b = len(cu) - 1
    tokens = np.full((b, k + 1), -1, np.int32)
    num_accepted = np.zeros(b, np.int32)
    mask = np.zeros(num_slots, bool)
    for r in range(b):
        start, end = cu[r], cu[r + 1]
        for i, slot in enumerate(range(start, end)):
            if accepted[slot]:
                tokens[r, i] = on_accept[slot]
                mask[slot] = True
                num_accepted[r] += 1
            else:
                tokens[r, i] = on_reject[slot]
                break
        else:
            tokens[r, end - start] = bonus[r]
    return tokens, num_accepted, mask


def greedy_oracle(batch: DraftBatch):
    accepted = batch.draft == batch.target
    return scan_oracle(batch.cu, batch.max_spec_len, accepted, batch.target, batch.target,
                       batch.bonus, len(batch.draft))


def random_probs(rng: np.random.Generator, shape, kind: str) -> np.ndarray:
    """Probability rows: "dirichlet", "sparse" (many exact zeros), or "onehot"."""
    if kind == "onehot":
        return np.eye(shape[1], dtype=np.float32)[rng.integers(0, shape[1], shape[0])]
    probs = rng.dirichlet(np.full(shape[1], 0.5), size=shape[0]).astype(np.float32)
    if kind == "sparse":
        probs = probs * (rng.random(shape) < 0.4)
        probs[:, 0] += 1e-3
        probs = probs / probs.sum(axis=1, keepdims=True)
    return probs.astype(np.float32)


def rejection_oracle(batch: DraftBatch, draft_probs, target_probs, uniforms, seeds):
    """Rejection sampling as a loop over slots, given the per-slot uniforms and seeds."""
    t, vocab = target_probs.shape
    q_rows = (np.eye(vocab, dtype=np.float32)[np.clip(batch.draft, 0, vocab - 1)]
              * ((batch.draft >= 0) & (batch.draft < vocab))[:, None]
              if draft_probs is None else np.asarray(draft_probs, np.float32))
    accepted = np.zeros(t, bool)
    for slot in range(t):
        x = batch.draft[slot]
        if 0 <= x < vocab:
            p_x = np.float32(target_probs[slot, x])
            q_x = np.float32(1.0) if draft_probs is None else np.float32(draft_probs[slot, x])
            accepted[slot] = q_x > 0 and np.float32(uniforms[slot]) * q_x < p_x
    scores = race_scores(race_weights(jnp.asarray(target_probs), jnp.asarray(q_rows)),
                         jnp.asarray(seeds, jnp.uint32)[:, None], jnp.arange(vocab, dtype=jnp.int32)[None, :])
    recovered = np.argmax(np.asarray(scores), axis=1).astype(np.int32)
    return scan_oracle(batch.cu, batch.max_spec_len, accepted, batch.draft, recovered,
                       np.clip(batch.bonus, 0, vocab - 1), t)


def as_jax(*arrays):
    return tuple(jnp.asarray(a) for a in arrays)


def assert_result_equal(result, expected):
    tokens, num_accepted, mask = expected
    np.testing.assert_array_equal(np.asarray(result.output_token_ids), tokens)
    np.testing.assert_array_equal(np.asarray(result.num_accepted), num_accepted)
    np.testing.assert_array_equal(np.asarray(result.accept_mask), mask)


def keys_for(num_requests: int, seed: int) -> jax.Array:
    return jax.random.split(jax.random.key(seed), num_requests)
