"""The speculative decoding loop (host side): prefill, then per step choose k, run the device step
(propose -> score -> accept -> commit, ``device_step``), fetch its summary once, advance the requests
and adapt.

    target, draft = scv_jax.models.load_demo()
    decoder = scv_jax.SpeculativeDecoder(target, draft, config=scv_jax.DecoderConfig(k=4))
    out = decoder.generate([list(b"def main(")], max_new_tokens=64)
    out.tokens[0], out.stats.tokens_per_second

All per-request state (tokens, lags, block tables) lives on the host; the device holds the two paged
caches and the model weights. Each step is one call into a graph-mode executable and one batched
device-to-host fetch of the emitted tokens. With ``mesh=`` the weights, caches and batch are spread
over a device mesh (``placement``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from scv_jax.adaptive.controller import AdaptiveController, ControllerConfig
from scv_jax.decoding.block_pool import BlockPool, BlockTable, stack_block_tables
from scv_jax.decoding.caches import ModelCaches
from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.executables import step_executables
from scv_jax.decoding.placement import OnMesh, ShardingConfig, SingleDevice
from scv_jax.decoding.positions import MAX_CATCH_UP, lag_after_step
from scv_jax.decoding.requests import Request, check_prompts, step_inputs
from scv_jax.decoding.stats import AcceptanceTally, GenerateStats
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.graph.executable_cache import ExecutableCache, GraphModeStats
from scv_jax.verify.summary import HostStepResult

PREFILL_PROGRESS_SECONDS = 2.0   # a prefill running longer than this reports its progress on stderr


class GenerateOutput(NamedTuple):
    """tokens: the generated tokens of each prompt (prompt excluded, EOS included); stats."""

    tokens: list[list[int]]
    stats: GenerateStats


def _vocab_size(model: Any, name: str) -> int:
    """The vocabulary size of a ``PagedModel``."""
    config = getattr(model, "config", None)
    if not hasattr(model, "forward_paged") or config is None:
        raise TypeError(f"SpeculativeDecoder: {name} must implement scv_jax.models.PagedModel "
                        f"(forward_paged and config), got {type(model).__name__}")
    return config.vocab_size


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``draft`` (or plain decoding when ``draft`` is None).

    Both models implement ``scv_jax.models.PagedModel`` with the same vocabulary. They are split once
    (``nnx.split``); the step functions are pure functions of their states, compiled per shape bucket
    by ``ExecutableCache``. Greedy output equals autoregressive decoding of the target token for token;
    with temperature > 0, rejection sampling keeps the target's distribution.

    ``mesh``: a ``jax.sharding.Mesh`` with axes ("data", "model") (e.g. ``scv_jax.decoder_mesh(2, 4)``)
    to run on: the target tensor-parallel over "model", requests and their cache blocks split over
    "data" (``scv_jax.decoding.placement``; both models must then be ``scv_jax.models.Transformer``s).
    ``sharding``: a ``ShardingConfig`` (draft placement, vocabulary-parallel embeddings) for the mesh.
    """

    def __init__(self, target, draft=None, *, config: DecoderConfig | None = None, mesh=None,
                 sharding: ShardingConfig | None = None):
        self.config = config or DecoderConfig()
        self.vocab_size = _vocab_size(target, "target")
        if draft is not None:
            draft_vocab = _vocab_size(draft, "draft")
            if draft_vocab != self.vocab_size:
                raise ValueError(f"SpeculativeDecoder: draft vocab_size {draft_vocab} != target vocab_size "
                                 f"{self.vocab_size}")
        elif self.config.adaptive or self.config.k:
            self.config = dataclasses.replace(self.config, k=0, adaptive=False)
        cfg = self.config
        if mesh is None and sharding is not None:
            raise ValueError("SpeculativeDecoder: sharding is for a mesh; pass mesh= too")
        self.placement = SingleDevice(cfg) if mesh is None else OnMesh(mesh, cfg, sharding)
        target_graphdef, self._target_state, target_dims = self.placement.split(target, "target")
        draft_graphdef, self._draft_state, draft_dims = self.placement.split(draft, "draft")
        self.pool = self.placement.pool
        self._caches = ModelCaches(cfg.num_blocks, cfg.block_size, cfg.cache_dtype, target_dims, draft_dims,
                                   factory=self.placement.new_cache)
        self._prefill, self._decode = step_executables(cfg, target_graphdef, draft_graphdef, self.placement)
        self.controller = self._make_controller()

    @property
    def graph_stats(self) -> dict[str, GraphModeStats]:
        """Graph-mode counters of the prefill and decode executables (hits, compiles, donations, ...)."""
        return {"prefill": self._prefill.stats, "decode": self._decode.stats}

    def _make_controller(self) -> AdaptiveController | None:
        cfg = self.config
        if not cfg.adaptive:
            return None
        base = cfg.controller or ControllerConfig()
        allowed = cfg.allowed_k
        return AdaptiveController(dataclasses.replace(
            base, k_min=allowed[0], k_max=allowed[-1], allowed_k=allowed, draft_sync="forward",
            k_init=base.k_init if base.k_init in allowed else allowed[-1]))

    # ------------------------------------------------------------------ checks
    def _check_request(self, prompts: list[list[int]], max_new_tokens: int) -> list[BlockPool]:
        """The block pool of each request; raises before anything runs when the batch cannot fit the
        caches."""
        cfg = self.config
        k_max = max(cfg.allowed_k)
        longest = max(len(p) for p in prompts) + max_new_tokens + k_max - 1
        if longest > cfg.max_seq_len:
            raise ValueError(f"generate: a request needs up to {longest} cache positions (prompt "
                             f"{max(len(p) for p in prompts)} + max_new_tokens {max_new_tokens} + k {k_max} "
                             f"- 1) but DecoderConfig.max_seq_len is {cfg.max_seq_len}")
        return self.pool.assign([-(-(len(p) + max_new_tokens + k_max - 1) // cfg.block_size) for p in prompts])

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, eos_token_id: int | None = None, *, progress: bool = False) -> GenerateOutput:
        """Generates up to ``max_new_tokens`` tokens for each prompt (a batch of any lengths).

        A request stops at ``max_new_tokens`` or after emitting ``eos_token_id``; its KV blocks go back
        to the pool. ``temperature`` 0 is greedy; otherwise sampling with ``seed`` (same seed, same
        output). ``progress``: report the prefill of long prompts on stderr.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float, np.floating)) and math.isfinite(temperature)
                and temperature >= 0):
            raise ValueError(f"generate: temperature must be a finite float >= 0, got {temperature!r}")
        if eos_token_id is not None and not 0 <= eos_token_id < self.vocab_size:
            raise ValueError(f"generate: eos_token_id must be in [0, vocab_size={self.vocab_size}) or None, "
                             f"got {eos_token_id!r}")
        prompt_ids = check_prompts(prompts, self.vocab_size)
        pools = self._check_request(prompt_ids, max_new_tokens)
        requests = [Request(i, list(p), len(p), BlockTable(pool, self.config.block_size))
                    for i, (p, pool) in enumerate(zip(prompt_ids, pools))]
        stats = GenerateStats(prompt_tokens=sum(len(p) for p in prompt_ids))
        tally = AcceptanceTally(max(self.config.allowed_k))
        start = time.perf_counter()
        with CompileCounter() as compiles:
            try:
                self._prefill_all(requests, stats, progress)
                stats.prefill_seconds = time.perf_counter() - start
                base_key = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
                while active := [r for r in requests if not r.done]:
                    self._step(active, base_key, float(temperature), max_new_tokens, eos_token_id, tally, stats)
            finally:
                for r in requests:
                    r.table.release()
        stats.wall_seconds = time.perf_counter() - start
        stats.compile_count = compiles.count
        stats.generated_tokens = sum(len(r.generated) for r in requests)
        stats.tokens_per_second = stats.generated_tokens / max(stats.wall_seconds - stats.compile_seconds, 1e-9)
        tally.fill(stats)
        return GenerateOutput([r.generated for r in requests], stats)

    def _run(self, executable: ExecutableCache, stats: GenerateStats, **args):
        """One donating call with both caches; returns its other outputs (time spent compiling goes to
        ``stats.compile_seconds``)."""
        target_cache, draft_cache = self._caches.take()
        start = time.perf_counter()
        target_cache, draft_cache, *outputs = executable(
            target_state=self._target_state, draft_state=self._draft_state, target_cache=target_cache,
            draft_cache=draft_cache, backend=self.config.backend, **args)
        if executable.last_call_compiled:
            stats.compile_seconds += time.perf_counter() - start
        self._caches.put(target_cache, draft_cache)
        return outputs

    def _prefill_all(self, requests: list[Request], stats: GenerateStats, progress: bool) -> None:
        """Commits every prompt but its last token to both caches, ``prefill_chunk`` tokens a call."""
        chunk = self.config.prefill_chunk
        for r in requests:
            r.table.ensure(r.prompt_len - 1)
        longest = max(r.prompt_len - 1 for r in requests)
        start = reported = time.perf_counter()
        for begin in range(0, longest, chunk):
            rows = [r for r in requests if r.prompt_len - 1 > begin]
            tokens = np.zeros((len(rows), chunk), np.int32)
            for row, r in zip(tokens, rows):
                piece = r.tokens[begin:min(begin + chunk, r.prompt_len - 1)]
                row[:len(piece)] = piece
            width = max(len(r.table.blocks) for r in rows)
            layout = self.placement.rows([r.table for r in rows], self._prefill)
            self._run(self._prefill, stats, **layout.arrange(
                self._prefill, block_tables=stack_block_tables([r.table for r in rows], width), tokens=tokens,
                start=np.full(len(rows), begin, np.int32),
                count=np.array([min(chunk, r.prompt_len - 1 - begin) for r in rows], np.int32)))
            now = time.perf_counter()
            if progress and now - reported > PREFILL_PROGRESS_SECONDS:
                reported = now
                print(f"prefill: {min(begin + chunk, longest)}/{longest} prompt tokens "
                      f"({now - start:.1f} s, compiling {stats.compile_seconds:.1f} s of it)",
                      file=sys.stderr, flush=True)

    def _next_k(self, computed_batch: int) -> int:
        return self.controller.next_k(computed_batch) if self.controller else self.config.k

    def _step(self, active: list[Request], base_key: np.ndarray, temperature: float, max_new_tokens: int,
              eos_token_id: int | None, tally: AcceptanceTally, stats: GenerateStats) -> None:
        step_start = time.perf_counter()
        layout = self.placement.rows([r.table for r in active], self._decode)
        # the controller sees the batch the executable computes (padding rows cost like real ones)
        computed_batch = layout.computed
        k = self._next_k(computed_batch)
        for r in active:
            r.table.ensure(len(r.tokens) + k)
        (summary,) = self._run(self._decode, stats, **layout.arrange(self._decode, **step_inputs(active)),
                               base_key=base_key, temperature=np.float32(max(temperature, 1e-6)), k=k,
                               greedy=temperature == 0.0)
        host = layout.fetch(summary)                      # the step's one device-to-host transfer
        step_seconds = time.perf_counter() - step_start
        self._advance(active, host, k, max_new_tokens, eos_token_id)
        num_drafts = np.full(len(active), k, np.int64)
        if self.controller:   # a compile is no step cost: leave that step untimed
            self.controller.update(num_drafts, host.num_accepted.astype(np.int64),
                                   None if self._decode.last_call_compiled else step_seconds, computed_batch)
        tally.add(num_drafts, host.num_accepted, host.num_emitted)
        stats.steps += 1
        stats.k_histogram[k] = stats.k_histogram.get(k, 0) + 1

    def _advance(self, active: list[Request], host: HostStepResult, k: int, max_new_tokens: int,
                 eos_token_id: int | None) -> None:
        """Appends each request's emitted tokens, moves its draft lag and finishes it if due."""
        for r, emitted, accepted in zip(active, host.token_lists(), host.num_accepted.tolist()):
            r.lag = lag_after_step(r.lag, accepted, k)
            emitted = emitted[:max_new_tokens - len(r.generated)]
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
        target_cache, draft_cache = self._caches.take()
        example = dict(target_state=self._target_state, draft_state=self._draft_state,
                       target_cache=target_cache, draft_cache=draft_cache,
                       block_tables=np.zeros((1, 1), np.int32), backend=cfg.backend, **self.placement.warmup_args())
        with CompileCounter() as compiles:
            self._prefill.warmup(**example, tokens=np.zeros((1, cfg.prefill_chunk), np.int32),
                                 start=np.zeros(1, np.int32), count=np.zeros(1, np.int32), keep=keep,
                                 progress=progress)
            self._decode.warmup(**example, lag_tokens=np.zeros((1, MAX_CATCH_UP), np.int32),
                                lag=np.ones(1, np.int32), context_lens=np.zeros(1, np.int32),
                                request_ids=np.zeros(1, np.int32), base_key=np.zeros(2, np.uint32),
                                temperature=np.float32(1.0), k=cfg.allowed_k[0], greedy=greedy, keep=keep,
                                progress=progress)
        self._caches.put(target_cache, draft_cache)
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
