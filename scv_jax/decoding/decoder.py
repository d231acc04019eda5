"""The speculative decoding loop: prefill, then draft / verify / accept / commit / adapt per step.

    target, draft = scv_jax.models.load_demo()
    decoder = scv_jax.SpeculativeDecoder(target, draft, config=scv_jax.DecoderConfig(k=4))
    out = decoder.generate([list(b"def main(")], max_new_tokens=64)
    out.tokens[0], out.stats.tokens_per_second

All per-request state (tokens, lengths, block tables) lives on the host; the device holds the two
paged caches and the model weights. Each step is one call into a graph-mode executable and one
batched device-to-host fetch of the emitted tokens. See ``scv_jax.decoding.device_step`` for the step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx

from scv_jax.decoding.block_pool import BlockPool, BlockTable, stack_block_tables
from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.stats import AcceptanceTally, GenerateStats
from scv_jax.graph.buckets import Buckets, Pad
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.adaptive.controller import AdaptiveController, ControllerConfig
from scv_jax.decoding.device_step import make_decode_step, make_prefill_step
from scv_jax.graph.executable_cache import ExecutableCache
from scv_jax.ops.commit.kv_cache import PagedKVCache


class GenerateOutput(NamedTuple):
    """tokens: the generated tokens of each prompt (prompt excluded, EOS included); stats."""

    tokens: list[list[int]]
    stats: GenerateStats


@dataclasses.dataclass
class _Request:
    index: int
    tokens: list[int]
    prompt_len: int
    table: BlockTable
    target_len: int = 0          # positions in the target cache
    draft_len: int = 0           # positions in the draft cache
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def _model_dims(model, name: str) -> tuple[int, int, int, int]:
    config = getattr(model, "config", None)
    if not hasattr(model, "forward_paged") or config is None:
        raise TypeError(f"SpeculativeDecoder: {name} must implement scv_jax.models.PagedModel "
                        f"(forward_paged and config), got {type(model).__name__}")
    return config.vocab_size, config.num_layers, config.num_kv_heads, config.head_dim


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``draft`` (or plain decoding when ``draft`` is None).

    Both models implement ``scv_jax.models.PagedModel`` with the same vocabulary. They are split once
    (``nnx.split``); the step functions are pure functions of their states, compiled per shape bucket
    by ``ExecutableCache``. Greedy output equals autoregressive decoding of the target token for token;
    with temperature > 0, rejection sampling keeps the target's distribution.
    """

    def __init__(self, target, draft=None, *, config: DecoderConfig | None = None):
        self.config = config or DecoderConfig()
        self.vocab_size, *self._target_dims = _model_dims(target, "target")
        if draft is not None:
            draft_vocab, *self._draft_dims = _model_dims(draft, "draft")
            if draft_vocab != self.vocab_size:
                raise ValueError(f"SpeculativeDecoder: draft vocab_size {draft_vocab} != target vocab_size "
                                 f"{self.vocab_size}")
        elif self.config.adaptive or self.config.k:
            self.config = dataclasses.replace(self.config, k=0, adaptive=False)
        self.has_draft = draft is not None
        target_graphdef, self._target_state = nnx.split(target)
        draft_graphdef, self._draft_state = nnx.split(draft) if draft is not None else (None, None)
        cfg = self.config
        self.pool = BlockPool(cfg.num_blocks)
        self._caches: tuple | None = None
        block_buckets = cfg.block_buckets()
        batch_buckets = Buckets(tuple(sorted(set(cfg.batch_buckets))))
        common = dict(static_argnames=("backend",), donate_argnames=("target_cache", "draft_cache"),
                      masks={"request_mask": "batch"}, fallback={"backend": "xla"})
        table_pads = [Pad("batch", axis=0, fill=-1), Pad("blocks", axis=1, fill=-1)]
        dims = {"batch": batch_buckets, "blocks": block_buckets}
        self._decode = ExecutableCache(
            make_decode_step(target_graphdef, draft_graphdef, cfg.block_size), dims=dims,
            pads={"block_tables": table_pads, "last_tokens": Pad("batch"), "catch_up": Pad("batch", fill=1),
                  "target_lens": Pad("batch"), "request_ids": Pad("batch")},
            bucketed_statics={"k": cfg.allowed_k}, name="decode_step",
            **{**common, "static_argnames": ("greedy", "backend")})
        self._prefill = ExecutableCache(
            make_prefill_step(target_graphdef, draft_graphdef, cfg.block_size), dims=dims,
            pads={"block_tables": table_pads, "tokens": Pad("batch"), "start": Pad("batch"),
                  "count": Pad("batch")}, name="prefill_step", **common)
        self.controller = self._make_controller()

    def _make_controller(self) -> AdaptiveController | None:
        cfg = self.config
        if not cfg.adaptive:
            return None
        base = cfg.controller or ControllerConfig()
        allowed = cfg.allowed_k
        return AdaptiveController(dataclasses.replace(
            base, k_min=allowed[0], k_max=allowed[-1],
            allowed_k=allowed, draft_sync="forward",
            k_init=base.k_init if base.k_init in allowed else allowed[-1]))

    # ------------------------------------------------------------------ caches
    def _new_cache(self, dims) -> PagedKVCache:
        num_layers, kv_heads, head_dim = dims
        cache = PagedKVCache.create(num_layers, self.config.num_blocks, self.config.block_size, kv_heads,
                                    head_dim, dtype=self.config.cache_dtype)
        # distinct K and V buffers: a donating call may not receive one buffer twice
        return cache.replace(v_pages=jax.numpy.zeros_like(cache.v_pages))

    def _take_caches(self) -> tuple:
        """The caches, handed over to a donating call (recreated if a failed call consumed them)."""
        caches, self._caches = self._caches, None
        if caches is None:
            caches = (self._new_cache(self._target_dims),
                      self._new_cache(self._draft_dims) if self.has_draft else None)
        return caches

    # ------------------------------------------------------------------ validation
    def _check_inputs(self, prompts, max_new_tokens, temperature) -> list[list[int]]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float, np.floating)) and math.isfinite(temperature)
                and temperature >= 0):
            raise ValueError(f"generate: temperature must be a finite float >= 0, got {temperature!r}")
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            raise ValueError("generate: prompts must be a list of token sequences (e.g. [[1, 2, 3]]), "
                             "got a 1-D array")
        if len(prompts) == 0:
            raise ValueError("generate: prompts must hold at least one prompt")
        checked = []
        for i, prompt in enumerate(prompts):
            ids = np.asarray(prompt)
            if ids.ndim != 1 or ids.size == 0:
                raise ValueError(f"generate: prompt {i} must be a non-empty 1-D sequence of token ids, "
                                 f"got shape {ids.shape}")
            if not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"generate: prompt {i} must hold integer token ids, got dtype {ids.dtype}")
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                raise ValueError(f"generate: prompt {i} has token id {int(ids.max() if ids.max() >= 0 else ids.min())}"
                                 f" outside [0, vocab_size={self.vocab_size})")
            checked.append(ids.astype(np.int64).tolist())
        cfg = self.config
        k_max = max(cfg.allowed_k)
        longest = max(len(p) for p in checked) + max_new_tokens + k_max - 1
        if longest > cfg.max_seq_len:
            raise ValueError(f"generate: a request needs up to {longest} cache positions (prompt "
                             f"{max(len(p) for p in checked)} + max_new_tokens {max_new_tokens} + k {k_max} "
                             f"- 1) but DecoderConfig.max_seq_len is {cfg.max_seq_len}")
        blocks = sum(-(-(len(p) + max_new_tokens + k_max - 1) // cfg.block_size) for p in checked)
        if blocks > self.pool.num_free:
            raise ValueError(f"generate: the batch needs up to {blocks} KV blocks but the cache has "
                             f"{self.pool.num_free} free of {cfg.num_blocks} (raise DecoderConfig.num_blocks "
                             "or split the batch)")
        return checked

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, eos_token_id: int | None = None) -> GenerateOutput:
        """Generates up to ``max_new_tokens`` tokens for each prompt (a batch of any lengths).

        A request stops at ``max_new_tokens`` or after emitting ``eos_token_id``; its KV blocks go back
        to the pool. ``temperature`` 0 is greedy; otherwise sampling with ``seed`` (same seed, same output).
        """
        prompt_ids = self._check_inputs(prompts, max_new_tokens, temperature)
        if eos_token_id is not None and not 0 <= eos_token_id < self.vocab_size:
            raise ValueError(f"generate: eos_token_id must be in [0, vocab_size={self.vocab_size}) or None, "
                             f"got {eos_token_id!r}")
        requests = [_Request(i, list(p), len(p), BlockTable(self.pool, self.config.block_size))
                    for i, p in enumerate(prompt_ids)]
        stats = GenerateStats(prompt_tokens=sum(len(p) for p in prompt_ids))
        counts = AcceptanceTally(max(self.config.allowed_k))
        start = time.perf_counter()
        with CompileCounter() as compiles:
            try:
                self._prefill_all(requests)
                stats.prefill_seconds = time.perf_counter() - start
                base_key = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
                while active := [r for r in requests if not r.done]:
                    self._step(active, base_key, float(temperature), max_new_tokens, eos_token_id, counts,
                               stats)
            finally:
                for r in requests:
                    r.table.release()
        stats.wall_seconds = time.perf_counter() - start
        stats.compile_count = compiles.count
        stats.generated_tokens = sum(len(r.generated) for r in requests)
        stats.tokens_per_second = stats.generated_tokens / max(stats.wall_seconds, 1e-9)
        counts.fill(stats)
        return GenerateOutput([r.generated for r in requests], stats)

    def _call(self, cache_fn: ExecutableCache, **args):
        target_cache, draft_cache = self._take_caches()
        outputs = cache_fn(target_state=self._target_state, draft_state=self._draft_state,
                           target_cache=target_cache, draft_cache=draft_cache,
                           backend=self.config.backend, **args)
        self._caches = outputs[:2]
        return outputs[2:]

    def _prefill_all(self, requests: list[_Request]) -> None:
        """Commits every prompt but its last token to both caches, ``prefill_chunk`` tokens a call."""
        chunk = self.config.prefill_chunk
        for r in requests:
            r.table.ensure(r.prompt_len - 1)
        longest = max(r.prompt_len - 1 for r in requests)
        for begin in range(0, longest, chunk):
            rows = [r for r in requests if r.prompt_len - 1 > begin]
            tokens = np.zeros((len(rows), chunk), np.int32)
            for row, r in zip(tokens, rows):
                piece = r.tokens[begin:min(begin + chunk, r.prompt_len - 1)]
                row[:len(piece)] = piece
            width = max(len(r.table.blocks) for r in rows)
            self._call(self._prefill, block_tables=stack_block_tables([r.table for r in rows], width),
                       tokens=tokens, start=np.full(len(rows), begin, np.int32),
                       count=np.array([min(chunk, r.prompt_len - 1 - begin) for r in rows], np.int32))
        for r in requests:
            r.target_len = r.draft_len = r.prompt_len - 1

    def _next_k(self, batch_size: int) -> int:
        return self.controller.next_k(batch_size) if self.controller else self.config.k

    def _step(self, active: list[_Request], base_key: np.ndarray, temperature: float, max_new_tokens: int,
              eos_token_id: int | None, counts: "AcceptanceTally", stats: GenerateStats) -> None:
        step_start = time.perf_counter()
        # the controller sees the batch the executable computes (padding rows cost like real ones)
        computed_batch = self._decode.bucket("batch", len(active)) or len(active)
        k = self._next_k(computed_batch)
        for r in active:
            r.table.ensure(len(r.tokens) + k)
        catch_up = np.array([len(r.tokens) - r.draft_len if self.has_draft else 1 for r in active], np.int32)
        last_tokens = np.zeros((len(active), 2), np.int32)
        for row, r, c in zip(last_tokens, active, catch_up):
            row[:c] = r.tokens[len(r.tokens) - c:]
        width = max(len(r.table.blocks) for r in active)
        (summary,) = self._call(
            self._decode, block_tables=stack_block_tables([r.table for r in active], width),
            last_tokens=last_tokens, catch_up=catch_up,
            target_lens=np.array([r.target_len for r in active], np.int32),
            request_ids=np.array([r.index for r in active], np.int32), base_key=base_key,
            temperature=np.float32(max(temperature, 1e-6)), k=k, greedy=temperature == 0.0)
        host = summary.fetch(len(active))        # the step's one transfer
        step_seconds = time.perf_counter() - step_start
        compiled = self._decode.last_call_compiled  # a compile is no step cost: leave it untimed
        for r, emitted, accepted in zip(active, host.token_lists(), host.num_accepted):
            self._advance(r, emitted, int(accepted), k, max_new_tokens, eos_token_id)
        if self.controller:
            self.controller.update(np.full(len(active), k, np.int64), host.num_accepted.astype(np.int64),
                                   None if compiled else step_seconds, computed_batch)
        counts.add(k, host.num_accepted, host.num_emitted)
        stats.steps += 1
        stats.k_histogram[k] = stats.k_histogram.get(k, 0) + 1

    def _advance(self, r: _Request, emitted: list[int], accepted: int, k: int, max_new_tokens: int,
                 eos_token_id: int | None) -> None:
        """Appends a step's tokens to ``r``, updates its cache lengths and finishes it if due."""
        r.target_len = len(r.tokens) + accepted          # pending + accepted drafts committed
        r.draft_len = len(r.tokens) + min(accepted, k - 1) if (self.has_draft and k) else len(r.tokens)
        room = max_new_tokens - len(r.generated)
        emitted = emitted[:room]
        if eos_token_id is not None and eos_token_id in emitted:
            emitted = emitted[:emitted.index(eos_token_id) + 1]
            r.done = True
        r.tokens.extend(emitted)
        if r.done or len(r.generated) >= max_new_tokens:
            r.done = True
            r.table.release()

    # ------------------------------------------------------------------ warm-up
    def warmup(self, batch_sizes: int | Sequence[int], max_len: int, *, greedy: bool = True,
               progress: bool = False) -> int:
        """Compiles ahead of time the prefill and step executables for batches of ``batch_sizes``
        requests (their buckets) of up to ``max_len`` positions (prompt + generated + k), every
        allowed k; returns the number of compilations. Smaller buckets (a batch shrinking as requests
        finish) compile on first use."""
        cfg = self.config
        sizes = [batch_sizes] if isinstance(batch_sizes, (int, np.integer)) else list(batch_sizes)
        batch_keep = {self._decode.bucket("batch", b) for b in sizes}
        block_bucket = self._decode.bucket("blocks", -(-max_len // cfg.block_size))
        if None in batch_keep or block_bucket is None:
            raise ValueError(f"warmup: batch sizes {sizes} / max_len {max_len} exceed the buckets "
                             f"(batch_buckets {cfg.batch_buckets}, max_seq_len {cfg.max_seq_len})")
        keep = lambda s: s["batch"] in batch_keep and s["blocks"] <= block_bucket  # noqa: E731
        target_cache, draft_cache = self._take_caches()
        example = dict(target_state=self._target_state, draft_state=self._draft_state,
                       target_cache=target_cache, draft_cache=draft_cache,
                       block_tables=np.zeros((1, 1), np.int32), backend=cfg.backend)
        with CompileCounter() as compiles:
            self._prefill.warmup(**example, tokens=np.zeros((1, cfg.prefill_chunk), np.int32),
                                 start=np.zeros(1, np.int32), count=np.zeros(1, np.int32), keep=keep,
                                 progress=progress)
            self._decode.warmup(**example, last_tokens=np.zeros((1, 2), np.int32),
                                catch_up=np.ones(1, np.int32), target_lens=np.zeros(1, np.int32),
                                request_ids=np.zeros(1, np.int32),
                                base_key=np.zeros(2, np.uint32), temperature=np.float32(1.0),
                                k=cfg.allowed_k[0], greedy=greedy, keep=keep, progress=progress)
        self._caches = (target_cache, draft_cache)
        return compiles.count


def generate_autoregressive(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                            temperature: float = 0.0, seed: int = 0, eos_token_id: int | None = None,
                            *, config: DecoderConfig | None = None) -> GenerateOutput:
    """Plain decoding of ``model`` through the same paged-cache code (the baseline).

    Builds a ``SpeculativeDecoder(model, None)``; to decode repeatedly without recompiling, build one
    yourself and call its ``generate``.
    """
    decoder = SpeculativeDecoder(model, None, config=config)
    return decoder.generate(prompts, max_new_tokens, temperature, seed, eos_token_id)
