"""paged_attention: the XLA reference and the Mosaic GPU kernel (interpret mode off a GPU) against a dense
float64 oracle built from ``gather_kv`` reads, CUDA lowering and bad inputs (``tests/decoding`` runs the
decoder, whose models attend through this op, with every kernel interpreted)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import scv_jax
from scv_jax.ops import registry
import scv_jax.ops.attention.api  # noqa: F401,E402 - registers the op's implementations for registry.implementation
from scv_jax.ops.attention.reference import in_flight_kv, paged_attention_reference
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.registry import cuda_available

FP8 = ("float8_e4m3fn", "float8_e5m2")
CACHE_DTYPES = ("float32", "float16", "bfloat16") + FP8
KERNEL = "pallas" if cuda_available() else "interpret"
# Kernel tests are parametrised by backend so their ids say "pallas" on a GPU (the GPU suite's filter).
with_kernel = pytest.mark.parametrize("backend", [KERNEL])


@dataclasses.dataclass(frozen=True)
class Case:
    layout: str = "NHD"
    cache_dtype: str = "bfloat16"
    scale_mode: str | None = None
    block_size: int = 16
    kv_heads: int = 2
    group: int = 2
    head_dim: int = 64
    batch: int = 3
    tokens: int = 3
    staged: int | None = 2            # staged capacity S; None: no staging buffer
    max_blocks: int = 4
    q_dtype: str = "bfloat16"         # also the dtype of the staged and new K/V
    num_layers: int = 2
    window: int | None = None         # sliding window
    sinks: bool = False               # a sink logit per query head (float32, N(0, 4))
    seed: int = 0

    @property
    def num_blocks(self) -> int:
        return self.batch * self.max_blocks + 1


def make_inputs(case: Case) -> dict:
    """Random pages (all blocks), scales, queries, staged and new K/V; request 0 is a padded request
    (context 0, no staged entries, an all -1 block table), the others use random contexts, staged
    lengths and distinct blocks (-1 past their last page)."""
    rng = np.random.default_rng(case.seed)
    cache = scv_jax.PagedKVCache.create(case.num_layers, case.num_blocks, case.block_size, case.kv_heads,
                                        case.head_dim, dtype=case.cache_dtype, layout=case.layout,
                                        scale_mode=case.scale_mode)
    page = lambda: jnp.asarray(rng.standard_normal(cache.k_pages.shape), cache.dtype)  # noqa: E731
    fields = dict(k_pages=page(), v_pages=page())
    if case.scale_mode is not None:
        fields.update({name: jnp.asarray(rng.uniform(0.1, 1.5, np.shape(cache.k_scale)), jnp.float32)
                       for name in ("k_scale", "v_scale")})
    cache = cache.replace(**fields)
    b, t, heads, d = case.batch, case.tokens, case.kv_heads * case.group, case.head_dim
    capacity = case.max_blocks * case.block_size
    context = rng.integers(0, capacity + 1, b)
    context[0] = 0
    if b > 1:
        context[-1] = capacity                          # a full table
    blocks = rng.permutation(case.num_blocks)[:b * case.max_blocks].reshape(b, case.max_blocks)
    used = -(-context // case.block_size)
    tables = np.where(np.arange(case.max_blocks)[None] < used[:, None], blocks, -1).astype(np.int32)
    dtype = jnp.dtype(case.q_dtype)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    inputs = dict(q=normal(b, t, heads, d), cache=cache, layer=case.num_layers - 1, block_tables=jnp.asarray(tables),
                  context_lens=jnp.asarray(context, jnp.int32), new_keys=normal(b, t, case.kv_heads, d),
                  new_values=normal(b, t, case.kv_heads, d), sliding_window=case.window)
    if case.sinks:
        inputs["sinks"] = jnp.asarray(2 * rng.standard_normal(heads), jnp.float32)
    if case.staged is not None:
        staged_lens = rng.integers(0, case.staged + 1, b)
        staged_lens[0] = 0
        shape = (case.num_layers, b, case.staged, case.kv_heads, d)
        inputs.update(staged_keys=normal(*shape), staged_values=normal(*shape),
                      staged_lens=jnp.asarray(staged_lens, jnp.int32))
    return inputs


def stored(cache: PagedKVCache, x, which: str) -> np.ndarray:
    """float64 K (``which`` "k") or V ("v") ``[..., kv_heads, head_dim]`` as the cache holds them: committed
    with ``commit_draft_kv`` into a scratch cache of ``cache``'s dtype, layout and scales, read back
    with ``gather_kv``."""
    x = jnp.asarray(x)
    tokens = x.reshape(1, -1, *x.shape[-2:])
    num_blocks = max(-(-tokens.shape[1] // cache.block_size), 1)
    scales = {} if cache.scale_mode in (None, "token_head") else dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    scratch = PagedKVCache.create(1, num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim,
                                  dtype=cache.dtype, layout=cache.layout, scale_mode=cache.scale_mode, **scales)
    slots = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    keys, values = scv_jax.gather_kv(scv_jax.commit_draft_kv(scratch, tokens, tokens, slots, backend="xla"), slots)
    return np.asarray(keys if which == "k" else values, np.float64).reshape(x.shape)


def oracle(inputs: dict) -> np.ndarray:
    """float64 dense attention over ``gather_kv`` reads of each request's context, the staged entries
    and the causal new tokens (those two as the cache will hold them, ``stored``), within the sliding
    window, with each head's sink logit in its softmax; lengths clamped like the op documents."""
    cache, layer = inputs["cache"], int(inputs["layer"])
    q = np.asarray(inputs["q"], np.float64)
    b, t, heads, d = q.shape
    group = heads // cache.num_kv_heads
    tables = np.asarray(inputs["block_tables"])
    capacity = tables.shape[1] * cache.block_size
    positions = np.arange(capacity)
    blocks = np.clip(tables[:, positions // cache.block_size], 0, cache.num_blocks - 1)       # [B, capacity]
    slots = jnp.asarray((blocks * cache.block_size + positions % cache.block_size).reshape(-1), jnp.int32)
    table_keys, table_values = (np.asarray(x[layer], np.float64).reshape(b, capacity, cache.num_kv_heads, d)
                                for x in scv_jax.gather_kv(cache, slots))
    host = {k: stored(cache, inputs[k], "k" if k.endswith("keys") else "v")
            for k in ("staged_keys", "staged_values", "new_keys", "new_values") if k in inputs}
    sinks = np.asarray(inputs["sinks"], np.float64) if inputs.get("sinks") is not None else None
    out = np.zeros(q.shape)
    for r in range(b):
        context = int(np.clip(inputs["context_lens"][r], 0, capacity))
        keys, values = table_keys[r, :context], table_values[r, :context]
        if "staged_keys" in host:
            staged = int(np.clip(inputs["staged_lens"][r], 0, host["staged_keys"].shape[2]))
            keys = np.concatenate([keys, host["staged_keys"][layer, r, :staged]])
            values = np.concatenate([values, host["staged_values"][layer, r, :staged]])
        keys = np.concatenate([keys, host["new_keys"][r]])
        values = np.concatenate([values, host["new_values"][r]])
        window = inputs.get("sliding_window") or len(keys)
        for i in range(t):
            end = len(keys) - t + i + 1            # key index == position: query i is at position end - 1
            start = max(0, end - window)
            for h in range(heads):
                scores = keys[start:end, h // group] @ q[r, i, h] * d ** -0.5
                top = scores.max() if sinks is None else max(scores.max(), sinks[h])
                p = np.exp(scores - top)
                total = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
                out[r, i, h] = (p / total) @ values[start:end, h // group]
    return out


def tolerance(case: Case, backend: str) -> dict:
    """assert_allclose bounds: the rounding of a bf16/f16 output plus the kernel's bf16 P and Q K^T
    operands (float32 and float16 inputs run hi/lo-split products; fp8 is exact in bf16)."""
    if case.q_dtype == "bfloat16":
        return dict(atol=2e-2, rtol=8e-3) if backend == "xla" else dict(atol=3e-2, rtol=1e-2)
    if case.q_dtype == "float16" or (backend != "xla" and case.cache_dtype != "float32"
                                     and case.cache_dtype not in FP8 and case.q_dtype != "float32"):
        return dict(atol=4e-3, rtol=1e-3)
    return dict(atol=1e-4, rtol=1e-4)


def check(case: Case, backend: str, **overrides) -> np.ndarray:
    inputs = {**make_inputs(case), **overrides}
    got = scv_jax.paged_attention(**inputs, backend=backend)
    assert got.shape == inputs["q"].shape and got.dtype == inputs["q"].dtype
    got = np.asarray(got, np.float64)
    want = oracle(inputs)
    np.testing.assert_allclose(got, want, **tolerance(case, backend), err_msg=str(case))
    return got


@st.composite
def cases(draw, kernel: bool = False) -> Case:
    cache_dtype = draw(st.sampled_from(CACHE_DTYPES))
    block_size = draw(st.sampled_from([8, 16, 32] + ([64] if kernel else [])))
    return Case(
        layout=draw(st.sampled_from(["NHD", "HND"])), cache_dtype=cache_dtype,
        scale_mode=draw(st.sampled_from([None, "tensor", "head", "token_head"])) if cache_dtype in FP8 else None,
        block_size=block_size, kv_heads=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 4, 8])),
        head_dim=draw(st.sampled_from([64, 128] if kernel else [32, 64, 80, 128])),
        batch=draw(st.integers(1, 3)), tokens=draw(st.integers(1, 9)),
        staged=draw(st.sampled_from([None, 0, 1, 4, 8])), max_blocks=draw(st.integers(0, 128 // block_size)),
        q_dtype=draw(st.sampled_from(["bfloat16", "float32", "float16"])),
        window=draw(st.sampled_from([None, None, 1, 5, 40])), sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)))


@settings(max_examples=12)
@given(case=cases())
@pytest.mark.slow
def test_xla_matches_oracle(case):
    check(case, "xla")


@settings(max_examples=4)
@given(case=cases())
def test_xla_with_sinks_matches_oracle(case):
    """Attention sinks (gpt-oss): one more logit per head in each softmax, zero value, any shape."""
    check(dataclasses.replace(case, sinks=True), "xla")


def test_bad_sinks_are_named():
    inputs = make_inputs(Case(sinks=True))
    with pytest.raises(ValueError, match="sinks must be \\[heads\\]"):
        scv_jax.paged_attention(**{**inputs, "sinks": jnp.zeros(3)}, backend="xla")


@settings(max_examples=4)
@given(case=cases(), chunk_blocks=st.integers(1, 3))
def test_reference_chunking_is_exact(case, chunk_blocks):
    """Several chunks per table (and a partial last chunk) give the one-chunk result."""
    inputs = make_inputs(case)
    layer = inputs["layer"]
    staged = [inputs[k][layer] if k in inputs else None for k in ("staged_keys", "staged_values")]
    args = (inputs["q"], inputs["cache"], layer, inputs["block_tables"], inputs["context_lens"], *staged,
            inputs.get("staged_lens"), inputs["new_keys"], inputs["new_values"])
    chunked = paged_attention_reference(*args, sliding_window=case.window, chunk_tokens=chunk_blocks * case.block_size)
    whole = paged_attention_reference(*args, sliding_window=case.window)
    np.testing.assert_allclose(np.asarray(chunked, np.float32), np.asarray(whole, np.float32),
                               **tolerance(case, "xla"))


# ------------------------------------------------------------------------------------------- the kernel


def kernel_supports(case: Case) -> bool:
    from pallas_kernels.paged_attention import unsupported_reason
    inputs = make_inputs(case)
    extra = tuple(np.dtype(inputs[k].dtype) for k in ("staged_keys", "staged_values", "new_keys", "new_values")
                  if k in inputs)
    return not unsupported_reason(head_dim=case.head_dim, block_size=case.block_size, layout=case.layout,
                                  scale_mode=case.scale_mode, cache_dtype=np.dtype(case.cache_dtype),
                                  q_dtype=np.dtype(case.q_dtype), extra_dtypes=extra, kv_heads=case.kv_heads)


@with_kernel
@settings(max_examples=5)   # interpret mode compiles a simulator per shape (~3-6 s on 2 cores)
@given(case=cases(kernel=True))
@pytest.mark.slow
def test_kernel_matches_oracle_random(backend, case):
    if kernel_supports(case):
        check(case, backend)


# Hand-picked: every layout, cache dtype and scale mode, G 1/4/8, head_dim 64/128, block sizes 8..128,
# T 1/5/9 (T * G = 72 takes two row blocks), staged 0..k, no staging buffer, float32 (hi/lo products),
# attention sinks (merged with the partials).
KERNEL_CASES = [
    Case("NHD", "bfloat16", None, 16, 2, 4, 128, tokens=5, staged=4),
    Case("HND", "bfloat16", None, 32, 1, 8, 64, tokens=9, staged=8, max_blocks=3, sinks=True),
    Case("NHD", "float8_e4m3fn", "token_head", 16, 2, 1, 64, tokens=1, staged=None),
    Case("HND", "float8_e5m2", "head", 8, 2, 4, 64, tokens=9, staged=1, max_blocks=9),
    Case("NHD", "float8_e4m3fn", "tensor", 64, 1, 4, 128, tokens=3, staged=0, max_blocks=2, q_dtype="float32"),
    Case("HND", "float16", None, 128, 2, 2, 64, tokens=2, staged=3, max_blocks=1),
    Case("NHD", "float32", None, 16, 1, 4, 64, tokens=4, staged=2, q_dtype="float32"),
    Case("HND", "float8_e4m3fn", "token_head", 16, 2, 4, 64, tokens=5, staged=4, max_blocks=9, window=70),
    Case("NHD", "bfloat16", None, 8, 1, 8, 64, tokens=9, staged=3, max_blocks=12, window=6, sinks=True),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c.layout}-{c.cache_dtype}-{c.scale_mode}-"
                         f"b{c.block_size}g{c.group}d{c.head_dim}t{c.tokens}w{c.window}-{c.q_dtype}"
                         + ("-sinks" if c.sinks else ""))
@with_kernel
def test_kernel_cases(backend, case):
    assert kernel_supports(case)
    check(case, backend)


@with_kernel
def test_kernel_split_k_matches_oracle(backend):
    """Split-K partials (including empty splits of short requests) combine to the one-split result, with
    and without attention sinks (the kernel itself takes in-flight K/V as they are: the op rounds them
    first, ``in_flight_kv``)."""
    from pallas_kernels.paged_attention import paged_attention_kernel
    for window, sinks in ((None, False), (100, True)):
        case = Case("NHD", "float8_e4m3fn", "token_head", 16, 1, 4, 64, batch=2, tokens=2, staged=2, max_blocks=12,
                    q_dtype="float32", window=window, sinks=sinks)
        inputs = make_inputs(case)
        cache, layer = inputs["cache"], inputs["layer"]
        staged_keys, staged_values, new_keys, new_values = in_flight_kv(
            cache, inputs["staged_keys"][layer], inputs["staged_values"][layer], inputs["new_keys"], inputs["new_values"])
        args = (inputs["q"], cache.k_pages, cache.v_pages, cache.k_scale, cache.v_scale, jnp.int32(layer),
                inputs["block_tables"], inputs["context_lens"], staged_keys, staged_values, inputs["staged_lens"],
                new_keys, new_values)
        split = paged_attention_kernel(*args, layout=case.layout, scale_mode=case.scale_mode, sliding_window=window,
                                       sinks=inputs.get("sinks"), num_splits=3, interpret=backend == "interpret")
        np.testing.assert_allclose(np.asarray(split), oracle(inputs), atol=1e-4)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # masked inf scores (interpret)
@pytest.mark.parametrize("backend", ["xla", KERNEL])
def test_stale_non_finite_bytes_past_the_context_stay_out(backend):
    """Unused rows of partly filled pages may hold anything (here NaN/inf): outputs stay finite."""
    for case in (Case("NHD", "bfloat16", block_size=32, max_blocks=3),
                 Case("HND", "float8_e4m3fn", "head", block_size=16, max_blocks=5)):
        inputs = make_inputs(case)
        cache = inputs["cache"]
        tables, context = np.asarray(inputs["block_tables"]), np.asarray(inputs["context_lens"])
        poisoned = {n: np.asarray(getattr(cache, n)).copy() for n in ("k_pages", "v_pages")}
        for r in range(case.batch):
            for position in range(context[r], case.max_blocks * case.block_size):
                block = tables[r, position // case.block_size]
                if block < 0:
                    continue
                index = (slice(None), block, position % case.block_size)
                if case.layout == "HND":
                    index = (slice(None), block, slice(None), position % case.block_size)
                for pages in poisoned.values():
                    pages[index] = np.inf if case.cache_dtype == "bfloat16" else np.nan
        inputs["cache"] = cache.replace(**{n: jnp.asarray(p) for n, p in poisoned.items()})
        got = np.asarray(scv_jax.paged_attention(**inputs, backend=backend), np.float64)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, oracle(inputs), **tolerance(case, backend))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # masked inf scores (interpret)
@pytest.mark.parametrize("backend", ["xla", KERNEL])
def test_blocks_before_every_window_may_hold_anything(backend):
    """With a sliding window, a request's blocks wholly before its first query's window (the engine gives
    them back to the pool: ``RequestBatch.release_behind``) may point at any block holding anything (here
    one NaN/inf block no request uses): the output is the one over the original table."""
    case = Case("NHD", "bfloat16", None, 16, 2, 4, 64, batch=3, tokens=3, staged=2, max_blocks=6, window=20, seed=3)
    inputs = make_inputs(case)
    cache = inputs["cache"]
    tables, context = np.asarray(inputs["block_tables"]), np.asarray(inputs["context_lens"])
    first_query = context + np.asarray(inputs["staged_lens"])
    dead = np.arange(case.max_blocks)[None] < ((first_query - case.window + 1) // case.block_size)[:, None]
    assert dead.sum() >= 4
    spare = int(np.setdiff1d(np.arange(case.num_blocks), tables)[0])        # a block in no table
    poisoned = {n: np.asarray(getattr(cache, n)).copy() for n in ("k_pages", "v_pages")}
    for pages in poisoned.values():
        pages[:, spare] = np.inf
        pages[:, spare, ::2] = np.nan
    moved = {**inputs, "cache": cache.replace(**{n: jnp.asarray(p) for n, p in poisoned.items()}),
             "block_tables": jnp.asarray(np.where(dead, spare, tables), jnp.int32)}
    got = np.asarray(scv_jax.paged_attention(**moved, backend=backend), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, oracle(inputs), **tolerance(case, backend))


@pytest.mark.parametrize("backend", ["xla", KERNEL])
def test_bad_data_is_clamped_and_finite(backend):
    """Block ids outside the cache, negative and oversized lengths, -1 tables: clamped, never NaN."""
    case = Case("HND", "float8_e5m2", "token_head", 16, 2, 2, 64, batch=3, tokens=2, staged=3, max_blocks=2)
    inputs = make_inputs(case)
    bad = dict(block_tables=jnp.array([[-1, -5], [10**6, 3], [2, -1]], jnp.int32),
               context_lens=jnp.array([-7, 10**6, 20], jnp.int32), staged_lens=jnp.array([9, -2, 3], jnp.int32))
    got = np.asarray(scv_jax.paged_attention(**{**inputs, **bad}, backend=backend), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, oracle({**inputs, **bad}), **tolerance(case, backend))


@pytest.mark.parametrize("backend", ["xla", KERNEL])
def test_padded_request_attends_to_itself(backend):
    """Context 0, no staged entries, one token: the output is the token's own value as the (bf16) cache
    will hold it, for every head."""
    case = Case(batch=1, tokens=1, staged=None, q_dtype="float32")
    inputs = make_inputs(case)
    got = scv_jax.paged_attention(**inputs, backend=backend)
    want = np.repeat(stored(inputs["cache"], inputs["new_values"], "v"), case.group, axis=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", KERNEL])
def test_traced_layer_under_scan(backend):
    """The layer index may be traced (layers under lax.scan); each step equals the static-layer call."""
    case = Case("NHD", "float8_e4m3fn", "tensor", tokens=2, q_dtype="float32", num_layers=3)
    inputs = make_inputs(case)

    def step(_, layer):
        return None, scv_jax.paged_attention(**{**inputs, "layer": layer}, backend=backend)
    _, scanned = jax.jit(lambda: jax.lax.scan(step, None, jnp.arange(3)))()
    for layer in range(3):
        want = scv_jax.paged_attention(**{**inputs, "layer": layer}, backend=backend)
        np.testing.assert_allclose(np.asarray(scanned[layer]), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", KERNEL])
def test_query_output_does_not_depend_on_where_earlier_keys_live(backend):
    """Verification == autoregressive decoding: query t of a T-token call equals a 1-token call in which
    new tokens 0..t-1 were appended to the staging buffer instead (float32: to ~1e-5)."""
    case = Case("HND", "bfloat16", None, 16, 2, 4, 64, batch=2, tokens=4, staged=3, q_dtype="float32")
    inputs = make_inputs(case)
    layer, t = inputs["layer"], case.tokens - 1
    full = np.asarray(scv_jax.paged_attention(**inputs, backend=backend))
    staged_lens = np.asarray(inputs["staged_lens"])
    staged = {n: np.zeros((case.num_layers, case.batch, case.staged + t, case.kv_heads, case.head_dim), np.float32)
              for n in ("keys", "values")}
    for r in range(case.batch):
        for n in ("keys", "values"):
            staged[n][:, r, :staged_lens[r]] = np.asarray(inputs[f"staged_{n}"])[:, r, :staged_lens[r]]
            staged[n][layer, r, staged_lens[r]:staged_lens[r] + t] = np.asarray(inputs[f"new_{n}"])[r, :t]
    one = scv_jax.paged_attention(
        **{**inputs, "q": inputs["q"][:, t:t + 1], "new_keys": inputs["new_keys"][:, t:t + 1],
           "new_values": inputs["new_values"][:, t:t + 1], "staged_keys": jnp.asarray(staged["keys"]),
           "staged_values": jnp.asarray(staged["values"]), "staged_lens": jnp.asarray(staged_lens + t)},
        backend=backend)
    np.testing.assert_allclose(np.asarray(one)[:, 0], full[:, t], atol=3e-5, rtol=1e-5)


def _lowered_kernel_text(case: Case) -> tuple[str, PagedKVCache]:
    inputs = make_inputs(case)
    layer = jnp.int32(inputs["layer"])
    staged = [inputs[k][layer] if k in inputs else None for k in ("staged_keys", "staged_values")]
    kernel = registry.implementation("paged_attention", "pallas")
    fn = functools.partial(kernel.run, sliding_window=case.window, interpret=False)
    args = (inputs["q"], inputs["cache"], layer, inputs["block_tables"], inputs["context_lens"], *staged,
            inputs.get("staged_lens"), inputs["new_keys"], inputs["new_values"])
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(), inputs["cache"]


@pytest.mark.parametrize("case", [
    Case("NHD", "bfloat16", None, 16, 8, 4, 128, batch=2, tokens=1, staged=None),
    Case("NHD", "bfloat16", None, 16, 8, 4, 128, batch=2, tokens=5, staged=4),
    Case("HND", "float8_e4m3fn", "token_head", 16, 8, 4, 128, batch=2, tokens=9, staged=8),
    Case("HND", "float8_e4m3fn", "token_head", 32, 2, 8, 64, batch=2, tokens=5, staged=4),
    Case("NHD", "float8_e5m2", "tensor", 64, 4, 8, 64, batch=2, tokens=9, staged=0),
    Case("NHD", "float32", None, 16, 2, 4, 128, batch=2, tokens=5, staged=4, q_dtype="float32"),
    Case("NHD", "bfloat16", None, 16, 8, 4, 128, batch=2, tokens=9, staged=8, window=4096),
], ids=lambda c: f"{c.layout}-{c.cache_dtype}-{c.scale_mode}-d{c.head_dim}-t{c.tokens}-w{c.window}")
def test_kernel_lowers_for_cuda(case):
    text, cache = _lowered_kernel_text(case)
    assert "mosaic_gpu" in text
    # The kernel reads the whole [layers, ...] page arrays: no per-layer slice of the cache is made.
    pages_type = "x".join(map(str, cache.k_pages.shape))
    calls = [line for line in text.splitlines() if "mosaic_gpu" in line and "custom_call" in line]
    assert calls and all(f"tensor<{pages_type}x" in line for line in calls), calls
    assert not re.search(rf"dynamic_slice.*tensor<1x{'x'.join(map(str, cache.k_pages.shape[1:]))}x", text)


# ------------------------------------------------------------------------------------------- dispatch


def test_auto_uses_the_reference_without_a_gpu_and_unsupported_shapes():
    case = Case(head_dim=80, staged=None)       # head_dim 80: no 128-byte swizzle, XLA only
    assert not kernel_supports(case)
    check(case, "auto")
    with pytest.raises(ValueError, match="head_dim must be 64, 128, 192 or 256"):
        scv_jax.paged_attention(**make_inputs(case), backend="interpret")


@pytest.mark.skipif(cuda_available(), reason="checks the error raised without a GPU")
def test_pallas_backend_needs_a_gpu():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        scv_jax.paged_attention(**make_inputs(Case()), backend="pallas")


def test_empty_batch_and_tokens():
    inputs = make_inputs(Case(batch=1, tokens=1))
    for b, t in ((0, 1), (1, 0)):
        empty = dict(inputs, q=jnp.zeros((b, t, 4, 64), jnp.bfloat16), block_tables=jnp.zeros((b, 4), jnp.int32),
                     context_lens=jnp.zeros((b,), jnp.int32), new_keys=jnp.zeros((b, t, 2, 64), jnp.bfloat16),
                     new_values=jnp.zeros((b, t, 2, 64), jnp.bfloat16), staged_keys=jnp.zeros((2, b, 2, 2, 64)),
                     staged_values=jnp.zeros((2, b, 2, 2, 64)), staged_lens=jnp.zeros((b,), jnp.int32))
        assert scv_jax.paged_attention(**empty).shape == (b, t, 4, 64)


@pytest.mark.parametrize("change, error, match", [
    (dict(q=jnp.zeros((2, 3, 4), jnp.float32)), ValueError, "q must be"),
    (dict(q=jnp.zeros((3, 3, 4, 32), jnp.float32)), ValueError, "q must be"),
    (dict(q=jnp.zeros((3, 3, 3, 64), jnp.float32)), ValueError, "q's heads"),
    (dict(q=jnp.zeros((3, 3, 4, 64), jnp.int32)), TypeError, "q must be"),
    (dict(layer=2), ValueError, "layer must be in"),
    (dict(layer=1.0), TypeError, "layer must be"),
    (dict(block_tables=jnp.zeros((3,), jnp.int32)), ValueError, "block_tables must be"),
    (dict(block_tables=jnp.zeros((3, 4), jnp.float32)), TypeError, "block_tables must be"),
    (dict(block_tables=jnp.zeros((2, 4), jnp.int32)), ValueError, "block_tables must be"),
    (dict(context_lens=jnp.zeros((2,), jnp.int32)), ValueError, "context_lens must be"),
    (dict(new_keys=jnp.zeros((3, 2, 2, 64), jnp.bfloat16)), ValueError, "new_keys must be"),
    (dict(new_values=jnp.zeros((3, 3, 1, 64), jnp.bfloat16)), ValueError, "new_values must be"),
    (dict(staged_lens=None), ValueError, "must be given together"),
    (dict(staged_keys=jnp.zeros((1, 3, 2, 2, 64))), ValueError, "staged_keys must be"),
    (dict(staged_values=jnp.zeros((2, 3, 3, 2, 64))), ValueError, "staged_values must be"),
    (dict(staged_lens=jnp.zeros((3,), jnp.float32)), TypeError, "staged_lens must be"),
    (dict(cache=None), TypeError, "cache must be"),
    (dict(sliding_window=0), ValueError, "sliding_window must be"),
    (dict(staged_keys=jnp.zeros((3, 2, 2, 32))), ValueError, "staged_keys must be"),
    (dict(backend="cuda"), ValueError, "backend must be"),
])
def test_bad_static_inputs_raise_naming_the_argument(change, error, match):
    inputs = make_inputs(Case())
    with pytest.raises(error, match=match):
        scv_jax.paged_attention(**{"backend": "xla", **inputs, **change})


# ------------------------------------------------------------------------------------------- staged K/V


@pytest.mark.parametrize("backend", ["xla", KERNEL])
def test_staged_kv_of_all_layers_or_of_this_layer(backend):
    """``[layers, B, S, ...]`` staged K/V with a (traced) layer index equal this layer's ``[B, S, ...]``."""
    inputs = make_inputs(Case("NHD", "float8_e4m3fn", "head", tokens=2, staged=3, q_dtype="float32"))
    layer = inputs["layer"]
    one_layer = dict(inputs, staged_keys=inputs["staged_keys"][layer], staged_values=inputs["staged_values"][layer])
    np.testing.assert_array_equal(np.asarray(scv_jax.paged_attention(**inputs, backend=backend)),
                                  np.asarray(scv_jax.paged_attention(**one_layer, backend=backend)))


@with_kernel
def test_kernel_error_for_bfloat16_inputs_is_a_few_bf16_ulps(backend):
    """bf16 model, fp8 cache: the kernel's bf16 P costs at most a few bf16 ulps over the reference."""
    case = Case("NHD", "float8_e4m3fn", "head", 16, 2, 4, 64, batch=2, tokens=5, staged=4, max_blocks=3)
    inputs = make_inputs(case)
    got = np.asarray(scv_jax.paged_attention(**inputs, backend=backend), np.float32)
    want = np.asarray(scv_jax.paged_attention(**inputs, backend="xla"), np.float32)
    ulp = np.abs(want).max() * 2.0 ** -8
    assert np.abs(got - want).max() <= 4 * ulp


@pytest.mark.parametrize("backend, cache_dtype, scale_mode", [
    *[("xla", dtype, mode) for dtype in FP8 for mode in (None, "tensor", "head", "token_head")],
    (KERNEL, "float8_e4m3fn", "token_head"), (KERNEL, "float8_e5m2", "tensor")])
@pytest.mark.slow
def test_in_flight_tokens_read_as_after_their_commit(backend, cache_dtype, scale_mode):
    """fp8 verification == autoregressive decoding: query t of a call with staged entries and T new tokens
    equals a 1-token call after the staged entries and new tokens 0..t-1 were committed to the cache
    (float32: to ~1e-5; reading in-flight K/V unrounded is off by ~1e-2)."""
    case = Case("NHD", cache_dtype, scale_mode, 16, 2, 2, 64, batch=2, tokens=4, staged=2, max_blocks=3,
                q_dtype="float32")
    inputs = make_inputs(case)
    cache, layer = inputs["cache"], inputs["layer"]
    context = jnp.asarray([5, 20], jnp.int32)                   # room for the staged and new tokens
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    staged_lens = jnp.asarray([2, 1], jnp.int32)
    inputs.update(block_tables=tables, context_lens=context, staged_lens=staged_lens)
    full = np.asarray(scv_jax.paged_attention(**inputs, backend=backend))
    rng = np.random.default_rng(1)
    other = lambda: jnp.asarray(rng.standard_normal((case.num_layers, case.batch, case.tokens, case.kv_heads,  # noqa: E731
                                                      case.head_dim)), jnp.float32)
    new = {n: other().at[layer].set(inputs[f"new_{n}"]) for n in ("keys", "values")}   # all layers' new K/V
    for t in range(case.tokens):
        rows = {n: jnp.concatenate([inputs[f"staged_{n}"], new[n][:, :, :t]], axis=2) for n in ("keys", "values")}
        count = staged_lens + t
        valid = jnp.arange(rows["keys"].shape[2])[None] < staged_lens[:, None]
        valid |= jnp.arange(rows["keys"].shape[2])[None] >= case.staged   # new tokens < t
        positions = jnp.where(valid, context[:, None] + jnp.cumsum(valid, axis=1) - 1, -1)
        slots = scv_jax.slots_from_block_table(tables, positions, case.block_size).reshape(-1)
        flat = {n: x.reshape(case.num_layers, -1, case.kv_heads, case.head_dim) for n, x in rows.items()}
        committed = scv_jax.commit_draft_kv(cache, flat["keys"], flat["values"], slots, backend="xla")
        one = scv_jax.paged_attention(
            q=inputs["q"][:, t:t + 1], cache=committed, layer=layer, block_tables=tables, context_lens=context + count,
            new_keys=inputs["new_keys"][:, t:t + 1], new_values=inputs["new_values"][:, t:t + 1], backend=backend)
        np.testing.assert_allclose(np.asarray(one)[:, 0], full[:, t], atol=3e-5, rtol=1e-5)
