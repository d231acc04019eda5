"""Mosaic GPU kernel: verification attention over a paged KV cache, a staging buffer and the new tokens.

Semantics (``paged_attention_kernel``): query t of request b (at position ``context_lens[b] +
staged_lens[b] + t``) attends to the cache positions < ``context_lens[b]`` (read through
``block_tables[b]``), the staged entries < ``staged_lens[b]`` and the new tokens <= t, and with a
sliding window W only to keys at positions > its own - W; scores are scaled by ``head_dim ** -0.5``;
query head h reads kv head ``h // (heads // kv_heads)``.

Design (Hopper, tensor cores, one warpgroup per CTA):
  * **Rows.** The G = heads / kv_heads query heads of one kv head and the T query tokens form the rows
    of one CTA: row r = t * G + j holds query head ``kv_head * G + j`` of token t, so the K/V of a kv
    head are read once for all its query heads (GQA). A wgmma has 64 rows: T * G <= 64 (T = 9 at
    G = 4, T = 8 at G = 8) is one row block; larger T * G (chunked prefill, T = 9 at G = 8) takes
    several row blocks, each reading the K/V again (mostly from L2).
  * **Grid** ``(kv_heads * row_blocks, splits, B)``: CTA (h, s, b) owns row block h % row_blocks of
    kv head h // row_blocks of request b and split s of its context. The split-K factor is static,
    chosen from the shapes so that about ``TARGET_CTAS`` CTAs run (B = 1, 8 kv heads, a 32k table:
    33 splits; B = 64: 1), each split covering at least ``MIN_TILES_PER_SPLIT`` 64-position tiles.
    Each split runs its own online softmax over its tiles that lie inside the context (a short
    request's later splits exit at once) and writes an unnormalised partial (acc, m, l).
  * **Fetching.** A tile is 64 consecutive context positions: 64 / block_size whole pages (block size
    <= 64) or a 64-row slice of one page. Each page slice is one TMA copy ``[rows, head_dim]`` straight
    from the whole ``[layers, blocks, ...]`` page array at (layer, block_tables[b, page], kv head)
    (NHD rows are strided by kv_heads * head_dim, HND rows are contiguous); the layer index is a
    kernel operand, so no per-layer slice of the cache is ever materialised. Tiles stream through a
    ring of ``stages`` SMEM slots (one barrier each) prefetched ``stages`` tiles ahead; ``stages`` is
    the deepest ring that still lets two CTAs share an SM. Block ids are clamped into the page array
    and pages past the context repeat the request's last page, so bad tables never read out of
    bounds and the partial last tile costs no extra DRAM traffic.
  * **Tensor cores.** S = Q K^T and O += P V are wgmma with bf16 operands in 128-byte swizzled SMEM
    and float32 accumulation. bf16 caches are TMA'd straight into wgmma-ready slots. Other cache
    dtypes are TMA'd raw and converted in registers (to float32, times the tensor, head or per-token
    scale; per-token scales are one scalar load per row) into bf16 operand buffers; unscaled fp8
    values are exact in bf16. Operands that are not exact in bf16 when the call involves float16 or
    float32 (q, the cache, staged or new K/V) are split into bf16 hi + lo parts and a product takes
    three wgmma (hi.hi + hi.lo + lo.hi, ~16 significant bits), P included, so a float32 model gets
    float32-grade attention (~1e-5); a bf16 model pays one wgmma per product and a bf16 P, as
    FlashAttention does.
  * **Softmax.** Online softmax in base 2 with a finite -1e30 floor: masked scores (positions >=
    context, staged entries >= staged length, new tokens after the query, keys before the sliding
    window; tiles wholly before the earliest query's window are not read) get probability 0, so the
    rows of an empty split stay (acc 0, l 0, m -1e30) and never produce NaN. V rows past the context
    are zeroed before the PV product, so stale non-finite bytes in a partly used page stay out.
  * **Staged and new K/V.** They arrive already rounded as the cache will hold them (the caller's
    job: ``scv_jax.paged_attention`` rounds them in one XLA fusion before the launch). The wrapper packs the valid staged entries (zeros past ``staged_lens``)
    and the new tokens of each (request, kv head) into bf16 tiles ``[B, kv_heads, terms, E, head_dim]``,
    E = S + T rounded up to 64 (one small XLA fusion, as is the packing of Q into row blocks). The last
    split of each (request, kv head, row block) attends to them after its pages, with the causal mask
    new token n <= query token t, i.e. n * G <= r.
  * **Trees.** With ``tree_bits`` (a tree over the new tokens) the causal mask of the new tokens is
    instead bit n of query token t's ancestor bitmask (int32 words, ``tree_mask.ancestor_bits``): the
    last split loads each row's words once (one scalar load per row and word) into row vectors in the
    wgmma row layout and tests the bit with a shift per score. Cache and staged tiles are unchanged;
    the chain (no ``tree_bits``) compiles exactly as before. Not with a sliding window (there the key
    offsets would be depths). To do once timed: TMA the words instead of scalar loads.
  * **Combine.** One XLA fusion merges the splits' partials (max of m, exp2-weighted sums of l and
    acc), divides and unpacks the rows to ``[B, T, heads, head_dim]`` in q's dtype. Attention sinks
    (gpt-oss: one more logit per query head, of value zero) join there: the sink is one more term of
    the max and of the denominator, and adds nothing to acc, so the kernel body never sees them. The
    partials hold only the real rows (T * G rounded up to 8), staged through SMEM and written with one
    TMA copy, so they stay small next to the K/V read.

Supported (``unsupported_reason``): head_dim 64, 128, 192 or 256 (rows of 128-byte multiples; Mosaic
GPU's layout inference rejects 80 and 96 in jax 0.12, which then run on XLA), block sizes 8, 16, 32
or multiples of 64, any G and T, every layout, cache dtype and scale mode within the SMEM budget
(float32 caches with head_dim 256 do not fit).

To do once timed on an H200 (timings are open): warp specialisation (a producer warpgroup issuing
the TMA copies, two consumer warpgroups splitting the tiles), tuning ``stages``, the tile width and
``TARGET_CTAS``; accumulating P V in place in one wgmma accumulator (today the running acc and the
tile's P V are both live, which Mosaic's interpret mode needs; at head_dim 256 that spills
registers); swapping A and B (keys as the wgmma M dimension) when T * G <= 16, to cut padded-row
MMA work; TMA'd token-head scale rows instead of scalar loads; a normalised direct output (no
combine fusion) when a launch has one split.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import keep_rounding
from pallas_kernels.platform import interpret_params

ROWS = 64                 # query rows per CTA: the M of one warpgroup's wgmma
TILE = 64                 # context positions per tile (the N of S = Q K^T, the K of P V)
TARGET_CTAS = 2 * 132     # about two CTAs per SM of an H100/H200
MIN_TILES_PER_SPLIT = 4   # a split reads at least 256 positions (amortises its prologue and partial)
SMEM_BUDGET = 220 * 1024  # of the 227 KiB a Hopper CTA may use
SHARED_SMEM_BUDGET = 112 * 1024   # per CTA when two CTAs share an SM's 228 KiB
MAX_STAGES = 3
NEG = -1e30               # finite floor of the running max (keeps empty rows NaN-free)
LOG2E = math.log2(math.e)
BF16 = np.dtype(jnp.bfloat16)
EXACT_IN_BF16 = (BF16, np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def bf16_terms(dtype, precise: bool) -> int:
    """bf16 parts an operand of ``dtype`` is split into: 1 when exact in bf16 or not ``precise``, else 2."""
    return 1 if np.dtype(dtype) in EXACT_IN_BF16 or not precise else 2


def bf16_parts(x: jax.Array, terms: int) -> list[jax.Array]:
    """``x`` as ``terms`` bf16 parts: [hi] or [hi, lo] with hi = bf16(x), lo = bf16(x - hi) in float32
    (hi behind ``fp8.keep_rounding``: XLA:GPU would otherwise fold x - float32(hi) to 0)."""
    x = x.astype(jnp.float32)
    if terms == 1:
        return [x.astype(jnp.bfloat16)]
    hi = keep_rounding(x.astype(jnp.bfloat16))
    return [hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)]


def _swizzled(dtype, minor: int) -> tuple:
    """SMEM transforms of a wgmma operand whose rows hold ``minor`` elements of ``dtype``."""
    bits = np.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static facts of one launch (hashable)."""

    layout: str
    scale_mode: str | None
    cache_dtype: np.dtype
    num_layers: int
    num_blocks: int
    block_size: int
    max_blocks: int
    kv_heads: int
    group: int
    head_dim: int
    tokens: int
    staged_capacity: int
    q_terms: int
    cache_terms: int      # bf16 parts of a dequantised cache tile (0: bf16 cache, TMA'd straight in)
    extra_terms: int      # bf16 parts of the packed staged + new K/V
    p_terms: int
    stages: int
    splits: int
    tiles_per_split: int
    sliding_window: int | None
    tree_words: int = 0   # int32 ancestor-bitmask words per query token (0: the chain, causal mask)

    @property
    def direct(self) -> bool:
        return self.cache_terms == 0

    @property
    def rows(self) -> int:
        return self.tokens * self.group

    @property
    def row_blocks(self) -> int:
        return -(-self.rows // ROWS)

    @property
    def rows_out(self) -> int:
        """Rows of a row block in the partial output: all 64, or the real rows rounded up to 8."""
        return ROWS if self.row_blocks > 1 else -(-self.rows // 8) * 8

    @property
    def chunk(self) -> int:
        """Rows of one TMA copy: a whole page, or a 64-row slice of a larger one."""
        return min(self.block_size, TILE)

    @property
    def copies_per_tile(self) -> int:
        return TILE // self.chunk

    @property
    def extra_tiles(self) -> int:
        return -(-(self.staged_capacity + self.tokens) // TILE)

    @property
    def operand_terms(self) -> int:
        """bf16 operand buffers per K and per V (dequantised cache tiles and packed staged/new tiles)."""
        return 0 if self.direct else max(self.cache_terms, self.extra_terms)

    def smem_bytes(self) -> int:
        d = self.head_dim
        ring = 2 * self.stages * TILE * d * self.cache_dtype.itemsize
        operands = 2 * self.operand_terms * TILE * d * 2
        main = ring + operands + self.q_terms * ROWS * d * 2 + self.p_terms * ROWS * TILE * 2
        return max(main, ROWS * d * 4)   # the float32 output staging buffer reuses the main loop's


def precise_products(q_dtype, cache_dtype, extra_dtypes: tuple) -> bool:
    """Whether a launch splits its operands into bf16 hi + lo parts: when q, the cache or the staged
    or new K/V are float16 or float32 (otherwise every operand is bf16, or fp8 dequantised to bf16)."""
    return any(np.dtype(d).itemsize > 2 or np.dtype(d) == np.dtype(jnp.float16)
               for d in (q_dtype, cache_dtype, *extra_dtypes))


def make_plan(*, layout: str, scale_mode: str | None, cache_dtype, num_layers: int, num_blocks: int,
              block_size: int, max_blocks: int, batch: int, kv_heads: int, group: int, head_dim: int,
              tokens: int, staged_capacity: int, q_dtype, extra_dtypes: tuple,
              sliding_window: int | None = None, num_splits: int | None = None, tree_words: int = 0) -> Plan:
    """The launch plan for these static facts (see the module docstring); ``num_splits`` overrides the
    split-K factor (clamped to the number of tiles); ``tree_words`` > 0: a tree mask over the new tokens."""
    cache_dtype = np.dtype(cache_dtype)
    precise = precise_products(q_dtype, cache_dtype, extra_dtypes)
    q_terms = bf16_terms(q_dtype, precise)
    if cache_dtype == BF16:
        cache_terms = 0
    else:   # a scaled fp8 value is not exact in bf16
        cache_terms = 2 if precise and (scale_mode is not None or cache_dtype not in EXACT_IN_BF16) else 1
    extra_terms = max(bf16_terms(d, precise) for d in extra_dtypes)
    p_terms = 2 if precise else 1
    row_blocks = -(-tokens * group // ROWS)
    total_tiles = -(-max_blocks * block_size // TILE)
    wanted = -(-TARGET_CTAS // max(batch * kv_heads * row_blocks, 1))
    splits = max(1, min(num_splits or wanted, -(-total_tiles // (1 if num_splits else MIN_TILES_PER_SPLIT))))
    tiles_per_split = -(-total_tiles // splits)
    splits = max(1, -(-total_tiles // max(tiles_per_split, 1)))
    # Direct (bf16) caches take the packed staged/new parts into ring slots, one slot per part.
    min_stages = extra_terms if cache_terms == 0 else 1
    plans = [Plan(layout, scale_mode, cache_dtype, num_layers, num_blocks, block_size, max_blocks, kv_heads, group,
                  head_dim, tokens, staged_capacity, q_terms, cache_terms, extra_terms, p_terms, stages, splits,
                  tiles_per_split, sliding_window, tree_words)
             for stages in range(MAX_STAGES, min_stages - 1, -1)]
    # The deepest ring that lets two CTAs share an SM, else the deepest that fits one CTA.
    for budget in (SHARED_SMEM_BUDGET, SMEM_BUDGET):
        fitting = [plan for plan in plans if plan.smem_bytes() <= budget]
        if fitting:
            return fitting[0]
    return plans[-1]


def unsupported_reason(*, head_dim: int, block_size: int, layout: str, scale_mode: str | None, cache_dtype,
                       q_dtype, extra_dtypes: tuple, kv_heads: int, tree: bool = False,
                       sliding_window: int | None = None) -> str:
    """Why the kernel cannot take these static facts, or "" when it can."""
    if tree and sliding_window is not None:
        return "a tree over the new tokens with a sliding window (key offsets are depths, not indices)"
    if head_dim % 64 or not 64 <= head_dim <= 256:
        return (f"head_dim must be 64, 128, 192 or 256 (128-byte swizzled bf16 wgmma operands), "
                f"got {head_dim}")
    if not (TILE % block_size == 0 and block_size % 8 == 0) and block_size % TILE:
        return f"block_size must be 8, 16, 32 or a multiple of {TILE}, got {block_size}"
    plan = make_plan(layout=layout, scale_mode=scale_mode, cache_dtype=cache_dtype, num_layers=1, num_blocks=1,
                     block_size=block_size, max_blocks=1, batch=1, kv_heads=kv_heads, group=1, head_dim=head_dim,
                     tokens=1, staged_capacity=0, q_dtype=q_dtype, extra_dtypes=extra_dtypes)
    if plan.smem_bytes() > SMEM_BUDGET:
        return (f"needs {plan.smem_bytes() // 1024} KiB of shared memory (a {np.dtype(cache_dtype).name} "
                f"cache with head_dim {head_dim}), more than {SMEM_BUDGET // 1024} KiB")
    return ""


# ---------------------------------------------------------------------------------------- kernel body


def _row_vector(values: list[jax.Array], dtype=jnp.float32) -> jax.Array:
    """[len(values)] of ``dtype`` with one traced scalar per tile row, in the wgmma row layout."""
    rows = plgpu.broadcasted_iota(jnp.int32, (len(values),), 0, layout=plgpu.Layout.WGMMA.reduce(1))
    out = jnp.full((len(values),), values[-1], dtype)
    for i, value in enumerate(values[:-1]):
        out = jnp.where(rows == i, value, out)
    return out


def _store_terms(dst, x: jax.Array, terms: int) -> None:
    """Writes ``x`` as ``terms`` bf16 parts into ``dst[0]`` (and ``dst[1]``)."""
    for i, part in enumerate(bf16_parts(x, terms)):
        dst[i] = part


def _products(acc_ref, a_terms: list, b_terms: list) -> jax.Array:
    """``acc_ref`` += sum of a_i @ b_j over the bf16 parts with i + j <= 1 (hi.hi, hi.lo, lo.hi); its value."""
    for i, a in enumerate(a_terms):
        for j, b in enumerate(b_terms):
            if i + j <= 1:
                plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]


def _attention_body(plan: Plan, layer_ref, tables_ref, context_ref, staged_len_ref, *refs):
    scale_refs = refs[:2] if plan.scale_mode is not None else (None, None)
    tree_ref = refs[len(refs) - 9] if plan.tree_words else None
    q_ref, k_pages, v_pages, extra_k_ref, extra_v_ref, out_ref, m_ref, l_ref = refs[len(refs) - 8:]
    d = plan.head_dim
    wgmma = plgpu.Layout.WGMMA
    hr, split, b = lax.axis_index("hr"), lax.axis_index("s"), lax.axis_index("b")
    kv_head = lax.div(hr, plan.row_blocks)
    row_block = lax.rem(hr, plan.row_blocks)
    layer = jnp.clip(layer_ref[0], 0, plan.num_layers - 1)
    context = jnp.clip(context_ref[b], 0, plan.max_blocks * plan.block_size)
    staged = staged_len_ref[b]
    base = context + staged                 # the position of query token 0
    last_page = jnp.maximum(lax.div(context + plan.block_size - 1, plan.block_size) - 1, 0)
    first_tile = split * plan.tiles_per_split
    end_tile = jnp.minimum(first_tile + plan.tiles_per_split, lax.div(context + TILE - 1, TILE))
    if plan.sliding_window is not None:     # skip tiles before the earliest query's window
        first_tile = jnp.maximum(first_tile, lax.div(jnp.maximum(base - plan.sliding_window + 1, 0), TILE))
    num_tiles = jnp.maximum(end_tile - first_tile, 0)

    def tile_pages(tile) -> list[tuple[jax.Array, jax.Array]]:
        """(block, first row) of each TMA copy of ``tile``; pages past the context repeat the last one."""
        out = []
        for copy in range(plan.copies_per_tile):
            position = tile * TILE + copy * plan.chunk
            page = jnp.minimum(lax.div(position, plan.block_size), last_page)
            out.append((jnp.clip(tables_ref[b, page], 0, plan.num_blocks - 1), lax.rem(position, plan.block_size)))
        return out

    def page_rows(pages, block, row):
        rows = pl.ds(row, plan.chunk)
        return pages.at[layer, block, rows, kv_head] if plan.layout == "NHD" else pages.at[layer, block, kv_head, rows]

    def dequant_scale(which: int, pages: list):
        """K's (which=0) or V's (1) scale for a tile: a scalar, [TILE, d] per row, or None."""
        scale_ref = scale_refs[which]
        if plan.scale_mode == "tensor":
            return scale_ref[0]
        if plan.scale_mode == "head":
            return scale_ref[kv_head]
        if plan.scale_mode == "token_head":
            values = [scale_ref[layer, block, row + i, kv_head] for block, row in pages for i in range(plan.chunk)]
            return lax.broadcast_in_dim(_row_vector(values), (TILE, d), [0])
        return None

    def main(q_smem, k_ring, v_ring, p_smem, ring_barriers, q_barrier, extra_barrier, k_ops=None, v_ops=None):
        def fetch(tile, slot):
            for copy, (block, row) in enumerate(tile_pages(tile)):
                dst = pl.ds(copy * plan.chunk, plan.chunk)
                for pages, ring in ((k_pages, k_ring), (v_pages, v_ring)):
                    plgpu.copy_gmem_to_smem(page_rows(pages, block, row), ring.at[slot, dst], ring_barriers.at[slot])

        for stage in range(plan.stages):
            pl.when(stage < num_tiles)(functools.partial(fetch, first_tile + stage, stage))
        for term in range(plan.q_terms):
            plgpu.copy_gmem_to_smem(q_ref.at[b, kv_head, term, pl.ds(row_block * ROWS, ROWS)], q_smem.at[term],
                                    q_barrier)
        plgpu.barrier_wait(q_barrier)
        q_terms = [q_smem.at[i] for i in range(plan.q_terms)]
        p_terms = [p_smem.at[i] for i in range(plan.p_terms)]
        score_scale = np.float32(d ** -0.5 * LOG2E)

        def attend(k_terms: list, v_terms: list, valid: jax.Array, carry):
            """One tile of online softmax; k_terms, v_terms: bf16 [TILE, d] operand refs."""
            acc, m, l = carry
            s = pl.run_scoped(lambda s_ref: _products(s_ref, q_terms, [k.T for k in k_terms]),
                              plgpu.ACC((ROWS, TILE), jnp.float32))
            s = jnp.where(valid, s * score_scale, NEG)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.where(valid, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            _store_terms(p_smem, p, plan.p_terms)
            plgpu.commit_smem()
            pv = pl.run_scoped(lambda o_ref: _products(o_ref, p_terms, v_terms), plgpu.ACC((ROWS, d), jnp.float32))
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l * alpha + p.sum(axis=1)

        columns = plgpu.broadcasted_iota(jnp.int32, (ROWS, TILE), 1, layout=wgmma)
        tile_rows = plgpu.broadcasted_iota(jnp.int32, (TILE, d), 0, layout=wgmma)
        # row r = t * G + g is query token t, at position base + t
        query_rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, TILE), 0, layout=wgmma) + row_block * ROWS

        def windowed(valid, key_offsets):
            """``valid`` and, with a sliding window, the key at position base + offset inside row r's window:
            offset > t - W, i.e. r < (offset + W) * G."""
            if plan.sliding_window is None:
                return valid
            return valid & (query_rows < (key_offsets + plan.sliding_window) * plan.group)

        def page_step(i, carry):
            tile = first_tile + i
            slot = lax.rem(i, plan.stages)
            refetch = functools.partial(fetch, tile + plan.stages, slot)
            plgpu.barrier_wait(ring_barriers.at[slot])
            in_context = tile * TILE + tile_rows < context
            if plan.direct:
                @pl.when((tile + 1) * TILE > context)
                def _():   # the last, partly used tile: zero V past the context (stale bytes may be NaN)
                    v_ring[slot] = jnp.where(in_context, plgpu.load(v_ring.at[slot], layout=wgmma), 0)
                    plgpu.commit_smem()
                k_terms, v_terms = [k_ring.at[slot]], [v_ring.at[slot]]
            else:
                pages = tile_pages(tile) if plan.scale_mode == "token_head" else []
                for which, (ring, ops) in enumerate(((k_ring, k_ops), (v_ring, v_ops))):
                    x = plgpu.load(ring.at[slot], layout=wgmma).astype(jnp.float32)
                    scale = dequant_scale(which, pages)
                    if scale is not None:
                        x = x * scale
                    if which == 1:   # V past the context: zero (stale bytes may be NaN)
                        x = jnp.where(in_context, x, 0.0)
                    _store_terms(ops, x, plan.cache_terms)
                plgpu.commit_smem()
                pl.when(i + plan.stages < num_tiles)(refetch)   # the raw slot is free once dequantised
                k_terms = [k_ops.at[j] for j in range(plan.cache_terms)]
                v_terms = [v_ops.at[j] for j in range(plan.cache_terms)]
            positions = tile * TILE + columns
            carry = attend(k_terms, v_terms, windowed(positions < context, positions - base), carry)
            if plan.direct:   # the wgmma ops reading the slot are done: their results were read
                pl.when(i + plan.stages < num_tiles)(refetch)
            return carry

        carry = (plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), wgmma),
                 plgpu.layout_cast(jnp.full((ROWS,), NEG, jnp.float32), wgmma.reduce(1)),
                 plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), wgmma.reduce(1)))
        carry = lax.fori_loop(0, num_tiles, page_step, carry)

        # Staged entries and new tokens: the ring (bf16 caches) or the operand buffers are idle now.
        k_terms = [(k_ring if plan.direct else k_ops).at[t] for t in range(plan.extra_terms)]
        v_terms = [(v_ring if plan.direct else v_ops).at[t] for t in range(plan.extra_terms)]
        if plan.tree_words:   # each row's ancestor bitmask words (row r is query token r // G)
            tokens_of_rows = [jnp.minimum(lax.div(row_block * ROWS + r, plan.group), plan.tokens - 1)
                              for r in range(ROWS)]
            words = [lax.broadcast_in_dim(_row_vector([tree_ref[b, t, w] for t in tokens_of_rows], jnp.int32),
                                          (ROWS, TILE), [0]) for w in range(plan.tree_words)]

        def new_token_visible(new_token):
            """Whether row r's query token sees new token ``new_token`` (in [0, T)): n <= t for the chain,
            bit n of its ancestor bitmask for a tree."""
            if not plan.tree_words:
                return new_token * plan.group <= query_rows
            word = words[0]
            for w in range(1, plan.tree_words):
                word = jnp.where(new_token >= w * 32, words[w], word)
            bit = lax.shift_right_logical(word, jnp.clip(new_token, 0, plan.tokens - 1) & 31) & 1
            return bit == 1

        def extra_step(j, carry):
            rows = pl.ds(j * TILE, TILE)
            for t in range(plan.extra_terms):
                plgpu.copy_gmem_to_smem(extra_k_ref.at[b, kv_head, t, rows], k_terms[t], extra_barrier)
                plgpu.copy_gmem_to_smem(extra_v_ref.at[b, kv_head, t, rows], v_terms[t], extra_barrier)
            plgpu.barrier_wait(extra_barrier)
            entry = columns + j * TILE
            new_token = entry - plan.staged_capacity
            # staged entry e is at position base + e - staged; new token n at base + n, visible when n <= t
            valid = (entry < staged) | ((new_token >= 0) & (new_token < plan.tokens) & new_token_visible(new_token))
            key_offsets = jnp.where(new_token >= 0, new_token, entry - staged)
            return attend(k_terms, v_terms, windowed(valid, key_offsets), carry)

        return lax.fori_loop(0, jnp.where(split == plan.splits - 1, plan.extra_tiles, 0), extra_step, carry)

    def epilogue(acc, m, l, out_smem):
        rows = pl.ds(row_block * ROWS, ROWS)
        m_ref[b, kv_head, split, rows] = m
        l_ref[b, kv_head, split, rows] = l
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, plan.rows_out)],
                                out_ref.at[b, kv_head, split, pl.ds(row_block * plan.rows_out, plan.rows_out)])
        plgpu.wait_smem_to_gmem(0)

    operand = plgpu.SMEM((plan.operand_terms, TILE, d), jnp.bfloat16, transforms=_swizzled(BF16, d))
    ring = plgpu.SMEM((plan.stages, TILE, d), plan.cache_dtype, transforms=_swizzled(BF16, d) if plan.direct else ())
    buffers = [
        plgpu.SMEM((plan.q_terms, ROWS, d), jnp.bfloat16, transforms=_swizzled(BF16, d)),
        ring,
        ring,
        plgpu.SMEM((plan.p_terms, ROWS, TILE), jnp.bfloat16, transforms=_swizzled(BF16, TILE)),
        plgpu.Barrier(num_arrivals=2 * plan.copies_per_tile, num_barriers=plan.stages),
        plgpu.Barrier(num_arrivals=plan.q_terms),
        plgpu.Barrier(num_arrivals=2 * plan.extra_terms),
    ] + ([] if plan.direct else [operand, operand])
    acc, m, l = pl.run_scoped(main, *buffers)
    # The output staging buffer reuses the main loop's SMEM (scoped allocations are a stack).
    pl.run_scoped(functools.partial(epilogue, acc, m, l), plgpu.SMEM((ROWS, d), jnp.float32))


# ---------------------------------------------------------------------------------------- wrapper


def _pack_queries(q: jax.Array, plan: Plan) -> jax.Array:
    """[B, T, heads, d] -> bf16 [B, kv_heads, q_terms, row_blocks * 64, d]; row t * G + j = head kv * G + j."""
    batch, tokens, _, d = q.shape
    rows = q.reshape(batch, tokens, plan.kv_heads, plan.group, d).transpose(0, 2, 1, 3, 4)
    rows = rows.reshape(batch, plan.kv_heads, plan.rows, d)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, plan.row_blocks * ROWS - plan.rows), (0, 0)))
    return jnp.stack(bf16_parts(rows, plan.q_terms), axis=2)


def _pack_extra(staged: jax.Array | None, staged_lens: jax.Array, new: jax.Array, plan: Plan) -> jax.Array:
    """Staged entries [B, S, kv_heads, d] (zeroed past their length) then new tokens [B, T, kv_heads, d],
    as bf16 [B, kv_heads, terms, E, d]."""
    extra = new.astype(jnp.float32)
    if staged is not None:
        valid = jnp.arange(plan.staged_capacity)[None, :] < staged_lens[:, None]
        staged = jnp.where(valid[:, :, None, None], staged.astype(jnp.float32), 0.0)
        extra = jnp.concatenate([staged, extra], axis=1)                      # [B, S + T, kv_heads, d]
    extra = jnp.pad(extra, ((0, 0), (0, plan.extra_tiles * TILE - extra.shape[1]), (0, 0), (0, 0)))
    return jnp.stack(bf16_parts(extra.transpose(0, 2, 1, 3), plan.extra_terms), axis=2)


def _combine(out: jax.Array, m: jax.Array, l: jax.Array, plan: Plan, dtype, sinks: jax.Array | None) -> jax.Array:
    """Merges the splits' partials (and the ``sinks`` [heads], or None) and unpacks the rows to
    [B, T, heads, d] in ``dtype``."""
    if plan.row_blocks == 1:
        m, l = m[..., :plan.rows_out], l[..., :plan.rows_out]
    top = m.max(axis=2)                                                      # [B, kv, rows]
    if sinks is not None:   # row r holds query head kv * G + r % G; the kernel's logits are in base 2
        sink_rows = (sinks.astype(jnp.float32) * LOG2E).reshape(plan.kv_heads, plan.group)[
            :, np.arange(m.shape[-1]) % plan.group]                          # [kv, rows]
        top = jnp.maximum(top, sink_rows)
    weight = jnp.exp2(m - top[:, :, None])                                   # [B, kv, splits, rows]
    norm = (l * weight).sum(axis=2)
    if sinks is not None:
        norm = norm + jnp.exp2(sink_rows - top)
    acc = (out * weight[..., None]).sum(axis=2)
    rows = acc / jnp.where(norm > 0, norm, 1.0)[..., None]                 # [B, kv, rows, d]
    batch = rows.shape[0]
    rows = rows[:, :, :plan.rows].reshape(batch, plan.kv_heads, plan.tokens, plan.group, plan.head_dim)
    return rows.transpose(0, 2, 1, 3, 4).reshape(batch, plan.tokens, -1, plan.head_dim).astype(dtype)


def paged_attention_kernel(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, k_scale: jax.Array | None,
                           v_scale: jax.Array | None, layer: jax.Array, block_tables: jax.Array,
                           context_lens: jax.Array, staged_keys: jax.Array | None,
                           staged_values: jax.Array | None, staged_lens: jax.Array | None,
                           new_keys: jax.Array, new_values: jax.Array, *, layout: str,
                           scale_mode: str | None, sliding_window: int | None = None,
                           tree_bits: jax.Array | None = None, sinks: jax.Array | None = None,
                           num_splits: int | None = None, interpret: bool = False) -> jax.Array:
    """Attention of ``q`` over the paged cache, the staged entries and the new tokens (causal).

    Args:
      q: [B, T, heads, head_dim] float32/float16/bfloat16.
      k_pages, v_pages: the whole page arrays of all layers, in ``layout`` (NHD
        ``[layers, blocks, block_size, kv_heads, head_dim]`` or HND ``[layers, blocks, kv_heads,
        block_size, head_dim]``), any cache dtype.
      k_scale, v_scale: None; float32[1] ("tensor"); float32[kv_heads] ("head"); float32 scale pages
        ``[layers, blocks, block_size, kv_heads]`` ("token_head").
      layer: int32 scalar (may be traced); clamped into [0, layers).
      block_tables: int32[B, max_blocks]; context_lens, staged_lens: int32[B] (clamped into range).
      staged_keys, staged_values: this layer's [B, S, kv_heads, head_dim] or None; staged entry s is at
        position ``context_lens[b] + s``.
      new_keys, new_values: [B, T, kv_heads, head_dim].
      sliding_window: None or W: query t (at position p) attends only to keys at positions > p - W.
      tree_bits: None (the chain: new token n <= t is visible to query t), or int32[B, T, words]: query
        t sees new token n iff bit n % 32 of word n // 32 is set (``tree_mask.ancestor_bits``); not with
        ``sliding_window``.
      sinks: None, or [heads] float: head h's softmax has one more logit, ``sinks[h]``, whose value is zero.
      num_splits: split-K factor (None: chosen from the shapes, see ``make_plan``).
    Returns:
      [B, T, heads, head_dim] in q's dtype.
    """
    batch, tokens, heads, head_dim = q.shape
    num_layers, num_blocks = k_pages.shape[:2]
    block_size, kv_heads = (k_pages.shape[2], k_pages.shape[3]) if layout == "NHD" else k_pages.shape[3:1:-1]
    staged_capacity = 0 if staged_keys is None else staged_keys.shape[1]
    extra_dtypes = tuple(x.dtype for x in (staged_keys, staged_values, new_keys, new_values) if x is not None)
    plan = make_plan(layout=layout, scale_mode=scale_mode, cache_dtype=k_pages.dtype, num_layers=num_layers,
                     num_blocks=num_blocks, block_size=block_size, max_blocks=max(block_tables.shape[1], 1),
                     batch=batch, kv_heads=kv_heads, group=heads // kv_heads, head_dim=head_dim, tokens=tokens,
                     staged_capacity=staged_capacity, q_dtype=q.dtype, extra_dtypes=extra_dtypes,
                     sliding_window=sliding_window, num_splits=num_splits,
                     tree_words=0 if tree_bits is None else tree_bits.shape[2])
    if block_tables.shape[1] == 0:   # no pages: a dummy column (every context clamps to 0)
        block_tables = jnp.full((batch, 1), -1, jnp.int32)
        context_lens = jnp.zeros_like(context_lens)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    staged_lens = (jnp.zeros((batch,), jnp.int32) if staged_lens is None
                   else jnp.clip(staged_lens.astype(jnp.int32), 0, staged_capacity))
    extra_k = _pack_extra(staged_keys, staged_lens, new_keys, plan)
    extra_v = _pack_extra(staged_values, staged_lens, new_values, plan)
    scales = [] if scale_mode is None else [k_scale, v_scale]
    tree = [] if tree_bits is None else [tree_bits.astype(jnp.int32)]
    partial_rows = plan.row_blocks * plan.rows_out
    out_type = (jax.ShapeDtypeStruct((batch, kv_heads, plan.splits, partial_rows, head_dim), jnp.float32),
                jax.ShapeDtypeStruct((batch, kv_heads, plan.splits, plan.row_blocks * ROWS), jnp.float32),
                jax.ShapeDtypeStruct((batch, kv_heads, plan.splits, plan.row_blocks * ROWS), jnp.float32))
    out, m, l = plgpu.kernel(
        functools.partial(_attention_body, plan), out_type=out_type,
        grid=(kv_heads * plan.row_blocks, plan.splits, batch), grid_names=("hr", "s", "b"),
        interpret=interpret_params(interpret),
    )(layer, block_tables.astype(jnp.int32), context_lens.astype(jnp.int32), staged_lens, *scales, *tree,
      _pack_queries(q, plan), k_pages, v_pages, extra_k, extra_v)
    return _combine(out, m, l, plan, q.dtype, sinks)
