"""``StepRunner``: the device side of decoding. It splits the models once (placed on one device or a
mesh), owns their paged caches (donated to every call and handed back), the prefill and decode
executables (graph mode: compiled per shape bucket) and their bucket plans, and on one device the
logit-control state (``ControlState``: each request row's bias, token history and bad words, donated to
every decode step); with ``DecoderConfig.overlap`` a decode step also takes and returns its engine's carry
(``decoding.carry``: what each request's last step did, for a step dispatched before that one is
fetched); runs a ``PrefillWork`` in chunks, and a ``DecodeWork`` as one executable call
(``dispatch``, not waited for) and one batched device-to-host transfer (``fetch``), timing both; compiles
ahead of time (``warmup``).

The adaptive controllers live here too, one per kind of step (greedy and sampled steps are different
executables, with different costs): they outlive the engines that run on one decoder.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from scv_jax.adaptive.controller import AdaptiveController, ControllerConfig
from scv_jax.arguments import require_int
from scv_jax.decoding.block_pool import prefix_root
from scv_jax.decoding import carry
from scv_jax.decoding.caches import ModelCaches
from scv_jax.decoding.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DecoderConfig
from scv_jax.decoding.device_step import ControlState, SplitModel
from scv_jax.decoding.executables import step_executables
from scv_jax.decoding.grammar_automaton import MAX_GRAMMARS, TABLE_STATES, max_classes
from scv_jax.decoding.placement import BatchRows, OnMesh, ShardingConfig, SingleDevice
from scv_jax.decoding.plan import DecodeWork, PrefillWork, SamplingColumn, StepResult, StepRow
from scv_jax.decoding.proposers.base import Proposer
from scv_jax.decoding.requests import RequestBatch
from scv_jax.decoding.stats import GenerateStats
from scv_jax.decoding.head_step import HeadChainVerifier, HeadTreeVerifier
from scv_jax.decoding.chain_verifier import ChainVerifier
from scv_jax.decoding.step_inputs import decode_inputs, prefill_chunks
from scv_jax.decoding.tree_verifier import TreeVerifier
from scv_jax.graph.bucket_plan import BucketPlan
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.graph.compiler import CompileJob, Compiler, largest_first
from scv_jax.graph.executable_cache import ExecutableCache
from scv_jax.graph.stats import GraphModeStats
from scv_jax.ops.registry import cuda_available
from scv_jax.sampling_params import MAX_BAD_WORD_LEN
from scv_jax.sharding.processes import spans_processes

PREFILL_PROGRESS_SECONDS = 2.0   # a prefill running longer than this reports its progress on stderr
BACKGROUND_SWITCH_INTERVAL = 5e-4   # background compiles yield the interpreter lock (``Compiler.switch_interval``)
# Platforms whose executables ``start_warmup`` runs once on zeros after compiling (``Compiler.prime``):
# XLA:CPU's first run of a demo step costs 100-200 ms more than later ones (benchmarks/RESULTS.md).
PRIMED_PLATFORMS = ("cpu",)

# the decode step's dynamic arguments that every call gives
_DECODE_ALWAYS = ("target_params", "target_cache", "block_tables", "rows", "sampling")


def is_temperature(value: Any) -> bool:
    """Whether ``value`` is a sampling temperature: a finite real number >= 0 (0 = greedy)."""
    return isinstance(value, (int, float, np.floating)) and math.isfinite(value) and value >= 0


def kv_span(target, draft_model) -> int | None:
    """How far back (in positions) any layer of ``target`` and of ``draft_model`` (a draft model or an EAGLE
    head sharing its block tables, or None) attends: their largest sliding window when every layer of both
    has one (``config.layer_windows``), else None (some layer attends to every earlier position)."""
    spans = []
    for model in (target, draft_model):
        if model is None:
            continue
        windows = getattr(model.config, "layer_windows", None)
        if not windows or None in windows:
            return None
        spans.append(max(windows))
    return max(spans)


class PendingStep(NamedTuple):
    """A dispatched decode step: its work, batch layout, device outputs and timestamps."""

    work: DecodeWork
    layout: BatchRows
    outputs: list
    carry: Any                  # the engine's carry after the step (``decoding.carry``), or None
    scored: int | None          # tokens a packed step's target scored (None: dense)
    started: float              # the step's start (its planning excluded)
    dispatched: float


class StepRunner:
    """The models, caches and step executables of one decoder (see the module docstring).

    ``target``: a ``PagedModel``; ``draft_model``: the draft model or None; ``proposer``: the drafter's
    host half (its static k values and verifier); ``vocab_size``; ``max_position_embeddings``: the
    models' context (None: unknown); ``mesh``/``sharding``: as ``SpeculativeDecoder``. ``kv_span``: how
    far back any layer attends (``kv_span``), or None.
    """

    def __init__(self, target, draft_model, proposer: Proposer, config: DecoderConfig, *, vocab_size: int,
                 max_position_embeddings: int | None, mesh=None, sharding: ShardingConfig | None = None):
        cfg = self.config = config
        self.proposer, self.vocab_size, self.max_position_embeddings = proposer, vocab_size, max_position_embeddings
        if cfg.backend == "pallas" and not cuda_available():
            raise ValueError(f"SpeculativeDecoder: DecoderConfig.backend='pallas' needs a CUDA GPU (JAX's default "
                             f"backend is {jax.default_backend()!r}); use 'auto', 'xla', or 'interpret' on CPU")
        if mesh is None and sharding is not None:
            raise ValueError("SpeculativeDecoder: sharding is for a mesh; pass mesh= too")
        self.placement = SingleDevice(cfg) if mesh is None else OnMesh(mesh, cfg, sharding)
        target_placed, draft_placed = self.placement.split(target, "target"), self.placement.split(draft_model, "draft")
        self.target, self.target_params = SplitModel.of(target_placed.graphdef, target_placed.state)
        self.draft, self.draft_params = (SplitModel.of(draft_placed.graphdef, draft_placed.state)
                                         if draft_model is not None else (None, None))
        self.pool = self.placement.pool
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[
            "gpu" if cuda_available() else "cpu"]
        # prefix caching: what a cached block's contents depend on besides its tokens (one pool per decoder)
        self.prefix_root = None if cfg.enable_prefix_caching is False else prefix_root(
            f"target {target_placed.cache_dims} draft {draft_placed.cache_dims} vocab {vocab_size} cache "
            f"{cfg.cache_dtype} block {cfg.block_size} lookahead {proposer.lookahead}")
        head = proposer.every_step          # an EAGLE head: its cache a HeadCache, its verifiers head_step's
        self.caches = ModelCaches(cfg.num_blocks, cfg.block_size, cfg.cache_dtype, target_placed.cache_dims,
                                  draft_placed.cache_dims, factory=self.placement.new_cache,
                                  draft_features=(draft_model.config.d_model, draft_model.config.dtype) if head else None)
        self.kv_span = kv_span(target, draft_model)
        self.step_ks = proposer.step_ks
        self.packed_ks = self._packed_draft_counts()
        if head:
            aux_layers = tuple(draft_model.aux_layers)
            verifier = (HeadChainVerifier(aux_layers, proposer.max_lag) if proposer.verifier == "chain"
                        else HeadTreeVerifier(cfg.tree, aux_layers, proposer.max_lag))
        else:
            verifier = ChainVerifier() if proposer.verifier == "chain" else TreeVerifier(cfg.tree)
        self.prefill_executable, self.decode_executable = step_executables(
            cfg, self.target, self.draft, self.step_ks, self.placement, verifier, proposer.lag_after_step,
            proposer.max_lag)
        self._plans: dict[tuple, BucketPlan] = {}
        # the logit controls' state (replicated on a mesh), taken by each call and given back
        self._controls: ControlState | None = None
        self._control_writer = None
        self.overlaps = cfg.overlap          # one step in flight
        self.lock = threading.RLock()        # one step at a time (engines on this decoder, threads)
        self.warmed_up = False
        self.controllers = {"greedy": self._make_controller(), "sampling": self._make_controller()} \
            if cfg.adaptive else {}
        self._next_request_id = 0

    @property
    def graph_stats(self) -> dict[str, GraphModeStats]:
        """Graph-mode counters of the prefill and decode executables (hits, compiles, donations, ...)."""
        return {"prefill": self.prefill_executable.stats, "decode": self.decode_executable.stats}

    def uses_draft(self, k: int) -> bool:
        """Whether a decode step at ``k`` runs the drafter's device half (a draft model or head)."""
        return self.draft is not None and (k > 0 or self.proposer.every_step)

    @property
    def spans_processes(self) -> bool:
        """Whether the decoder's mesh holds devices of several processes."""
        return spans_processes(getattr(self.placement, "mesh", None))

    @property
    def largest_batch(self) -> int:
        """The largest batch bucket: the most requests a step runs."""
        return self.decode_executable.dims["batch"].largest

    def _make_controller(self) -> AdaptiveController:
        cfg = self.config
        base = cfg.controller or ControllerConfig()
        allowed = cfg.allowed_k
        return AdaptiveController(dataclasses.replace(
            base, k_min=allowed[0], k_max=allowed[-1], allowed_k=allowed,
            k_init=base.k_init if base.k_init in allowed else allowed[-1]))

    def new_request_id(self) -> int:
        """A new id for the controller's per-request state (unique over this runner's requests)."""
        self._next_request_id += 1
        return self._next_request_id

    # ------------------------------------------------------------------ logit controls
    def _take_controls(self) -> ControlState:
        """The control state for one donating call, which gives it back (zeros the first time, or after a
        call that failed with it: the requests in flight were lost with the caches; replicated on a mesh)."""
        state, self._controls = self._controls, None
        if state is None:
            return self.placement.create_replicated(lambda: ControlState.zeros(self.largest_batch, self.vocab_size))
        return state

    def new_carry(self) -> jax.Array | None:
        """A carry for an engine's steps (``decoding.carry``; None when steps do not overlap)."""
        return self.placement.replicated(carry.zeros(self.largest_batch)) if self.overlaps else None

    def _writer(self):
        """``ControlState.write`` compiled once (ahead of time: at warm-up, or the first request with controls)."""
        if self._control_writer is None:
            self._controls = self._take_controls()
            state = _abstract(self._controls)     # (its shardings: replicated on a mesh)
            vector = lambda dtype: jax.ShapeDtypeStruct((self.vocab_size,), dtype)  # noqa: E731
            self._control_writer = jax.jit(
                ControlState.write, donate_argnums=0, out_shardings=jax.tree.map(lambda x: x.sharding, state)).lower(
                state, jax.ShapeDtypeStruct((), np.int32), vector(np.float32), vector(np.int32),
                jax.ShapeDtypeStruct(state.words.shape[1:], np.int32),
                jax.ShapeDtypeStruct(state.recent.shape[1:], np.int32)).compile()
        return self._control_writer

    def write_controls(self, batch: RequestBatch, rows: np.ndarray) -> None:
        """Writes the control-state rows of the requests admitted at ``rows`` that have controls: their
        bias, bad words of several tokens, and the history of their prompt and of their output so far (a
        request resuming after a preemption has some)."""
        recent_len = MAX_BAD_WORD_LEN - 1
        for row in rows.tolist():
            params = batch.controls[row]
            if params is None:
                continue
            prompt_len, length = int(batch.prompt_len[row]), int(batch.length[row])
            output = batch.tokens[row, prompt_len:length]
            history = 2 * np.bincount(output, minlength=self.vocab_size).astype(np.int32)
            history[batch.tokens[row, :prompt_len]] += 1
            recent = np.full(recent_len, -1, np.int32)
            if recent_len and output.size:
                last = output[-recent_len:]
                recent[recent_len - last.size:] = last
            self._controls = self._writer()(self._take_controls(), np.int32(row), params.bias_row(self.vocab_size),
                                            history, params.bad_word_table(), recent)

    # ------------------------------------------------------------------ calls
    def _call(self, executable: ExecutableCache, stats: GenerateStats, *, use_target: bool = True,
              use_draft: bool, plan: BucketPlan | None = None, **args):
        """One donating call with the models it uses (the others' params and caches are None and their
        caches kept); returns its other outputs. ``plan``: arguments at bucket size, ``call_planned``.
        Time spent compiling goes to ``stats.compile_seconds``."""
        target_cache, draft_cache = self.caches.take()
        args.update(target_params=self.target_params if use_target else None,
                    target_cache=target_cache if use_target else None,
                    draft_params=self.draft_params if use_draft else None,
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
        self.caches.put(new_target if use_target else target_cache, new_draft if use_draft else draft_cache)
        return outputs

    def prefill(self, work: PrefillWork, batch: RequestBatch, stats: GenerateStats, *, progress: bool = False,
                wait: bool = True) -> None:
        """Commits ``work``'s tokens to both caches (the draft's alone when ``draft_only``: a catch-up,
        counted in ``stats.catch_up_calls``), ``prefill_chunk`` tokens a call, and with ``wait`` waits for
        the last chunk (its time goes to ``stats.prefill_seconds``, a catch-up's to its step). Without
        (a decode step in flight, which the prefill queues behind: waiting would hold the next step's
        dispatch until both ran) only the calls' host time counts. The blocks of its positions are
        allocated (``Scheduler.prefill``'s chunks; a catch-up's and a top-up's lie below the pending token)."""
        rows, begin, count = work.rows, work.begin, work.count
        longest = int(count.max(initial=0))
        start = reported = time.perf_counter()
        # while prefill buckets compile in the background, rows split over calls of a compiled smaller
        # bucket rather than padding each to prefill_chunk tokens in a larger one
        split = "batch" in self.prefill_executable.split_dims
        max_rows = self.prefill_executable.split_size("batch", len(rows)) if split else None
        for done, sub, inputs in prefill_chunks(batch, rows, begin, count, self.config.prefill_chunk,
                                                self.proposer.lookahead, max_rows):
            layout = self.placement.rows(batch.shards[sub], self.prefill_executable)
            self._call(self.prefill_executable, stats, use_target=not work.draft_only,
                       use_draft=self.draft is not None, **layout.arrange(self.prefill_executable, **inputs))
            if done >= longest and wait:
                self.caches.put(*jax.block_until_ready(self.caches.take()))
            now = time.perf_counter()
            if progress and now - reported > PREFILL_PROGRESS_SECONDS:
                reported = now
                print(f"prefill: {min(done, longest)}/{longest} prompt tokens "
                      f"({now - start:.1f} s, compiling {stats.compile_seconds:.1f} s of it)",
                      file=sys.stderr, flush=True)
        if work.draft_only:
            stats.catch_up_calls += 1
        else:
            stats.prefill_seconds += time.perf_counter() - start

    def layout(self, batch: RequestBatch, rows: np.ndarray) -> BatchRows:
        """Where the requests of a decode step (their ``RequestBatch`` ``rows``) sit in its batch."""
        return self.placement.rows(batch.shards[rows], self.decode_executable)

    def dispatch(self, work: DecodeWork, batch: RequestBatch, layout: BatchRows, stats: GenerateStats,
                 started: float, carry_in: jax.Array | None = None, proposal: Any = None) -> PendingStep:
        """Calls the decode executable for ``work`` (the one call of the step; not waited for).
        ``started``: when the step's host work began (its one-off planning is taken out of it);
        ``carry_in``: the engine's carry (``overlaps``: donated; the step's is the ``PendingStep``'s), the
        rows ``work.carried`` moved on by it; ``proposal``: the drafts of a split step's first call
        (``propose``), which this call verifies."""
        step_k, num_drafts = work.drafts.step_k, work.drafts.num_drafts
        width = int(batch.num_blocks[work.rows].max())
        planning = time.perf_counter()
        constrained, split = work.grammar is not None, proposal is not None
        verifies = work.automaton is not None and not split      # with the drafting automata's masks too
        plan = self.decode_plan(layout.size, width, step_k, work.greedy, layout.scattered, logprobs=work.logprobs,
                                grammar=constrained, proposal=split, automaton=verifies)
        size = plan.padded["batch"] or layout.size
        packed_k = 0 if work.logprobs or constrained else self._packed_k(num_drafts, size, step_k)
        if packed_k:
            plan = self.decode_plan(layout.size, width, step_k, work.greedy, layout.scattered, packed_k=packed_k)
        if not split:         # (a split step's two calls run buckets of one batch size)
            plan = self.decode_executable.ready_plan(plan)      # a larger compiled bucket while this one compiles
        size = plan.padded["batch"] or layout.size
        started += time.perf_counter() - planning
        inputs = self._decode_inputs(work, batch, layout, plan, width, carry_in)
        if split:
            inputs["proposal"] = proposal
        if verifies:
            inputs.update(self._automaton_inputs(work, layout, plan))
        dispatched = time.perf_counter()
        outputs, carry_out = self._decode_call(plan, inputs, stats, self.uses_draft(step_k))
        return PendingStep(work, layout, outputs, carry_out, size * (packed_k + 1) if packed_k else None, started, dispatched)

    def propose(self, work: DecodeWork, batch: RequestBatch, layout: BatchRows, stats: GenerateStats,
                carry_in: jax.Array | None = None) -> tuple[Any, np.ndarray, jax.Array | None]:
        """The first call of a split step (``DecodeWork.split``: constrained requests, chains drafted on the
        device): the draft model or head drafts (each constrained request along its drafting automaton,
        ``work.automaton``; no host masks yet) and the host fetches the drafts, for the grammar's masks
        before the second call (``dispatch`` with the proposal) verifies them. Returns (the proposal, on the
        device; int32[R, k] the drafts of ``work``'s requests; the carry, as it was)."""
        width = int(batch.num_blocks[work.rows].max())
        plan = self.decode_plan(layout.size, width, work.drafts.step_k, work.greedy, layout.scattered,
                                draft_only=True, automaton=True)
        inputs = {**self._decode_inputs(work, batch, layout, plan, width, carry_in),
                  **self._automaton_inputs(work, layout, plan)}
        (proposal,), carry_out = self._decode_call(plan, inputs, stats, True)
        return proposal, np.asarray(proposal.tokens)[layout.rows], carry_out

    def _automaton_inputs(self, work: DecodeWork, layout: BatchRows, plan: BucketPlan) -> dict[str, Any]:
        """A decode call's drafting automata: ``work.automaton``'s tables and ``work.draft_states`` padded."""
        states = np.full((plan.padded["batch"] or layout.size, 2), -1, np.int32)
        states[layout.rows] = work.draft_states
        return dict(draft_tables=work.automaton.arrays(self.placement.replicated), draft_states=states)

    def _decode_call(self, plan: BucketPlan, inputs: dict[str, Any], stats: GenerateStats, use_draft: bool
                     ) -> tuple[list, jax.Array | None]:
        """(the decode executable's outputs past the caches, without the control state it keeps; the carry
        it returns, or None)."""
        outputs = self._call(self.decode_executable, stats, use_draft=use_draft, plan=plan, **inputs)
        carry_out = None
        if self.overlaps:
            *outputs, carry_out = outputs
        *outputs, self._controls = outputs
        return outputs, carry_out

    def _decode_inputs(self, work: DecodeWork, batch: RequestBatch, layout: BatchRows, plan: BucketPlan, width: int,
                       carry_in: jax.Array | None) -> dict[str, Any]:
        """A decode call's dynamic arguments for ``work`` at ``plan``'s bucket (taking the control state)."""
        size = plan.padded["batch"] or layout.size
        inputs = decode_inputs(batch, work.rows, layout.rows, size, plan.padded["blocks"] or width,
                               work.drafts.num_drafts, self.proposer.max_lag)
        if work.carried is not None:
            inputs["rows"][layout.rows[work.carried], StepRow.CARRIED] = 1
        drafts = self.proposer.drafts_input(work.drafts, layout.rows, size)
        if drafts is not None:
            inputs["drafts"] = drafts
        if layout.scattered:
            inputs["request_mask"] = np.zeros(size, np.bool_)
            inputs["request_mask"][layout.rows] = True
        inputs["controls"] = self._take_controls()
        if self.overlaps:
            inputs["carry"] = self.new_carry() if carry_in is None else carry_in
        if work.grammar is not None:
            inputs["grammar"] = np.full((size, *work.grammar.shape[1:]), -1, np.int32)
            inputs["grammar"][layout.rows] = work.grammar
        return inputs

    def fetch(self, pending: PendingStep, since: float = 0.0) -> StepResult:
        """The step's one device-to-host transfer, as a ``StepResult``; its ``seconds`` count from its
        start, or from ``since`` when later (one step in flight: the fetch of the step before)."""
        summary, *logprobs = pending.outputs      # logprobs also when run in the stead of a step without
        host, host_logprobs = pending.layout.fetch(summary, *(logprobs if pending.work.logprobs else ()))
        cold = self.decode_executable.last_call_first_run        # compiled now or ahead of time, never run
        fetched = time.perf_counter()
        return StepResult(host.output_token_ids, host.num_emitted, host.num_accepted, host.num_verified, host_logprobs,
                          pending.layout.computed, None if cold else fetched - max(pending.started, since),
                          pending.dispatched - pending.started)

    def record(self, pending: PendingStep, result: StepResult, stats: GenerateStats, fetched: float) -> None:
        """Counts the step in ``stats``, with the host's work after the fetch (until now) in its time."""
        after = time.perf_counter() - fetched
        stats.add_step(result.batch, pending.work.drafts.step_k, None if result.seconds is None else result.seconds + after,
                       result.host_seconds + after, pending.scored)

    # ------------------------------------------------------------------ plans
    def decode_plan(self, batch: int, width: int, k: int, greedy: bool, masked: bool, *,
                    logprobs: bool = False, packed_k: int = 0, grammar: bool = False, draft_only: bool = False,
                    proposal: bool = False, automaton: bool = False) -> BucketPlan:
        """The decode executable's bucket for a step's sizes (planned once per shape); ``masked``: the
        step gives its own request mask (a batch laid out over a mesh's data shards); ``grammar``: it
        gives structured output's masks; ``automaton``: the drafting automata; a split step's first call
        (``draft_only``, with the automata) and its second (``proposal``)."""
        key = (batch, width, k, greedy, logprobs, masked, packed_k, grammar, draft_only, proposal, automaton)
        plan = self._plans.get(key)
        if plan is None:
            given = _DECODE_ALWAYS + (("draft_params", "draft_cache") if self.uses_draft(k) else ()) \
                + (("drafts",) if self.proposer.host is not None else ()) + (("request_mask",) if masked else ()) \
                + ("controls",) + (("grammar",) if grammar else ()) \
                + (("carry",) if self.overlaps else ()) + (("draft_tables", "draft_states") if automaton else ()) \
                + (("proposal",) if proposal else ())
            plan = self._plans[key] = self.decode_executable.plan_sizes(
                {"batch": batch, "blocks": width}, given, k=k, greedy=greedy, logprobs=logprobs,
                backend=self.config.backend, packed_k=packed_k, draft_only=draft_only)
        return plan

    def _packed_draft_counts(self) -> tuple[int, ...]:
        """The drafts per row a packed step may score, ascending: 1 and an adaptive decoder's other k
        values (the controller's cost table then times most packed steps as one of its shapes), else
        the powers of two below k; none without ``packed_verify``."""
        cfg = self.config
        if not cfg.packed_verify:
            return ()
        if cfg.adaptive:
            return tuple(sorted({1, *self.step_ks[1:]}))
        return tuple(1 << i for i in range((cfg.k - 1).bit_length())) if cfg.k else ()

    def _packed_k(self, num_drafts: np.ndarray, batch: int, step_k: int) -> int:
        """A packed step's ``packed_k`` for these drafts at a padded batch of ``batch`` rows: their mean per
        row rounded up to one of ``packed_ks``, or 0 (a dense step) when packing is off or saves nothing."""
        mean = int(num_drafts.sum()) / batch
        return next((k for k in self.packed_ks if mean <= k < step_k), 0)

    def _host_drafts(self, batch: int, k: int) -> np.ndarray:
        """A ``drafts`` input of the proposer's shape for ``batch`` requests at static ``k`` (warm-up, timing)."""
        return np.ones((batch, k) if self.proposer.verifier == "chain" else (batch, 2, k), np.int32)

    # ------------------------------------------------------------------ measurement
    def device_seconds_per_step(self, batch_size: int, k: int, *, greedy: bool = True, context: int | None = None,
                                calls: int = 20, repeats: int = 5, controlled: int = 0) -> float:
        """Seconds per decode step of one shape (``batch_size`` requests, static ``k``) with no host work
        around it: the step's executable alone, called on device-resident inputs and waited for, median
        over ``repeats`` runs of the mean of ``calls`` calls. ``context``: each request's cache length
        (default: half the longest). ``controlled``: how many of the requests have logit controls
        (penalties and a bias; the same executable). A step's wall time in ``generate`` minus this is
        the host's share of the step."""
        cfg = self.config
        context = cfg.max_seq_len // 2 if context is None else context
        width = -(-(context + k + 1) // cfg.block_size)
        if k not in self.step_ks or width > cfg.max_blocks_per_seq:
            raise ValueError(f"device_seconds_per_step: k must be one of {self.step_ks} and context + k + 1 "
                             f"<= max_seq_len {cfg.max_seq_len}, got k={k}, context={context}")
        masked = isinstance(self.placement, OnMesh)
        plan = self.decode_plan(batch_size, width, k, greedy, masked)
        batch, padded_width = plan.padded["batch"] or batch_size, plan.padded["blocks"] or width
        blocks = np.full((batch, padded_width), -1, np.int32)
        blocks[:, :width] = np.arange(batch * width, dtype=np.int32).reshape(batch, width) % cfg.num_blocks
        rows = np.ones((batch, StepRow.WIDTH), np.int32)
        rows[:, StepRow.CONTEXT], rows[:, StepRow.NUM_DRAFTS] = context, k
        rows[:, StepRow.KEY] = np.arange(batch)
        rows[:, StepRow.STOP:StepRow.TOKENS] = -1
        rows[:, StepRow.BUDGET], rows[:, StepRow.CARRIED] = k + 1, 0
        sampling = np.zeros((batch, SamplingColumn.WIDTH), np.float32)
        sampling[:, [SamplingColumn.TEMPERATURE, SamplingColumn.TOP_P, SamplingColumn.REPETITION]] = 1.0
        if not 0 <= controlled <= batch_size:
            raise ValueError(f"device_seconds_per_step: controlled must be in [0, batch_size={batch_size}], "
                             f"got {controlled!r}")
        rows[:, StepRow.SLOT] = np.arange(batch) % self.largest_batch
        sampling[:controlled, [SamplingColumn.PRESENCE, SamplingColumn.FREQUENCY, SamplingColumn.REPETITION,
                               SamplingColumn.CONTROLLED]] = (0.5, 0.5, 1.2, 1.0)
        args = dict(block_tables=blocks, rows=rows, sampling=sampling)
        if masked:
            args["request_mask"] = np.ones(batch, np.bool_)
        if self.proposer.host is not None:
            args["drafts"] = self._host_drafts(batch, k)
        args = {name: jax.device_put(value) for name, value in args.items()}
        if self.overlaps:
            args["carry"] = self.new_carry()
        stats, use_draft = GenerateStats(), self.uses_draft(k)

        def call():
            args["controls"] = self._take_controls()
            summary, *rest = self._call(self.decode_executable, stats, use_draft=use_draft, plan=plan, **args)
            if self.overlaps:
                *rest, args["carry"] = rest
            self._controls = rest[-1]
            return summary

        with self.lock:
            call()          # compiles
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    call().packed.block_until_ready()
                samples.append((time.perf_counter() - start) / calls)
        return float(np.median(samples))

    # ------------------------------------------------------------------ warm-up
    def warmup(self, batch_sizes: int | Sequence[int], max_len: int, *,
               temperatures: float | Sequence[float] = 0.0, logprobs: bool = False, structured_output: bool = False,
               progress: bool = False, workers: int | None = None) -> int:
        """Compiles ahead of time every executable that ``generate`` runs for up to ``max(batch_sizes)``
        requests at once (its ``max_num_seqs``, or its number of prompts) of up to ``max_len`` positions
        (prompt + max_new_tokens - 1) at ``temperatures`` (0: the steps of all-greedy batches; > 0: those
        of batches with a sampled request, any mix of filters and greedy rows): the prefill and every
        k's decode step at every batch bucket and block-table width up to those sizes' (a batch shrinks
        as requests finish and admits waiting ones in smaller groups; a request's width grows with it),
        with ``packed_verify`` each k's packed steps, with ``logprobs`` the (dense) steps of batches
        with a request asking for log-probabilities, with ``structured_output`` the (dense) steps of
        batches with a request with ``SamplingParams.structured_outputs``, and the draft's catch-up
        prefill when k = 0 can be chosen or prefix caching tops up a finished request's draft rows.
        ``workers`` threads compile at once (default: ``graph.compiler.default_workers()``). Counts the
        executables before compiling them (with ``progress``: one line on stderr, then one per
        executable); returns the executables XLA compiled or loaded from the persistent compilation cache.
        A ``generate`` within these sizes then compiles nothing (``GenerateStats.compiled`` is empty)."""
        with CompileCounter() as compiles:
            jobs = self.warmup_jobs(batch_sizes, max_len, temperatures=temperatures, logprobs=logprobs,
                                    structured_output=structured_output, progress=progress)
            self._compile_controls()
            Compiler(workers, on_compiled=_progress_printer("warm-up") if progress else None).run(jobs)
        self.warmed_up = True
        return compiles.compiled + compiles.loads

    def start_warmup(self, batch_sizes: int | Sequence[int], max_len: int, *,
                     temperatures: float | Sequence[float] = 0.0, logprobs: bool = False,
                     structured_output: bool = False, progress: bool = False,
                     workers: int | None = None) -> Compiler:
        """``warmup``'s executables, the largest bucket of each kind of step first (waited for: with them
        every step of these sizes can run, padded to them) and the others in the background (on the
        returned ``Compiler``'s threads, logged; on ``PRIMED_PLATFORMS`` each also runs once on zeros
        before a step uses it): a step whose bucket is not compiled yet runs padded to a
        compiled larger one (``ExecutableCache.ready_plan``), so nothing compiles on the thread that steps.
        The steps of ``structured_output`` all compile in the background, after the others (a constrained
        request before them waits for its step's compile). Call ``stop()`` on the compiler at shutdown."""
        jobs = self.warmup_jobs(batch_sizes, max_len, temperatures=temperatures, logprobs=logprobs,
                                progress=progress)
        first, rest = largest_first(jobs)
        if structured_output:
            known = {(job.cache.name, job.key) for job in jobs}
            rest += [job for job in self.warmup_jobs(batch_sizes, max_len, temperatures=temperatures,
                                                     logprobs=logprobs, structured_output=True)
                     if (job.cache.name, job.key) not in known]
        compiler = Compiler(workers, prime=jax.default_backend() in PRIMED_PLATFORMS,
                            on_compiled=_progress_printer("warm-up", len(first)) if progress else None)
        self._compile_controls()
        compiler.submit(first + rest)
        try:
            compiler.wait(first)
        except BaseException:
            compiler.stop()
            raise
        compiler.background, compiler.switch_interval = True, BACKGROUND_SWITCH_INTERVAL
        if progress:
            print(f"warm-up: the {len(first)} largest buckets are compiled; {compiler.pending} more compile in the "
                  f"background ({compiler.max_workers} threads), steps meanwhile run padded to a compiled bucket",
                  file=sys.stderr, flush=True)
        self.warmed_up = True
        return compiler

    def _compile_controls(self) -> None:
        """The logit controls' writer, compiled before any step (not on the first request's)."""
        self._writer()

    def warmup_jobs(self, batch_sizes: int | Sequence[int], max_len: int, *,
                    temperatures: float | Sequence[float] = 0.0, logprobs: bool = False,
                    structured_output: bool = False, progress: bool = False) -> list[CompileJob]:
        """The executables ``warmup`` compiles (those not compiled yet), as ``Compiler`` jobs whose example
        arguments are abstract (no array of the caches is held); with ``progress`` a line on stderr counts
        them by dimension."""
        cfg = self.config
        sizes = [batch_sizes] if isinstance(batch_sizes, (int, np.integer)) else list(batch_sizes)
        temperatures = ([temperatures] if isinstance(temperatures, (int, float, np.floating))
                        else list(temperatures))
        if not sizes or not temperatures or not all(map(is_temperature, temperatures)):
            raise ValueError(f"warmup: batch_sizes and temperatures must be non-empty, temperatures finite "
                             f"floats >= 0; got batch_sizes={batch_sizes!r}, temperatures={temperatures!r}")
        for size in sizes:
            require_int("warmup", "batch_sizes", size, minimum=1)
        require_int("warmup", "max_len", max_len, minimum=1)
        if logprobs and self.proposer.verifier == "tree":
            raise ValueError("warmup: logprobs needs chain drafts (DecoderConfig.tree=None): a tree decoder's "
                             "requests cannot ask for log-probabilities")
        kinds = sorted({t == 0 for t in temperatures}, reverse=True)     # greedy first
        # a running batch never exceeds the largest bucket (``generate``)
        batch_bucket = self.decode_executable.bucket("batch", min(max(sizes), self.decode_executable.dims["batch"].largest))
        block_bucket = self.decode_executable.bucket("blocks", -(-max_len // cfg.block_size))
        if block_bucket is None:
            raise ValueError(f"warmup: max_len {max_len} exceeds DecoderConfig.max_seq_len {cfg.max_seq_len}")
        fits = lambda s: s["batch"] <= batch_bucket and s["blocks"] <= block_bucket  # noqa: E731
        with self.lock:
            calls = self._warmup_calls(fits, kinds, logprobs, structured_output)
        jobs = [job for executable, args in calls for job in executable.jobs(**args)]
        if progress:
            batches = [b for b in self.decode_executable.dims["batch"].sizes if b <= batch_bucket]
            widths = [w for w in self.decode_executable.dims["blocks"].sizes if w <= block_bucket]
            decode = sum(job.cache is self.decode_executable for job in jobs)
            print(f"warm-up: {len(jobs)} executables to compile: {decode} decode steps (k {self.step_ks} x "
                  f"batch buckets {tuple(batches)} x block-table widths {tuple(widths)} x "
                  f"{' and '.join('greedy' if greedy else 'sampled' for greedy in kinds)}"
                  f"{' x packed_k' if self.packed_ks else ''}{' x logprobs' if logprobs else ''}"
                  f"{' x structured output' if structured_output else ''}), "
                  f"{len(jobs) - decode} prefills",
                  file=sys.stderr, flush=True)
        return jobs

    def _warmup_calls(self, fits: Callable[[dict[str, int]], bool], kinds: list[bool], logprobs: bool,
                      structured_output: bool) -> list[tuple[ExecutableCache, dict[str, Any]]]:
        """(executable, abstract example arguments with a ``keep`` filter) of each group of warm-up buckets."""
        cfg = self.config
        target_cache, draft_cache = self.caches.take()
        controls = self._take_controls()
        tables = np.zeros((1, 1), np.int32)
        models = _abstract(dict(target_params=self.target_params, target_cache=target_cache, backend=cfg.backend,
                                **self.placement.warmup_args()))
        draft = _abstract(dict(draft_params=self.draft_params, draft_cache=draft_cache))
        prefill = dict(block_tables=tables, tokens=np.zeros((1, cfg.prefill_chunk + self.proposer.lookahead), np.int32),
                       start=np.zeros(1, np.int32), count=np.zeros(1, np.int32), keep=fits)
        calls = [(self.prefill_executable, {**models, **draft, **prefill})]
        # the draft's catch-up: after k = 0 steps, or a finished request's top-up (prefix caching; a head's too)
        if (self.proposer.has_draft_model and cfg.adaptive and 0 in cfg.allowed_k
                or self.draft is not None and self.prefix_root is not None):
            calls.append((self.prefill_executable, {**models, "target_params": None, "target_cache": None, **draft, **prefill}))
        no_draft = dict(draft_params=None, draft_cache=None)
        for greedy in kinds:
            for k in self.step_ks:
                step = dict(block_tables=tables, rows=np.zeros((1, StepRow.WIDTH), np.int32),
                            sampling=np.zeros((1, SamplingColumn.WIDTH), np.float32), k=k, greedy=greedy,
                            keep=lambda s, k=k: s["k"] == k and fits(s))
                step["controls"] = _abstract(controls)
                if self.overlaps:
                    step["carry"] = _abstract(self.new_carry())
                if self.proposer.host is not None:
                    step["drafts"] = self._host_drafts(1, k)
                models_k = {**models, **(draft if self.uses_draft(k) else no_draft)}
                for packed_k in (0, *(p for p in self.packed_ks if p < k)):
                    calls.append((self.decode_executable, {**models_k, **step, "packed_k": packed_k}))
                if logprobs:
                    calls.append((self.decode_executable, {**models_k, **step, "logprobs": True}))
                if structured_output:
                    grammar = np.full((1, k + 1, (self.vocab_size + 31) // 32), -1, np.int32)
                    if k and self.proposer.device_drafts:   # verified with the drafting automata (chains: or split)
                        calls += _automaton_step_calls(self.decode_executable, {**models_k, **step}, grammar,
                                                       self.vocab_size, controls.bias.sharding,
                                                       split=self.proposer.device_chains)
                    else:
                        calls.append((self.decode_executable, {**models_k, **step, "grammar": grammar}))
        self.caches.put(target_cache, draft_cache)
        self._controls = controls
        return calls


def _automaton_step_calls(executable: ExecutableCache, step: dict[str, Any], grammar: np.ndarray, vocab_size: int,
                          sharding: jax.sharding.Sharding, *, split: bool) -> list[tuple[ExecutableCache, dict[str, Any]]]:
    """The warm-up calls of a constrained step with drafts made on the device, from a step's abstract
    example arguments ``step``: the step verified with the drafting automata (their tables placed with
    ``sharding``, the placement's replicated one) and the ``grammar`` masks, and with ``split`` (chains)
    a split step's two calls (``draft_only`` with the automata, then the proposal verified with the
    ``grammar`` masks)."""
    tables = (jax.ShapeDtypeStruct((TABLE_STATES, max_classes(vocab_size)), np.int32, sharding=sharding),
              jax.ShapeDtypeStruct((MAX_GRAMMARS, vocab_size), np.int32, sharding=sharding))
    automata = {"draft_tables": tables, "draft_states": np.zeros((1, 2), np.int32)}
    if not split:
        return [(executable, {**step, **automata, "grammar": grammar})]
    drafting = {**step, **automata, "draft_only": True}
    statics = {name: drafting[name] for name in executable.static_argnames if name in drafting}
    dynamic = {name: value for name, value in drafting.items()
               if name not in statics and name != "keep" and value is not None}
    # the first call's proposal, the second call's example: traced at the smallest batch bucket (on a mesh a
    # batch of one row cannot split over the data axis), given the example's batch
    def batch_of(rows: int, tree: Any, name: str) -> Any:
        pad = next((pad for pad in executable.pads.get(name, ()) if pad.dim == "batch"), None)
        return tree if pad is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (*x.shape[:pad.axis], rows + pad.extra, *x.shape[pad.axis + 1:]), x.dtype, sharding=sharding), tree)

    smallest = {name: batch_of(executable.dims["batch"].sizes[0], value, name) for name, value in dynamic.items()}
    traced = jax.eval_shape(functools.partial(executable.fn, **statics), **smallest)[2]
    proposal = batch_of(len(step["rows"]), traced, "proposal")
    return [(executable, {**step, **automata, "grammar": grammar}), (executable, drafting),
            (executable, {**step, "grammar": grammar, "proposal": proposal})]


def _abstract(tree: Any) -> Any:
    """``tree`` with its JAX arrays replaced by their ``ShapeDtypeStruct`` (sharding kept): example arguments
    that hold no buffer (a background compile outlives the caches they were read from, donated since)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def _progress_printer(what: str, first: int = 0) -> Callable[[CompileJob, int, float, int, int], None]:
    """A ``Compiler.on_compiled`` printing one line per executable on stderr; jobs past the ``first``
    (``start_warmup``'s) say they compiled in the background."""
    start = time.perf_counter()

    def on_compiled(job: CompileJob, compiles: int, seconds: float, done: int, total: int) -> None:
        cache = job.cache
        tag = " (background)" if first and done > first else ""
        sys.stderr.write(f"[{cache.name}] {what} {done}/{total} ({cache.describe(job.key)})"   # one write: threads
                         f"{' [fallback]' if job.key in cache.failed else ''} compile {seconds:.2f}s, "
                         f"{time.perf_counter() - start:.1f}s{tag}\n")
        sys.stderr.flush()
    return on_compiled
