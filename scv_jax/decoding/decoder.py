"""``SpeculativeDecoder``: the models split for the step functions, their paged caches, block pool,
compiled step executables (graph mode), adaptive controllers and warm-up; ``generate`` decodes a batch
of prompts through an ``Engine`` (``engine``: the loop of steps, online requests).

    target, draft = scv_jax.models.load_demo()
    decoder = scv_jax.SpeculativeDecoder(target, draft, config=scv_jax.DecoderConfig(k=4))
    out = decoder.generate([list(b"def main(")], max_new_tokens=64)
    out.tokens[0], out.stats.tokens_per_second

    ngram = scv_jax.SpeculativeDecoder(target, scv_jax.NgramDrafter(min_n=1, max_n=3))  # or "ngram"

All per-request state (tokens, lags, block tables, sampling rows) lives on the host in arrays
(``RequestBatch``, held by the engine); the device holds the two paged caches and the model weights.
Each step is one call into a graph-mode executable (its inputs built at bucket size, its bucket planned once per shape) and one
batched device-to-host fetch of the emitted tokens. With ``mesh=`` the weights, caches and batch are
spread over a device mesh (``placement``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from scv_jax.adaptive.controller import AdaptiveController, ControllerConfig
from scv_jax.arguments import require_int
from scv_jax.decoding.caches import ModelCaches
from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.device_step import SamplingColumn, SplitModel, StepRow
from scv_jax.decoding.executables import step_executables
from scv_jax.decoding.ngram import NgramDrafter
from scv_jax.decoding.placement import OnMesh, ShardingConfig, SingleDevice
from scv_jax.decoding.requests import check_eos, check_prompts, check_seed
from scv_jax.decoding.stats import GenerateStats
from scv_jax.decoding.verifiers import ChainVerifier, TreeVerifier
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.graph.executable_cache import BucketPlan, ExecutableCache, GraphModeStats
from scv_jax.graph.persistent_cache import use_default_cache
from scv_jax.ops.registry import cuda_available
from scv_jax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# the decode step's dynamic arguments that every call gives
_DECODE_ALWAYS = ("target_params", "target_cache", "block_tables", "rows", "sampling")


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


def _request_seed(seed: int, index: int) -> int:
    """The seed of request ``index`` of a ``generate`` call with ``seed``: in [0, 2**63), one per pair."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> np.uint64(1))


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
        use_default_cache()
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
        elif self.drafter is None and (self.config.adaptive or self.config.k or self.config.tree):
            self.config = dataclasses.replace(self.config, k=0, adaptive=False, tree=None)
        cfg = self.config
        if cfg.backend == "pallas" and not cuda_available():
            raise ValueError(f"SpeculativeDecoder: DecoderConfig.backend='pallas' needs a CUDA GPU (JAX's default "
                             f"backend is {jax.default_backend()!r}); use 'auto', 'xla', or 'interpret' on CPU")
        if cfg.packed_verify and (mesh is not None or not hasattr(target, "forward_packed")):
            raise ValueError("SpeculativeDecoder: DecoderConfig.packed_verify needs one device (no mesh) and a "
                             "target with forward_packed (scv_jax.models.Transformer has it)")
        if cfg.tree is not None and mesh is not None:
            raise ValueError("SpeculativeDecoder: DecoderConfig.tree needs one device (no mesh)")
        if cfg.tree is not None and draft_model is not None and cfg.tree.branching > self.vocab_size:
            raise ValueError(f"SpeculativeDecoder: TreeConfig.branching {cfg.tree.branching} exceeds vocab_size "
                             f"{self.vocab_size} (a node's children are distinct tokens)")
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
        self._step_ks = tuple(sorted(set(cfg.allowed_k) | {0})) if cfg.tree is None else self._tree_node_counts()
        self._packed_ks = self._packed_draft_counts()
        self._prefill, self._decode = step_executables(cfg, self._target, self._draft, self._step_ks, self.placement,
                                                       ChainVerifier() if cfg.tree is None else TreeVerifier(cfg.tree))
        self._plans: dict[tuple, BucketPlan] = {}
        self._next_request_id = 0
        self._lock = threading.RLock()        # one step at a time (engines on this decoder, threads)
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

    # ------------------------------------------------------------------ generation
    def _new_request_id(self) -> int:
        """A new id for the controller's per-request state (unique over this decoder's requests)."""
        self._next_request_id += 1
        return self._next_request_id

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None, temperature: float = 0.0,
                 seed: int = 0, eos_token_id: int | Sequence[int] | None = None, *,
                 max_num_seqs: int | None = None, progress: bool = False,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> GenerateOutput:
        """Generates up to ``max_new_tokens`` tokens for each prompt (a batch of any lengths): a loop over
        an ``Engine`` with every prompt added at once.

        A request stops at ``max_new_tokens`` or after emitting an ``eos_token_id`` (one id or a
        sequence of ids, e.g. Llama-3-Instruct's three); its KV blocks go back to the pool. A prompt
        plus ``max_new_tokens`` may not exceed the models' ``config.max_position_embeddings`` (where
        they declare one). ``temperature`` 0 is greedy; otherwise sampling with ``seed``, an int in
        [0, 2**32) (same seed, same output; request i draws from its own stream of (seed, i)).
        ``sampling``: instead of ``max_new_tokens`` and ``temperature``, each request's
        ``SamplingParams`` (one for all, or one per prompt; their max_tokens, filters, stop ids and
        seeds; a request without a seed draws from (seed, i)). ``max_num_seqs``: at most that many
        requests decode at once (continuous batching: the others wait, in order, and each is
        prefilled and joins the running batch as soon as a running request finishes; None: all at
        once). Either way at most the largest batch bucket run at once (``DecoderConfig.batch_buckets``;
        on a mesh, its share per data shard): a step never outgrows the compiled executables.
        ``progress``: report the prefill of long prompts on stderr. ``on_tokens(prompt_index,
        new_tokens)``: called after each step for each request that emitted tokens (streaming; the
        tokens of ``GenerateOutput.tokens``, in order; an exception it raises stops the call).
        """
        from scv_jax.decoding.engine import Engine

        if not _is_temperature(temperature):
            raise ValueError(f"generate: temperature must be a finite float >= 0, got {temperature!r}")
        seed = check_seed(seed)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"generate: on_tokens must be None or a callable(prompt_index, tokens), got {on_tokens!r}")
        if max_num_seqs is not None:
            require_int("generate", "max_num_seqs", max_num_seqs, minimum=1)
        prompt_ids = check_prompts(prompts, self.vocab_size)
        params = self._request_params(len(prompt_ids), max_new_tokens, temperature, seed, sampling)
        engine = Engine(self, eos_token_id=check_eos(eos_token_id, self.vocab_size), max_num_seqs=max_num_seqs,
                        progress=progress)
        for i, (prompt, request) in enumerate(zip(prompt_ids, params)):
            try:
                engine.add_request(prompt, request, request_id=str(i))
            except ValueError as error:
                raise ValueError(f"generate: prompt {i}: {str(error).removeprefix('add_request: ')}") from None
        tokens: list[list[int]] = [[] for _ in prompt_ids]
        start = time.perf_counter()
        with CompileCounter() as compiles:
            try:
                while engine.has_unfinished():
                    for out in engine.step():
                        index = int(out.request_id)
                        tokens[index] += out.new_token_ids
                        if on_tokens is not None and out.new_token_ids:
                            on_tokens(index, list(out.new_token_ids))
                engine._observe()
            finally:
                engine._abort_all()
        stats = engine.stats
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
        stats.generated_tokens = sum(map(len, tokens))
        stats.tokens_per_second = stats.generated_tokens / max(stats.wall_seconds - stats.compile_seconds, 1e-9)
        engine.tally.fill(stats)
        return GenerateOutput(tokens, stats)

    @staticmethod
    def _request_params(count: int, max_new_tokens: int | None, temperature: float, seed: int,
                        sampling: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        """Each of ``count`` requests' ``SamplingParams`` for ``generate``; request i's stream, unless its
        params give a seed, is the one of (seed, i)."""
        if sampling is None:
            require_int("generate", "max_new_tokens", max_new_tokens, minimum=1)
            sampling = SamplingParams(temperature=float(temperature), max_tokens=int(max_new_tokens))
        elif max_new_tokens is not None or temperature != 0.0:
            raise ValueError("generate: with sampling=, give max_tokens and temperature in its SamplingParams "
                             "(leave max_new_tokens and temperature out)")
        params = [sampling] * count if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"generate: sampling must be a SamplingParams or a sequence of one per prompt "
                             f"({count}), got {sampling!r}")
        return [p if p.seed is not None else dataclasses.replace(p, seed=_request_seed(seed, i))
                for i, p in enumerate(params)]

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

    def _decode_plan(self, batch: int, width: int, k: int, greedy: bool, masked: bool, *,
                     logprobs: bool = False, packed_k: int = 0) -> BucketPlan:
        """The decode executable's bucket for a step's sizes (planned once per shape); ``masked``: the
        step gives its own request mask (a batch laid out over a mesh's data shards)."""
        key = (batch, width, k, greedy, logprobs, masked, packed_k)
        plan = self._plans.get(key)
        if plan is None:
            given = _DECODE_ALWAYS + (("draft_params", "draft_cache") if self._draft is not None and k else ()) \
                + (("drafts",) if self.drafter else ()) + (("request_mask",) if masked else ())
            plan = self._plans[key] = self._decode.plan_sizes(
                {"batch": batch, "blocks": width}, given, k=k, greedy=greedy, logprobs=logprobs,
                backend=self.config.backend, packed_k=packed_k)
        return plan

    def _tree_node_counts(self) -> tuple[int, ...]:
        """A tree decoder's step node counts (its static k): 0, and the draft model's tree size or the n-gram
        trie's node buckets."""
        tree = self.config.tree
        return (0, tree.draft_nodes()) if self.drafter is None else (0, *tree.node_buckets())

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
        rows[:, StepRow.KEY] = np.arange(batch)
        rows[:, StepRow.STOP:StepRow.TOKENS] = -1
        sampling = np.zeros((batch, SamplingColumn.WIDTH), np.float32)
        sampling[:, [SamplingColumn.TEMPERATURE, SamplingColumn.TOP_P]] = 1.0    # unused when greedy
        args = dict(block_tables=blocks, rows=rows, sampling=sampling)
        if masked:
            args["request_mask"] = np.ones(batch, np.bool_)
        if self.drafter is not None:
            args["drafts"] = np.ones((batch, k) if cfg.tree is None else (batch, 2, k), np.int32)
        args = {name: jax.device_put(value) for name, value in args.items()}
        stats, use_draft = GenerateStats(), self._draft is not None and k > 0
        with self._lock:
            self._run(self._decode, stats, use_draft=use_draft, plan=plan, **args)  # compiles
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    (summary,) = self._run(self._decode, stats, use_draft=use_draft, plan=plan, **args)
                    summary.packed.block_until_ready()
                samples.append((time.perf_counter() - start) / calls)
        return float(np.median(samples))

    # ------------------------------------------------------------------ warm-up
    def warmup(self, batch_sizes: int | Sequence[int], max_len: int, *,
               temperatures: float | Sequence[float] = 0.0, logprobs: bool = False, progress: bool = False) -> int:
        """Compiles ahead of time every executable that ``generate`` runs for up to ``max(batch_sizes)``
        requests at once (its ``max_num_seqs``, or its number of prompts) of up to ``max_len`` positions
        (prompt + max_new_tokens - 1) at ``temperatures`` (0: the steps of all-greedy batches; > 0: those
        of batches with a sampled request, any mix of filters and greedy rows): the prefill and every
        k's decode step at every batch bucket and block-table width up to those sizes' (a batch shrinks
        as requests finish and admits waiting ones in smaller groups; a request's width grows with it),
        with ``packed_verify`` each k's packed steps, with ``logprobs`` the (dense) steps of batches
        with a request asking for log-probabilities, and the draft's catch-up prefill when k = 0 can
        be chosen. Counts the executables before compiling them (with
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
        with self._lock:
            return self._warmup(fits, batch_bucket, block_bucket, kinds, logprobs, progress)

    def _warmup(self, fits: Callable[[dict[str, int]], bool], batch_bucket: int, block_bucket: int,
                kinds: list[bool], logprobs: bool, progress: bool) -> int:
        cfg = self.config
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
                            sampling=np.zeros((1, SamplingColumn.WIDTH), np.float32), k=k, greedy=greedy,
                            keep=lambda s, k=k: s["k"] == k and fits(s))
                if self.drafter is not None:
                    step["drafts"] = np.zeros((1, k) if cfg.tree is None else (1, 2, k), np.int32)
                models_k = {**models, **(draft if self._draft is not None and k else no_draft)}
                for packed_k in (0, *(p for p in self._packed_ks if p < k)):
                    calls.append((self._decode, {**models_k, **step, "packed_k": packed_k}))
                if logprobs:
                    calls.append((self._decode, {**models_k, **step, "logprobs": True}))
        pending = [len(executable.pending(**args)) for executable, args in calls]
        if progress:
            batches = [b for b in self._decode.dims["batch"].sizes if b <= batch_bucket]
            widths = [w for w in self._decode.dims["blocks"].sizes if w <= block_bucket]
            decode = sum(n for (executable, _), n in zip(calls, pending) if executable is self._decode)
            print(f"warm-up: {sum(pending)} executables to compile: {decode} decode steps (k {self._step_ks} x "
                  f"batch buckets {tuple(batches)} x block-table widths {tuple(widths)} x "
                  f"{' and '.join('greedy' if greedy else 'sampled' for greedy in kinds)}"
                  f"{' x packed_k' if self._packed_ks else ''}{' x logprobs' if logprobs else ''}), "
                  f"{sum(pending) - decode} prefills",
                  file=sys.stderr, flush=True)
        with CompileCounter() as compiles:
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
