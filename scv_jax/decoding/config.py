"""``DecoderConfig``: the settings of ``SpeculativeDecoder``, checked on construction."""

from __future__ import annotations

import dataclasses

import numpy as np

from scv_jax.adaptive.controller import ControllerConfig
from scv_jax.decoding.tree_config import TreeConfig
from scv_jax.graph.buckets import Buckets
from scv_jax.ops.commit.kv_cache import parse_cache_dtype
from scv_jax.ops.registry import BACKENDS


# ``DecoderConfig.max_num_batched_tokens`` when None, by platform ("gpu" or "cpu"); see docs/engine.md
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"gpu": 2048, "cpu": 256}


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Settings of ``SpeculativeDecoder``; every field is checked on construction.

    Attributes:
      k: drafts per request per step when not adaptive (vLLM's num_speculative_tokens; 0 = no
        speculation); a request drafts fewer when its remaining budget or the n-gram matches allow
        fewer. The decoder compiles a step for k and for k = 0.
      adaptive: choose k per step with ``AdaptiveController`` (goodput mode) from ``k_values``.
      k_values: the k an adaptive decoder may pick (one executable each, plus k = 0).
      controller: optional ``ControllerConfig`` overriding the adaptive defaults.
      block_size, num_blocks: the paged caches' geometry (shared by target and draft).
      max_seq_len: most cache positions per request (prompt + max_new_tokens - 1); sets the
        block-table width.
      cache_dtype: dtype of both caches (any ``PagedKVCache`` dtype name, e.g. "bfloat16", "fp8").
      prefill_chunk: prompt tokens per request per prefill call.
      max_num_batched_tokens: the tokens one engine step computes, vLLM's: every decoding request's
        (1 + the most drafts its step may verify) first, then prompt chunks of the requests being
        prefilled with the rest (at least one ``prefill_chunk`` a step, so a prompt always advances), so
        a long prompt is prefilled over several steps while the running requests keep decoding;
        None (default): ``DEFAULT_MAX_NUM_BATCHED_TOKENS`` for the platform (2048 on a GPU, 256 on a
        CPU; docs/engine.md).
      batch_buckets: batch sizes steps are padded to (graph mode).
      context_buckets: block-table widths (in blocks) steps are padded to (the widest is always
        max_seq_len's); None: max_seq_len's width and its successive halves down to 16 blocks
        (``Buckets.halving``: e.g. 17, 34, 68 blocks for 1,088 positions of 16; a request growing to
        max_seq_len crosses about log2(its width / 16) of them; attention masks the padding).
      backend: "auto", "pallas", "xla" or "interpret" for every op of the step.
      packed_verify: the target scores only each request's own drafts, packed in one row
        (``forward_packed``; single device): a step with ragged drafts (n-gram matches of different
        lengths, budgets) costs the tokens it verifies, B * (m + 1) with m their mean per request
        rounded up to a power of two, or with ``adaptive`` to 1 or one of ``k_values`` (one more
        executable per such m < k); an adaptive decoder's controller times each k by the steps
        it leads to.
      tree: verify a token tree per request per step instead of a chain of k drafts (``TreeConfig``;
        a draft model's EAGLE-2 tree or an n-gram trie; docs/trees.md); None: chains. Not with
        ``adaptive``, ``packed_verify`` or a mesh (k is then unused).
      enable_prefix_caching: keep blocks full of verified tokens (prompt and output) cached after their
        request ends, and start a new request from the cached blocks of its longest cached prefix
        (docs/engine.md); None (default) or True: on; False: off.
      overlap: one step in flight (docs/engine.md): an ``Engine`` dispatches a decode step before it
        fetches the one before, the host's bookkeeping of that one overlapping the device's work on the
        next (vLLM's async scheduling, SGLang's overlap scheduler); stops take effect a step late, the
        device's work past a request's end discarded. Steps that need the host to know the last tokens
        first run synchronously (host drafters unless ``draft_ahead``, batches more than a quarter
        constrained by structured output, a draft's catch-up after k = 0 steps); a constrained request
        in a batch that overlaps runs every other step. On a mesh too. False: every step is fetched
        before the next is planned (the loop to A/B against, and to debug).
      draft_ahead: with ``overlap``, a host drafter's chains (n-gram, suffix, predicted outputs, your
        ``HostDrafter``) are proposed while the step before runs, past that step's drafts assumed
        accepted, so their steps overlap too; a request whose step turns out otherwise verifies drafts
        of a text it does not have at its next step (rejected: one step without useful drafts). Pays
        where drafting is a large share of the host's step (suffix decoding at large batch), loses where
        it is not (docs/performance.md, "One step in flight"). Trees stay synchronous.
    """

    k: int = 4
    adaptive: bool = False
    k_values: tuple[int, ...] = (0, 2, 4, 6, 8)
    controller: ControllerConfig | None = None
    block_size: int = 16
    num_blocks: int = 512
    max_seq_len: int = 1024
    cache_dtype: str = "float32"
    prefill_chunk: int = 64
    max_num_batched_tokens: int | None = None
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context_buckets: tuple[int, ...] | None = None
    backend: str = "auto"
    packed_verify: bool = False
    tree: TreeConfig | None = None
    enable_prefix_caching: bool | None = None
    overlap: bool = True
    draft_ahead: bool = False

    def __post_init__(self):
        def fail(name: str, expected: str) -> None:
            raise ValueError(f"DecoderConfig.{name} must be {expected}, got {getattr(self, name)!r}")

        if not _is_int(self.k) or self.k < 0:
            fail("k", "an int >= 0")
        if not self.k_values or not all(_is_int(k) and k >= 0 for k in self.k_values):
            fail("k_values", "a non-empty tuple of ints >= 0")
        for name in ("block_size", "num_blocks", "max_seq_len", "prefill_chunk"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, "an int >= 1")
        for name in ("batch_buckets", "context_buckets"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or not all(_is_int(s) and s >= 1 for s in sizes)):
                fail(name, "a non-empty tuple of ints >= 1" + (" or None" if name == "context_buckets" else ""))
        if self.controller is not None and not isinstance(self.controller, ControllerConfig):
            fail("controller", "a ControllerConfig or None")
        for name in ("adaptive", "packed_verify", "overlap", "draft_ahead"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a bool")
        if self.max_num_batched_tokens is not None and (not _is_int(self.max_num_batched_tokens)
                                                        or self.max_num_batched_tokens < 1):
            fail("max_num_batched_tokens", "an int >= 1 or None")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            fail("enable_prefix_caching", "a bool or None")
        if self.backend not in BACKENDS:
            fail("backend", f"one of {BACKENDS}")
        if self.tree is not None:
            if not isinstance(self.tree, TreeConfig):
                fail("tree", "a TreeConfig or None")
            if self.adaptive or self.packed_verify:
                raise ValueError("DecoderConfig.tree cannot be combined with adaptive or packed_verify "
                                 "(a tree step has a fixed shape and scores every node)")
        try:
            parse_cache_dtype(self.cache_dtype)
        except ValueError as error:
            raise ValueError(f"DecoderConfig.cache_dtype: {error}") from None

    @property
    def allowed_k(self) -> tuple[int, ...]:
        """The k values steps may use, ascending."""
        return tuple(sorted(set(self.k_values))) if self.adaptive else (self.k,)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    def block_buckets(self) -> Buckets:
        """Block-table widths that steps are padded to."""
        if self.context_buckets is not None:
            return Buckets(tuple(sorted(set(self.context_buckets) | {self.max_blocks_per_seq})))
        most = self.max_blocks_per_seq
        return Buckets.halving(most, min_size=min(16, most))
