"""The speculative decoding loop (host side): prefill, then per step choose k and each request's
drafts, run the device step (propose -> score -> accept -> commit, ``device_step``), fetch its summary
once, advance the requests and adapt.

    target, draft = scv_jax.models.load_demo()
    decoder = scv_jax.SpeculativeDecoder(target, draft, config=scv_jax.DecoderConfig(k=4))
    out = decoder.generate([list(b"def main(")], max_new_tokens=64)
    out.tokens[0], out.stats.tokens_per_second

    ngram = scv_jax.SpeculativeDecoder(target, scv_jax.NgramDrafter(min_n=1, max_n=3))  # or "ngram"

All per-request state (tokens, lags, block tables) lives on the host in arrays (``RequestBatch``);
the device holds the two paged caches and the model weights. Each step is one call into a
graph-mode executable (its inputs built at bucket size, its bucket planned once per shape) and one
batched device-to-host fetch of the emitted tokens. With ``mesh=`` the weights, caches and batch are
spread over a device mesh (``placement``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from scv_jax.adaptive.controller import AdaptiveController, ControllerConfig
from scv_jax.arguments import require_int
from scv_jax.decoding.block_pool import BlockPool
from scv_jax.decoding.caches import ModelCaches
from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.device_step import SplitModel, StepRow
from scv_jax.decoding.executables import step_executables
from scv_jax.decoding.ngram import NgramDrafter, NgramIndex, UnverifiedProposals, draft_grid, propose_batch
from scv_jax.decoding.placement import BatchRows, OnMesh, ShardingConfig, SingleDevice
from scv_jax.decoding.positions import catch_up_rows
from scv_jax.decoding.requests import RequestBatch, check_eos, check_prompts, check_seed
from scv_jax.decoding.stats import AcceptanceTally, GenerateStats
from scv_jax.decoding.step_inputs import decode_inputs, prefill_chunks
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.graph.executable_cache import BucketPlan, ExecutableCache, GraphModeStats
from scv_jax.ops.registry import cuda_available

logger = logging.getLogger(__name__)

PREFILL_PROGRESS_SECONDS = 2.0   # a prefill running longer than this reports its progress on stderr
# the decode step's dynamic arguments that every call gives
_DECODE_ALWAYS = ("target_params", "target_cache", "block_tables", "rows", "base_key", "temperature")


def _base_key(seed: int) -> jax.Array:
    """uint32[2] the key data of ``seed``'s random stream, on the device (``warmup`` compiles it)."""
    return jax.random.key_data(jax.random.key(seed))


class GenerateOutput(NamedTuple):
    """tokens: the generated tokens of each prompt (prompt excluded, EOS included); stats."""

    tokens: list[list[int]]
    stats: GenerateStats


def _vocab_size(model: Any, name: str) -> int:
    """The vocabulary size of a ``PagedModel``."""
    config = getattr(model, "config", None)
    if not hasattr(model, "forward_paged") or config is None:
        hint = ", an NgramDrafter or \"ngram\"" if name == "draft" else ""
        raise TypeError(f"SpeculativeDecoder: {name} must implement scv_jax.models.PagedModel "
                        f"(forward_paged and config){hint}, got {type(model).__name__}")
    return config.vocab_size


def _is_temperature(value: Any) -> bool:
    """Whether ``value`` is a sampling temperature: a finite real number >= 0 (0 = greedy)."""
    return isinstance(value, (int, float, np.floating)) and math.isfinite(value) and value >= 0


def _max_positions(*models: Any) -> int | None:
    """The fewest ``config.max_position_embeddings`` (positions a model was trained for) of ``models``
    that declare one; None when none does."""
    limits = [getattr(getattr(m, "config", None), "max_position_embeddings", None) for m in models]
    return min((n for n in limits if n is not None), default=None)


@dataclasses.dataclass
class _Call:
    """What one ``generate`` call's steps share."""

    state: RequestBatch
    base_key: jax.Array                   # uint32[2] on the device
    temperature: jax.Array                # float32 scalar on the device
    greedy: bool
    eos_token_id: tuple[int, ...]        # () for none
    on_tokens: Callable[[int, list[int]], None] | None
    request_ids: np.ndarray               # int64[R] the controller's ids of the requests (unique per decoder)
    ngram: list[NgramIndex | None] | None  # each request's n-gram index, built when it starts running
    controller: AdaptiveController | None
    stats: GenerateStats
    tally: AcceptanceTally
    # (rows, their request ids, their batch layout), reused while the same requests run
    step_ids: tuple[np.ndarray | None, np.ndarray | None, BatchRows | None] = (None, None, None)
    observed: tuple | None = None          # the last step's counts and time, for the controller
    decided: tuple[int, int] | None = None  # (batch, k) the controller chose for the next step
    unverified: UnverifiedProposals | None = None   # n-gram proposals of a k = 0 step, checked later


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with a drafter (or plain decoding without one).

    ``draft`` is a draft model (a ``scv_jax.models.PagedModel`` with the target's vocabulary), an
    ``NgramDrafter`` (prompt lookup; ``"ngram"`` is ``NgramDrafter()``), or None. Models are split
    once; the step functions are pure functions of their parameters, compiled per shape bucket by
    ``ExecutableCache``. Greedy output equals autoregressive decoding of the target token for token;
    with temperature > 0, rejection sampling keeps the target's distribution.

    ``mesh``: a ``jax.sharding.Mesh`` with axes ("data", "model") (e.g. ``scv_jax.decoder_mesh(2, 4)``)
    to run on: the target tensor-parallel over "model", requests and their cache blocks split over
    "data" (``scv_jax.decoding.placement``; both models must then be ``scv_jax.models.Transformer`` instances).
    ``sharding``: a ``ShardingConfig`` (draft placement, vocabulary-parallel embeddings) for the mesh.
    """

    def __init__(self, target, draft=None, *, config: DecoderConfig | None = None, mesh=None,
                 sharding: ShardingConfig | None = None):
        self.config = config or DecoderConfig()
        self.vocab_size = _vocab_size(target, "target")
        self.max_position_embeddings = _max_positions(target, draft)
        if isinstance(draft, str):
            if draft != "ngram":
                raise ValueError(f'SpeculativeDecoder: draft must be a model, an NgramDrafter or "ngram", '
                                 f"got {draft!r}")
            draft = NgramDrafter()
        self.drafter = draft if isinstance(draft, NgramDrafter) else None
        draft_model = None if self.drafter else draft
        if draft_model is not None:
            draft_vocab = _vocab_size(draft_model, "draft")
            if draft_vocab != self.vocab_size:
                raise ValueError(f"SpeculativeDecoder: draft vocab_size {draft_vocab} != target vocab_size "
                                 f"{self.vocab_size}")
        elif self.drafter is None and (self.config.adaptive or self.config.k):
            self.config = dataclasses.replace(self.config, k=0, adaptive=False)
        cfg = self.config
        if cfg.backend == "pallas" and not cuda_available():
            raise ValueError(f"SpeculativeDecoder: DecoderConfig.backend='pallas' needs a CUDA GPU (JAX's default "
                             f"backend is {jax.default_backend()!r}); use 'auto', 'xla', or 'interpret' on CPU")
        if cfg.packed_verify and (mesh is not None or not hasattr(target, "forward_packed")):
            raise ValueError("SpeculativeDecoder: DecoderConfig.packed_verify needs one device (no mesh) and a "
                             "target with forward_packed (scv_jax.models.Transformer has it)")
        if mesh is None and sharding is not None:
            raise ValueError("SpeculativeDecoder: sharding is for a mesh; pass mesh= too")
        self.placement = SingleDevice(cfg) if mesh is None else OnMesh(mesh, cfg, sharding)
        target_placed, draft_placed = self.placement.split(target, "target"), self.placement.split(draft_model, "draft")
        self._target, self._target_params = SplitModel.of(target_placed.graphdef, target_placed.state)
        self._draft, self._draft_params = (SplitModel.of(draft_placed.graphdef, draft_placed.state)
                                           if draft_model is not None else (None, None))
        self.pool = self.placement.pool
        self._caches = ModelCaches(cfg.num_blocks, cfg.block_size, cfg.cache_dtype, target_placed.cache_dims,
                                   draft_placed.cache_dims, factory=self.placement.new_cache)
        # every drafter may run a k = 0 step: at the end of a budget, when no n-gram matches, or by choice
        self._step_ks = tuple(sorted(set(cfg.allowed_k) | {0}))
        self._packed_ks = self._packed_draft_counts()
        self._prefill, self._decode = step_executables(cfg, self._target, self._draft, self._step_ks, self.placement)
        self._plans: dict[tuple, BucketPlan] = {}
        self._next_request_id = 0
        self._warmed_up = False
        self._reported: set[str] = set()      # compilations after warm-up already logged
        # one controller per kind of step: greedy and sampled steps are different executables, with
        # different costs and acceptance
        self.controllers = {"greedy": self._make_controller(), "sampling": self._make_controller()} \
            if cfg.adaptive else {}

    @property
    def graph_stats(self) -> dict[str, GraphModeStats]:
        """Graph-mode counters of the prefill and decode executables (hits, compiles, donations, ...)."""
        return {"prefill": self._prefill.stats, "decode": self._decode.stats}

    def _make_controller(self) -> AdaptiveController:
        cfg = self.config
        base = cfg.controller or ControllerConfig()
        allowed = cfg.allowed_k
        return AdaptiveController(dataclasses.replace(
            base, k_min=allowed[0], k_max=allowed[-1], allowed_k=allowed,
            k_init=base.k_init if base.k_init in allowed else allowed[-1]))

    # ------------------------------------------------------------------ checks
    def _check_request(self, prompts: list[list[int]], max_new_tokens: int,
                       max_num_seqs: int | None) -> list[BlockPool]:
        """The block pool of each request; raises before anything runs when the requests (at most
        ``max_num_seqs`` running at once) cannot fit the caches. Drafts never outrun a request's
        budget, so a request writes at most prompt + max_new_tokens - 1 cache positions."""
        cfg = self.config
        longest = max(len(p) for p in prompts) + max_new_tokens - 1
        limit = self.max_position_embeddings
        if limit is not None and longest + 1 > limit:
            row = max(range(len(prompts)), key=lambda i: len(prompts[i]))
            raise ValueError(f"generate: prompt {row} ({len(prompts[row])} tokens) + max_new_tokens {max_new_tokens} "
                             f"= {longest + 1} positions exceed the model's max_position_embeddings {limit}")
        if longest > cfg.max_seq_len:
            raise ValueError(f"generate: a request needs up to {longest} cache positions (prompt "
                             f"{max(len(p) for p in prompts)} + max_new_tokens {max_new_tokens} - 1) but "
                             f"DecoderConfig.max_seq_len is {cfg.max_seq_len}")
        return self.pool.assign([-(-(len(p) + max_new_tokens - 1) // cfg.block_size) for p in prompts],
                                max_num_seqs)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, eos_token_id: int | Sequence[int] | None = None, *,
                 max_num_seqs: int | None = None, progress: bool = False,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerateOutput:
        """Generates up to ``max_new_tokens`` tokens for each prompt (a batch of any lengths).

        A request stops at ``max_new_tokens`` or after emitting an ``eos_token_id`` (one id or a
        sequence of ids, e.g. Llama-3-Instruct's three); its KV blocks go back to the pool. A prompt
        plus ``max_new_tokens`` may not exceed the models' ``config.max_position_embeddings`` (where
        they declare one). ``temperature`` 0 is greedy; otherwise sampling with ``seed``, an int in
        [0, 2**32) (same seed, same output). ``max_num_seqs``: at most that many requests decode at
        once (continuous batching: the others wait, in order, and each is prefilled and joins the
        running batch as soon as a running request finishes; None: all at once). Either way at most
        the largest batch bucket run at once (``DecoderConfig.batch_buckets``; on a mesh, its share
        per data shard): a step never outgrows the compiled executables. ``progress``: report the
        prefill of long prompts on stderr. ``on_tokens(prompt_index, new_tokens)``: called after
        each step for each request that emitted tokens (streaming; the tokens of
        ``GenerateOutput.tokens``, in order; an exception it raises stops the call).
        """
        require_int("generate", "max_new_tokens", max_new_tokens, minimum=1)
        if not _is_temperature(temperature):
            raise ValueError(f"generate: temperature must be a finite float >= 0, got {temperature!r}")
        eos_token_id, seed = check_eos(eos_token_id, self.vocab_size), check_seed(seed)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"generate: on_tokens must be None or a callable(prompt_index, tokens), got {on_tokens!r}")
        if max_num_seqs is not None:
            require_int("generate", "max_num_seqs", max_num_seqs, minimum=1)
        prompt_ids = check_prompts(prompts, self.vocab_size)
        largest = self._decode.dims["batch"].largest
        running = largest if max_num_seqs is None else min(max_num_seqs, largest)
        pools = self._check_request(prompt_ids, max_new_tokens, running)
        cfg = self.config
        state = RequestBatch(prompt_ids, int(max_new_tokens), pools, [self.pool.shard_of(p) for p in pools],
                             cfg.block_size, cfg.max_blocks_per_seq, self._step_ks[-1], running,
                             largest // len(self.pool.shards))
        stats = GenerateStats(prompt_tokens=sum(len(p) for p in prompt_ids))
        first_id, self._next_request_id = self._next_request_id, self._next_request_id + len(prompt_ids)
        start = time.perf_counter()
        with CompileCounter() as compiles:
            try:
                base_key = _base_key(seed)   # before the prefill: no wait on it
                call = _Call(state, base_key, jax.device_put(np.float32(max(temperature, 1e-6))), temperature == 0.0,
                             eos_token_id, on_tokens,
                             first_id + np.arange(len(prompt_ids)),
                             [None] * len(prompt_ids) if self.drafter else None,
                             self.controllers.get("greedy" if temperature == 0 else "sampling"), stats,
                             AcceptanceTally(max(cfg.allowed_k)))
                self._start_running(call, state.active, prompt_ids, progress=progress)
                while state.active.size:
                    self._step(call, state.active)
                    if state.waiting.size and state.active.size < running:     # continuous batching
                        admitted = state.admit(running - state.active.size)
                        if admitted.size:
                            self._start_running(call, admitted, prompt_ids)
                if call.controller:
                    self._observe(call)
            finally:
                state.release(np.arange(len(prompt_ids)))
        stats.wall_seconds = time.perf_counter() - start
        stats.compile_count = compiles.count
        # the step executables' compilations are listed by bucket (``_run``) and logged by their cache
        steps = {self._prefill.jit_name, self._decode.jit_name}
        others = [name for name in compiles.names if name not in steps]
        stats.compiled += others
        for name in others if self._warmed_up else ():
            if name not in self._reported:
                self._reported.add(name)
                logger.warning("generate: compiled %s after warm-up (a computation warm-up did not cover)", name)
        outputs = state.outputs()
        stats.generated_tokens = sum(map(len, outputs))
        stats.tokens_per_second = stats.generated_tokens / max(stats.wall_seconds - stats.compile_seconds, 1e-9)
        call.tally.fill(stats)
        return GenerateOutput(outputs, stats)

    def _start_running(self, call: _Call, rows: np.ndarray, prompts: list[list[int]], *,
                       progress: bool = False) -> None:
        """Starts requests ``rows``: commits their prompts but the last token to both caches (the time
        goes to ``stats.prefill_seconds``) and, with n-gram drafting, indexes them."""
        begin = time.perf_counter()
        state = call.state
        self._prefill_rows(state, rows, np.zeros(rows.size, np.int64), state.prompt_len[rows] - 1, call.stats,
                           draft_only=False, progress=progress)
        if call.ngram is not None:
            for row in rows.tolist():
                call.ngram[row] = self.drafter.index(prompts[row])
        call.stats.prefill_seconds += time.perf_counter() - begin

    def _prefill_rows(self, state: RequestBatch, rows: np.ndarray, begin: np.ndarray, count: np.ndarray,
                      stats: GenerateStats, *, draft_only: bool, progress: bool = False) -> None:
        """Commits tokens [begin[b], begin[b] + count[b]) of each request to both caches (the draft's
        alone with ``draft_only``), ``prefill_chunk`` tokens a call."""
        state.ensure(rows, begin + count)
        longest = int(count.max(initial=0))
        start = reported = time.perf_counter()
        for done, sub, inputs in prefill_chunks(state, rows, begin, count, self.config.prefill_chunk):
            layout = self.placement.rows(state.shards[sub], self._prefill)
            self._run(self._prefill, stats, use_target=not draft_only, use_draft=self._draft is not None,
                      **layout.arrange(self._prefill, **inputs))
            if done >= longest:      # wait for the last chunk: its time is the prefill's, not the next step's
                caches = self._caches.take()
                self._caches.put(*jax.block_until_ready(caches))
            now = time.perf_counter()
            if progress and now - reported > PREFILL_PROGRESS_SECONDS:
                reported = now
                print(f"prefill: {min(done, longest)}/{longest} prompt tokens "
                      f"({now - start:.1f} s, compiling {stats.compile_seconds:.1f} s of it)",
                      file=sys.stderr, flush=True)

    def _run(self, executable: ExecutableCache, stats: GenerateStats, *, use_target: bool = True,
             use_draft: bool, plan: BucketPlan | None = None, **args):
        """One donating call with the models it uses (the others' params and caches are None and their
        caches kept); returns its other outputs. ``plan``: arguments at bucket size, ``call_planned``.
        Time spent compiling goes to ``stats.compile_seconds``."""
        target_cache, draft_cache = self._caches.take()
        args.update(target_params=self._target_params if use_target else None,
                    target_cache=target_cache if use_target else None,
                    draft_params=self._draft_params if use_draft else None,
                    draft_cache=draft_cache if use_draft else None, backend=self.config.backend)
        start = time.perf_counter()
        if plan is None:
            new_target, new_draft, *outputs = executable(**args)
        else:
            new_target, new_draft, *outputs = executable.call_planned(
                plan, [args.get(name) for name in executable.dynamic_argnames])
        if executable.last_call_compiled:
            stats.compile_seconds += time.perf_counter() - start
            stats.compiled.append(executable.last_call_shape)
        why = executable.last_call_fallback
        if why:
            stats.fallbacks[executable.last_call_shape] = why
        self._caches.put(new_target if use_target else target_cache, new_draft if use_draft else draft_cache)
        return outputs

    def _step_k(self, most_drafts: int) -> int:
        """The smallest compiled k that holds ``most_drafts`` drafts."""
        return next(k for k in self._step_ks if k >= most_drafts)

    def _decode_plan(self, batch: int, width: int, k: int, greedy: bool, masked: bool,
                     packed_k: int = 0) -> BucketPlan:
        """The decode executable's bucket for a step's sizes (planned once per shape); ``masked``: the
        step gives its own request mask (a batch laid out over a mesh's data shards)."""
        key = (batch, width, k, greedy, masked, packed_k)
        plan = self._plans.get(key)
        if plan is None:
            given = _DECODE_ALWAYS + (("draft_params", "draft_cache") if self._draft is not None and k else ()) \
                + (("drafts",) if self.drafter else ()) + (("request_mask",) if masked else ())
            plan = self._plans[key] = self._decode.plan_sizes(
                {"batch": batch, "blocks": width}, given, k=k, greedy=greedy, backend=self.config.backend,
                packed_k=packed_k)
        return plan

    def _packed_draft_counts(self) -> tuple[int, ...]:
        """The drafts per row a packed step may score, ascending: 1 and an adaptive decoder's other k
        values (the controller's cost table then times most packed steps as one of its shapes), else
        the powers of two below k; none without ``packed_verify``."""
        cfg = self.config
        if not cfg.packed_verify:
            return ()
        if cfg.adaptive:
            return tuple(sorted({1, *self._step_ks[1:]}))
        return tuple(1 << i for i in range((cfg.k - 1).bit_length())) if cfg.k else ()

    def _packed_k(self, num_drafts: np.ndarray, batch: int, step_k: int) -> int:
        """A packed step's ``packed_k`` for these drafts at a padded batch of ``batch`` rows: their mean per
        row rounded up to one of ``_packed_ks``, or 0 (a dense step) when packing is off or saves nothing."""
        mean = int(num_drafts.sum()) / batch
        return next((k for k in self._packed_ks if mean <= k < step_k), 0)

    def _step(self, call: _Call, rows: np.ndarray) -> None:
        step_start = time.perf_counter()
        state, stats = call.state, call.stats
        if call.step_ids[0] is not rows:        # the same requests as the last step: the same layout and ids
            call.step_ids = (rows, call.request_ids[rows], self.placement.rows(state.shards[rows], self._decode))
        _, ids, layout = call.step_ids
        batch = layout.computed
        # the controller sees the batch the executable computes (padding rows cost like real ones); it
        # chose k during the last step's device time, unless the batch changed
        controller = call.controller
        budget = state.budget[rows]                        # tokens each request has left (until this step ends)
        # the controller's objective: while requests wait for a slot (continuous batching) the stream's
        # tokens per second; once none wait, the progress of the request that will finish last
        remaining = None if state.waiting.size else budget
        if controller is None:
            k = self.config.k
        elif call.decided is not None and call.decided[0] == batch:
            k = call.decided[1]
        else:
            self._observe(call)
            k = controller.next_k(batch, ids, remaining)
        caps = np.minimum(budget - 1, k)                   # never draft past a request's budget
        proposals = propose_batch([call.ngram[r] for r in rows.tolist()], caps) if call.ngram else None
        num_drafts = caps if proposals is None else np.array([len(p) for p in proposals], np.int64)
        step_k = self._step_k(int(num_drafts.max()))
        if self._draft is not None and step_k and state.may_lag:
            self._catch_up(state, rows, stats)
        state.ensure(rows, state.length[rows] + num_drafts)
        width = int(state.num_blocks[rows].max())
        planning = time.perf_counter()
        plan = self._decode_plan(layout.size, width, step_k, call.greedy, layout.scattered)
        size = plan.padded["batch"] or layout.size
        packed_k = self._packed_k(num_drafts, size, step_k)
        if packed_k:
            plan = self._decode_plan(layout.size, width, step_k, call.greedy, layout.scattered, packed_k)
        step_start += time.perf_counter() - planning     # a shape's one-off planning is no step cost
        inputs = decode_inputs(state, rows, layout.rows, size, plan.padded["blocks"] or width, num_drafts)
        if proposals is not None:
            inputs["drafts"] = draft_grid(proposals, layout.rows, size, step_k)
        if layout.scattered:
            inputs["request_mask"] = np.zeros(size, np.bool_)
            inputs["request_mask"][layout.rows] = True
        scored = size * (packed_k + 1) if packed_k else None      # tokens a packed step's target scores
        dispatch = time.perf_counter()
        (summary,) = self._run(self._decode, stats, use_draft=self._draft is not None and step_k > 0, plan=plan,
                               base_key=call.base_key, temperature=call.temperature, **inputs)
        if controller:     # while the device runs this step: learn from the last one, choose the next k
            self._observe(call)
            call.decided = (batch, controller.next_k(batch, ids, remaining))
        host = layout.fetch(summary)                      # the step's one device-to-host transfer
        cold = self._decode.last_call_first_run        # compiled now or ahead of time, never run
        fetched = time.perf_counter()
        step_seconds = fetched - step_start
        appended = state.advance(rows, host.output_token_ids, host.num_emitted, host.num_accepted, step_k,
                                 call.eos_token_id)
        if call.ngram or call.on_tokens:
            for row, count in zip(rows.tolist(), appended.tolist()):
                new = state.tokens[row, state.length[row] - count:state.length[row]].tolist()
                if call.ngram:
                    call.ngram[row].extend(new)
                if call.on_tokens and new:
                    call.on_tokens(row, new)
        if controller:   # a compile or an executable's first run is no step cost: leave that step untimed
            # the controller's acceptance counts a draft the drafter could not offer (no n-gram match,
            # a short one) as a rejection at that position: E(k) is then what a step of k really emits
            counts = (np.minimum(caps, step_k), host.num_accepted)
            if call.ngram:
                counts = self._check_unverified(call, rows, step_k) or counts
            # (k as chosen, or as far as the budgets let it draft: a step that ends them costs less)
            call.observed = (*counts, None if cold else step_seconds, batch, ids, int(caps.max(initial=0)))
        call.tally.add(num_drafts, host.num_accepted, host.num_emitted)
        stats.add_step(batch, step_k, None if cold else step_seconds + time.perf_counter() - fetched,
                       dispatch - step_start + time.perf_counter() - fetched, scored)

    def _check_unverified(self, call: _Call, rows: np.ndarray, step_k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """n-gram drafting at a k = 0 step (the controller's choice, or the budgets' end): the counterfactual
        (offered, accepted) of ``rows`` once the proposals made some k = 0 steps ago can be checked
        (``UnverifiedProposals``; the controller learns acceptance from them while it holds k = 0), and
        new proposals to check. None while none is due; a step with drafts drops them (it counts its own)."""
        state, pending = call.state, call.unverified
        if step_k:
            call.unverified = None
            return None
        counts = None
        if pending is not None:
            pending.due -= 1
            if pending.due > 0:
                return None
            offered, accepted = np.zeros((2, state.length.shape[0]), np.int64)
            offered[pending.rows], accepted[pending.rows] = pending.check(state.tokens, state.length)
            counts = offered[rows], accepted[rows]
        active = state.active
        call.unverified = UnverifiedProposals.propose(
            [call.ngram[r] for r in active.tolist()], active, state.length[active],
            np.minimum(state.budget[active] - 1, self._step_ks[-1]))
        return counts

    @staticmethod
    def _observe(call: _Call) -> None:
        """Tells the controller about the last step (if not yet told)."""
        if call.observed is not None:
            drafts, accepted, seconds, batch, ids, k = call.observed
            call.controller.update(drafts, accepted, seconds, batch, ids, k=k)
            call.observed = None

    def _catch_up(self, state: RequestBatch, rows: np.ndarray, stats: GenerateStats) -> None:
        """Before a step that runs the draft: commits the tokens that k = 0 steps left out of the draft
        cache (``positions.catch_up_rows``), so every lag is at most ``MAX_CATCH_UP``."""
        missing = catch_up_rows(state.lag[rows])
        lagging = missing > 0
        if lagging.any():
            behind = rows[lagging]
            self._prefill_rows(state, behind, state.length[behind] - state.lag[behind], missing[lagging], stats,
                               draft_only=True)
            state.lag[behind] = 1
            stats.catch_up_calls += 1
        state.may_lag = False

    # ------------------------------------------------------------------ measurement
    def device_seconds_per_step(self, batch_size: int, k: int, *, greedy: bool = True, context: int | None = None,
                                calls: int = 20, repeats: int = 5) -> float:
        """Seconds per decode step of one shape (``batch_size`` requests, static ``k``) with no host work
        around it: the step's executable alone, called on device-resident inputs and waited for, median
        over ``repeats`` runs of the mean of ``calls`` calls. ``context``: each request's cache length
        (default: half the longest). A step's wall time in ``generate`` minus this is the host's share
        of the step."""
        cfg = self.config
        context = cfg.max_seq_len // 2 if context is None else context
        width = -(-(context + k + 1) // cfg.block_size)
        if k not in self._step_ks or width > cfg.max_blocks_per_seq:
            raise ValueError(f"device_seconds_per_step: k must be one of {self._step_ks} and context + k + 1 "
                             f"<= max_seq_len {cfg.max_seq_len}, got k={k}, context={context}")
        masked = isinstance(self.placement, OnMesh)
        plan = self._decode_plan(batch_size, width, k, greedy, masked)
        batch, padded_width = plan.padded["batch"] or batch_size, plan.padded["blocks"] or width
        blocks = np.full((batch, padded_width), -1, np.int32)
        blocks[:, :width] = np.arange(batch * width, dtype=np.int32).reshape(batch, width) % cfg.num_blocks
        rows = np.ones((batch, StepRow.WIDTH), np.int32)
        rows[:, StepRow.CONTEXT], rows[:, StepRow.NUM_DRAFTS] = context, k
        rows[:, StepRow.REQUEST_ID] = np.arange(batch)
        args = dict(block_tables=blocks, rows=rows, base_key=np.zeros(2, np.uint32), temperature=np.float32(1.0))
        if masked:
            args["request_mask"] = np.ones(batch, np.bool_)
        if self.drafter is not None:
            args["drafts"] = np.ones((batch, k), np.int32)
        args = {name: jax.device_put(value) for name, value in args.items()}
        stats = GenerateStats()
        self._run(self._decode, stats, use_draft=self._draft is not None and k > 0, plan=plan, **args)  # compiles
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                (summary,) = self._run(self._decode, stats, use_draft=self._draft is not None and k > 0, plan=plan,
                                       **args)
                summary.packed.block_until_ready()
            samples.append((time.perf_counter() - start) / calls)
        return float(np.median(samples))

    # ------------------------------------------------------------------ warm-up
    def warmup(self, batch_sizes: int | Sequence[int], max_len: int, *,
               temperatures: float | Sequence[float] = 0.0, progress: bool = False) -> int:
        """Compiles ahead of time every executable that ``generate`` runs for up to ``max(batch_sizes)``
        requests at once (its ``max_num_seqs``, or its number of prompts) of up to ``max_len`` positions
        (prompt + max_new_tokens - 1) at ``temperatures`` (0: greedy steps; > 0: sampled ones): the
        prefill and every k's decode step at every batch bucket and block-table width up to those sizes'
        (a batch shrinks as requests finish and admits waiting ones in smaller groups; a request's width
        grows with it), with ``packed_verify`` each k's packed steps, the draft's catch-up prefill when
        k = 0 can be chosen, and the seed's key. Counts the executables before compiling them (with
        ``progress``: one line on stderr, then one per executable); returns the XLA compilations.
        A ``generate`` within these sizes then compiles nothing (``GenerateStats.compiled`` is empty)."""
        cfg = self.config
        sizes = [batch_sizes] if isinstance(batch_sizes, (int, np.integer)) else list(batch_sizes)
        temperatures = ([temperatures] if isinstance(temperatures, (int, float, np.floating))
                        else list(temperatures))
        if not sizes or not temperatures or not all(map(_is_temperature, temperatures)):
            raise ValueError(f"warmup: batch_sizes and temperatures must be non-empty, temperatures finite "
                             f"floats >= 0; got batch_sizes={batch_sizes!r}, temperatures={temperatures!r}")
        for size in sizes:
            require_int("warmup", "batch_sizes", size, minimum=1)
        require_int("warmup", "max_len", max_len, minimum=1)
        kinds = sorted({t == 0 for t in temperatures}, reverse=True)     # greedy first
        # a running batch never exceeds the largest bucket (``generate``)
        batch_bucket = self._decode.bucket("batch", min(max(sizes), self._decode.dims["batch"].largest))
        block_bucket = self._decode.bucket("blocks", -(-max_len // cfg.block_size))
        if block_bucket is None:
            raise ValueError(f"warmup: max_len {max_len} exceeds DecoderConfig.max_seq_len {cfg.max_seq_len}")
        fits = lambda s: s["batch"] <= batch_bucket and s["blocks"] <= block_bucket  # noqa: E731
        target_cache, draft_cache = self._caches.take()
        tables = np.zeros((1, 1), np.int32)
        models = dict(target_params=self._target_params, target_cache=target_cache, backend=cfg.backend,
                      **self.placement.warmup_args())
        draft = dict(draft_params=self._draft_params, draft_cache=draft_cache)
        prefill = dict(block_tables=tables, tokens=np.zeros((1, cfg.prefill_chunk), np.int32),
                       start=np.zeros(1, np.int32), count=np.zeros(1, np.int32), keep=fits)
        calls = [(self._prefill, {**models, **draft, **prefill})]
        if cfg.adaptive and self._draft is not None and 0 in cfg.allowed_k:
            calls.append((self._prefill, {**models, "target_params": None, "target_cache": None, **draft, **prefill}))
        no_draft = dict(draft_params=None, draft_cache=None)
        for greedy in kinds:
            for k in self._step_ks:
                step = dict(block_tables=tables, rows=np.zeros((1, StepRow.WIDTH), np.int32),
                            base_key=np.zeros(2, np.uint32), temperature=np.float32(1.0), k=k, greedy=greedy,
                            keep=lambda s, k=k: s["k"] == k and fits(s))
                if self.drafter is not None:
                    step["drafts"] = np.zeros((1, k), np.int32)
                for packed_k in (0, *(p for p in self._packed_ks if p < k)):
                    calls.append((self._decode, {**models, **(draft if self._draft is not None and k else no_draft),
                                                 **step, "packed_k": packed_k}))
        pending = [len(executable.pending(**args)) for executable, args in calls]
        if progress:
            batches = [b for b in self._decode.dims["batch"].sizes if b <= batch_bucket]
            widths = [w for w in self._decode.dims["blocks"].sizes if w <= block_bucket]
            decode = sum(n for (executable, _), n in zip(calls, pending) if executable is self._decode)
            print(f"warm-up: {sum(pending)} executables to compile: {decode} decode steps (k {self._step_ks} x "
                  f"batch buckets {tuple(batches)} x block-table widths {tuple(widths)} x "
                  f"{' and '.join('greedy' if greedy else 'sampled' for greedy in kinds)}"
                  f"{' x packed_k' if self._packed_ks else ''}), {sum(pending) - decode} prefills",
                  file=sys.stderr, flush=True)
        with CompileCounter() as compiles:
            _base_key(0)
            for executable, args in calls:
                executable.warmup(**args, progress=progress)
        self._caches.put(target_cache, draft_cache)
        self._warmed_up = True
        return compiles.count


def generate_autoregressive(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                            temperature: float = 0.0, seed: int = 0,
                            eos_token_id: int | Sequence[int] | None = None,
                            *, config: DecoderConfig | None = None) -> GenerateOutput:
    """Plain decoding of ``model`` through the same paged-cache code (the baseline).

    Builds a ``SpeculativeDecoder(model, None)``; to decode repeatedly without recompiling, build one
    yourself and call its ``generate``.
    """
    decoder = SpeculativeDecoder(model, None, config=config)
    return decoder.generate(prompts, max_new_tokens, temperature, seed, eos_token_id)
