"""paged_attention with a tree over the new tokens (``new_token_parents``): the XLA reference and the Mosaic
GPU kernel (interpret mode off a GPU) against a dense masked float64 oracle, the chain as the special case,
CUDA lowering and bad inputs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import scv_jax
from scv_jax.ops import registry
import scv_jax.ops.attention.api  # noqa: F401,E402 - registers the op's implementations for registry.implementation
from scv_jax.ops.attention import api as _attention_api  # noqa: F401 (registers the op)
from tests.ops.attention.test_attention import KERNEL, Case, kernel_supports, make_inputs, stored, tolerance


def random_parents(rng, batch: int, tokens: int, bad: bool = False) -> np.ndarray:
    """Token 0 the root (the pending token), token i's parent uniform in [0, i); ``bad``: some entries
    outside [-1, i) (read as -1) and some extra roots."""
    parents = np.array([[-1] + [rng.integers(0, i) for i in range(1, tokens)] for _ in range(batch)], np.int32)
    if bad:
        parents = np.where(rng.random(parents.shape) < 0.3, rng.integers(-4, tokens + 4, parents.shape), parents)
    return parents.astype(np.int32)


def ancestors_and_depths(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A plain loop: bool[B, T, T] ancestor-or-self and int[B, T] depths (parents outside [-1, i) = -1)."""
    batch, tokens = parents.shape
    mask = np.zeros((batch, tokens, tokens), bool)
    for b in range(batch):
        for i in range(tokens):
            node = i
            while node != -1:
                mask[b, i, node] = True
                parent = parents[b, node]
                node = parent if -1 <= parent < node else -1
    return mask, mask.sum(axis=2) - 1


def dense_oracle(inputs: dict, parents: np.ndarray) -> np.ndarray:
    """float64 attention over every key of a request (cache, staged entries, new tokens) with a dense mask:
    the cache and the valid staged entries, plus the new tokens that are ancestors of the query or itself,
    at positions context + staged + depth, within the sliding window."""
    cache, layer = inputs["cache"], int(inputs["layer"])
    q = np.asarray(inputs["q"], np.float64)
    b, t, heads, d = q.shape
    group = heads // cache.num_kv_heads
    tables = np.asarray(inputs["block_tables"])
    capacity = tables.shape[1] * cache.block_size
    positions = np.arange(capacity)
    blocks = np.clip(tables[:, positions // cache.block_size], 0, cache.num_blocks - 1)
    slots = jnp.asarray((blocks * cache.block_size + positions % cache.block_size).reshape(-1), jnp.int32)
    table_keys, table_values = (np.asarray(x[layer], np.float64).reshape(b, capacity, cache.num_kv_heads, d)
                                for x in scv_jax.gather_kv(cache, slots))
    host = {k: stored(cache, inputs[k], "k" if k.endswith("keys") else "v")
            for k in ("staged_keys", "staged_values", "new_keys", "new_values") if k in inputs}
    ancestors, depth = ancestors_and_depths(parents)
    out = np.zeros(q.shape)
    for r in range(b):
        context = int(np.clip(inputs["context_lens"][r], 0, capacity))
        staged = int(np.clip(inputs["staged_lens"][r], 0, host["staged_keys"].shape[2])) if "staged_keys" in host else 0
        keys = [table_keys[r, :context]]
        values = [table_values[r, :context]]
        if staged:
            keys.append(host["staged_keys"][layer, r, :staged])
            values.append(host["staged_values"][layer, r, :staged])
        keys, values = np.concatenate(keys + [host["new_keys"][r]]), np.concatenate(values + [host["new_values"][r]])
        key_positions = np.concatenate([np.arange(context + staged), context + staged + depth[r]])
        for i in range(t):
            position = context + staged + depth[r, i]
            visible = np.concatenate([np.ones(context + staged, bool), ancestors[r, i]])
            if inputs.get("sliding_window"):
                visible &= key_positions > position - inputs["sliding_window"]
            for h in range(heads):
                scores = keys[visible, h // group] @ q[r, i, h] * d ** -0.5
                p = np.exp(scores - scores.max())
                out[r, i, h] = (p / p.sum()) @ values[visible, h // group]
    return out


def check_tree(case: Case, backend: str, bad: bool = False) -> None:
    inputs = make_inputs(case)
    parents = random_parents(np.random.default_rng(case.seed + 1), case.batch, case.tokens, bad)
    got = scv_jax.paged_attention(**inputs, new_token_parents=jnp.asarray(parents), backend=backend)
    assert got.shape == inputs["q"].shape and got.dtype == inputs["q"].dtype
    np.testing.assert_allclose(np.asarray(got, np.float64), dense_oracle(inputs, parents),
                               **tolerance(case, backend), err_msg=str(case))


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31), tokens=st.integers(1, 12), staged=st.sampled_from([None, 0, 3]),
       window=st.sampled_from([None, None, 3, 20]), group=st.sampled_from([1, 4]), bad=st.booleans())
@pytest.mark.slow
def test_xla_tree_matches_dense_oracle(seed, tokens, staged, window, group, bad):
    check_tree(Case(tokens=tokens, staged=staged, window=window, group=group, q_dtype="float32",
                    cache_dtype="float32", seed=seed), "xla", bad)


TREE_KERNEL_CASES = [
    Case("NHD", "bfloat16", None, 16, 2, 4, 64, tokens=9, staged=4),
    Case("HND", "float8_e4m3fn", "token_head", 16, 1, 8, 64, tokens=9, staged=2, max_blocks=3),  # 2 row blocks
    Case("NHD", "float32", None, 16, 2, 1, 64, tokens=40, staged=3, q_dtype="float32"),  # 2 bitmask words
]


@pytest.mark.parametrize("case", TREE_KERNEL_CASES, ids=lambda c: f"{c.layout}-{c.cache_dtype}-g{c.group}-t{c.tokens}")
@pytest.mark.parametrize("backend", [KERNEL])
def test_kernel_tree_matches_dense_oracle(backend, case):
    assert kernel_supports(case)
    check_tree(case, backend, bad=case.tokens == 40)


@pytest.mark.parametrize("backend", ["xla", KERNEL])
def test_the_chain_is_the_special_case(backend):
    """parents = t - 1 gives exactly the chain's result (bitwise)."""
    case = Case(tokens=6, staged=2, q_dtype="float32", cache_dtype="float32")
    inputs = make_inputs(case)
    chain = np.broadcast_to(np.arange(-1, case.tokens - 1, dtype=np.int32), (case.batch, case.tokens))
    tree = scv_jax.paged_attention(**inputs, new_token_parents=chain, backend=backend)
    np.testing.assert_array_equal(np.asarray(tree), np.asarray(scv_jax.paged_attention(**inputs, backend=backend)))


def test_tree_depths():
    parents = np.array([[-1, 0, 0, 1, 3, 9], [-1, -1, 1, 5, 2, 0]], np.int32)
    assert scv_jax.tree_depths(parents).tolist() == [[0, 1, 1, 2, 3, 0], [0, 0, 1, 0, 2, 1]]
    _, depth = ancestors_and_depths(parents)
    assert depth.tolist() == scv_jax.tree_depths(parents).tolist()


@pytest.mark.parametrize("tokens", [17, 40])   # one and two bitmask words (40 * G = 160 rows: 3 row blocks)
def test_kernel_with_a_tree_lowers_for_cuda(tokens):
    case = Case("NHD", "bfloat16", None, 16, 8, 4, 128, batch=2, tokens=tokens, staged=4)
    inputs = make_inputs(case)
    layer = jnp.int32(inputs["layer"])
    kernel = registry.implementation("paged_attention", "pallas")
    fn = functools.partial(kernel.run, sliding_window=None, interpret=False)
    args = (inputs["q"], inputs["cache"], layer, inputs["block_tables"], inputs["context_lens"],
            inputs["staged_keys"][layer], inputs["staged_values"][layer], inputs["staged_lens"], inputs["new_keys"],
            inputs["new_values"])
    parents = jnp.asarray(random_parents(np.random.default_rng(0), 2, tokens))
    text = jax.jit(lambda *a: fn(*a, new_token_parents=parents)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_bad_tree_inputs():
    inputs = make_inputs(Case(tokens=3))
    with pytest.raises(ValueError, match="new_token_parents"):
        scv_jax.paged_attention(**inputs, new_token_parents=np.zeros((3, 4), np.int32), backend="xla")
    with pytest.raises(TypeError, match="new_token_parents"):
        scv_jax.paged_attention(**inputs, new_token_parents=np.zeros((3, 3), np.float32), backend="xla")
    windowed = dict(inputs, sliding_window=4)
    with pytest.raises(ValueError, match="sliding window"):
        scv_jax.paged_attention(**windowed, new_token_parents=np.zeros((3, 3), np.int32), backend="interpret")
