"""``Engine``: online speculative decoding, vLLM's ``EngineCore`` loop. Requests arrive at any time with
their own ``SamplingParams`` (``add_request``) and leave when done or aborted; each ``step`` admits
waiting requests (FIFO, while a batch row and their KV blocks are free), prefills chunks of their
prompts within a token budget (``DecoderConfig.max_num_batched_tokens``: the decoding requests' tokens
first), runs one decode step of the requests whose prompts are in the caches (preempting the most
recently admitted request, to resume later, when the KV blocks run out) and returns a ``RequestOutput``
for every request that emitted tokens or ended.

    engine = scv_jax.Engine(target, draft, config=scv_jax.DecoderConfig(k=4))
    engine.add_request(list(b"def main("), scv_jax.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_token_ids, out.finish_reason)

A step joins three roles: the ``Scheduler`` (host policy: admission, k, drafts, outputs) plans a
``DecodeWork``; the ``StepRunner`` runs it as one executable call (propose -> verify -> commit, by the
chain or the tree verifier) and one fetch; the scheduler turns the ``StepResult`` into outputs. The
drafter's host half is a ``Proposer`` (``proposers.factory`` makes it).

One step in flight (``DecoderConfig.overlap``, the default): ``step`` dispatches the next decode step
before it fetches the one dispatched by the call before, so the host's bookkeeping of that one (outputs,
stops, blocks, admission) runs while the device computes the next; each call then returns the outputs of
the step before. A request that ends is known a step late: the device's work for it in the step after
is discarded (docs/engine.md has the timeline).

Several processes (a mesh over the devices of a ``jax.distributed.initialize`` job): process 0 drives
the engine (``add_request`` / ``step`` / ``abort``) and the others call ``follow()``, which runs the same
steps until process 0 calls ``close()``. Each step, process 0 sends what changed since the step before
(requests added with their ids and random keys, aborts) to the followers in one message
(``sharding.processes.StepChannel``); every process then plans the same step from the same state, so all
dispatch the same executables (docs/serving.md, "Several hosts").

Threads: drive an engine from one thread; its methods hold the runner's lock, so a second thread (or a
second engine on the same decoder) waits its turn.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Sequence

import numpy as np

from scv_jax.arguments import require_int
from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.grammar import Grammars
from scv_jax.decoding.outputs import RequestOutput
from scv_jax.decoding.placement import ShardingConfig
from scv_jax.decoding.plan import SamplingColumn
from scv_jax.decoding.proposers.factory import draft_model_of, make_proposer
from scv_jax.decoding.requests import RequestBatch, check_eos, check_prompt
from scv_jax.decoding.runner import PendingStep, StepRunner
from scv_jax.decoding.scheduler import Request, Scheduler
from scv_jax.decoding.stats import AcceptanceTally, GenerateStats
from scv_jax.graph.compiler import CompileJob, Compiler
from scv_jax.graph.persistent_cache import use_default_cache
from scv_jax.sampling_params import MAX_STOP_IDS, SamplingParams, batch_sampling_arrays
from scv_jax.sharding.processes import StepChannel, fail_fast, is_leader, wait_for_all, watch

WARMUP_TEMPERATURES = (0.0, 1.0)    # a warm-up compiles the steps of all-greedy and of sampled batches


def stream_keys(seed: int) -> np.ndarray:
    """int32[2] the key data (uint32 bits) of the random stream of a request with ``seed``."""
    return np.random.SeedSequence(seed).generate_state(2, np.uint32).view(np.int32)


def _vocab_size(model, name: str) -> int:
    """The vocabulary size of a ``PagedModel``."""
    config = getattr(model, "config", None)
    if not hasattr(model, "forward_paged") or config is None:
        hint = ", a HostDrafter (e.g. an NgramDrafter) or \"ngram\"" if name == "draft" else ""
        raise TypeError(f"SpeculativeDecoder: {name} must implement scv_jax.models.PagedModel "
                        f"(forward_paged and config){hint}, got {type(model).__name__}")
    return config.vocab_size


def _max_positions(*models) -> int | None:
    """The fewest ``config.max_position_embeddings`` of ``models`` that declare one; None when none does."""
    limits = [getattr(getattr(m, "config", None), "max_position_embeddings", None) for m in models]
    return min((n for n in limits if n is not None), default=None)


def build_runner(target, draft=None, *, config: DecoderConfig | None = None, mesh=None,
                 sharding: ShardingConfig | None = None) -> StepRunner:
    """The ``StepRunner`` of ``target`` with ``draft`` (a draft model, a ``HostDrafter``, ``"ngram"`` or
    None): checks the arguments, makes the proposer (``proposers.factory``) and splits the models."""
    config = config or DecoderConfig()
    use_default_cache()
    vocab_size = _vocab_size(target, "target")
    try:
        draft_model = draft_model_of(draft)
    except ValueError as error:
        raise ValueError(f"SpeculativeDecoder: {error}") from None
    if draft_model is not None and _vocab_size(draft_model, "draft") != vocab_size:
        raise ValueError(f"SpeculativeDecoder: draft vocab_size {draft_model.config.vocab_size} != target "
                         f"vocab_size {vocab_size}")
    if draft is None and (config.adaptive or config.k or config.tree):
        config = dataclasses.replace(config, k=0, adaptive=False, tree=None)
    if config.packed_verify and (mesh is not None or not hasattr(target, "forward_packed")):
        raise ValueError("SpeculativeDecoder: DecoderConfig.packed_verify needs one device (no mesh) and a "
                         "target with forward_packed (scv_jax.models.Transformer has it)")
    if config.tree is not None and mesh is not None:
        raise ValueError("SpeculativeDecoder: DecoderConfig.tree needs one device (no mesh)")
    if config.tree is not None and draft_model is not None and config.tree.branching > vocab_size:
        raise ValueError(f"SpeculativeDecoder: TreeConfig.branching {config.tree.branching} exceeds vocab_size "
                         f"{vocab_size} (a node's children are distinct tokens)")
    try:
        proposer = make_proposer(draft, config.allowed_k, config.tree, vocab_size)
    except ValueError as error:
        raise ValueError(f"SpeculativeDecoder: {error}") from None
    return StepRunner(target, draft_model, proposer, config, vocab_size=vocab_size,
                      max_position_embeddings=_max_positions(target, draft_model), mesh=mesh, sharding=sharding)


class Engine:
    """Online decoding of ``target`` with a drafter: ``add_request`` / ``step`` / ``abort``.

    ``target``, ``draft``, ``config``, ``mesh``, ``sharding``: as ``SpeculativeDecoder`` (``draft``: a
    model, a ``HostDrafter`` such as ``NgramDrafter``, ``"ngram"`` or None); or ``target`` a
    ``SpeculativeDecoder`` to run on (its models, caches and compiled executables; the other arguments
    then left out). ``eos_token_id``: the model's end-of-sequence id(s) (None, an int or several),
    ending a request unless its ``ignore_eos``. ``max_num_seqs``: the most requests running at once
    (default and at most the largest batch bucket, per data shard on a mesh: a step never outgrows the
    compiled executables). ``seed``: the stream that seeds requests without a seed. ``progress``:
    report long prefills on stderr. ``max_num_batched_tokens``: the tokens a step computes (decoding
    requests first, then prompt chunks; default ``DecoderConfig.max_num_batched_tokens``, or the
    platform's). ``tokenizer``: the model's (``scv_jax.models.Tokenizer``, or a ``tokenizers.Tokenizer``),
    for requests with ``SamplingParams.structured_outputs`` (their grammars are over its vocabulary).
    ``lockstep``: on a mesh over several processes, every process calls the engine's methods alike itself
    (``SpeculativeDecoder.generate`` does); by default process 0 drives it and the others ``follow()``.

    A request's tokens do not depend on when it arrived or what it shares the batch with: greedy ones
    exactly, sampled ones draw from their own stream (``SamplingParams.seed``) at each position (the
    same tokens where the numerics of the batch sizes agree; drafts per step must agree too, as with
    a fixed k and no ``packed_verify``).
    """

    def __init__(self, target, draft=None, *, config=None, mesh=None, sharding=None,
                 eos_token_id: int | Sequence[int] | None = None, max_num_seqs: int | None = None, seed: int = 0,
                 progress: bool = False, max_num_batched_tokens: int | None = None, tokenizer=None,
                 lockstep: bool = False):
        runner = getattr(target, "runner", None)
        if isinstance(runner, StepRunner):             # a SpeculativeDecoder: run on its runner
            if draft is not None or config is not None or mesh is not None or sharding is not None:
                raise ValueError("Engine: given a SpeculativeDecoder, leave draft, config, mesh and sharding out")
        else:
            runner = build_runner(target, draft, config=config, mesh=mesh, sharding=sharding)
        self.runner = runner
        cfg = self.config = runner.config
        self._eos = check_eos(eos_token_id, runner.vocab_size, "Engine")
        require_int("Engine", "seed", seed, minimum=0)
        largest = runner.largest_batch
        if max_num_seqs is not None:
            require_int("Engine", "max_num_seqs", max_num_seqs, minimum=1)
        self.max_num_seqs = largest if max_num_seqs is None else min(max_num_seqs, largest)
        if max_num_batched_tokens is not None:
            require_int("Engine", "max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        self.max_num_batched_tokens = max_num_batched_tokens or runner.max_num_batched_tokens
        self.progress = progress
        proposer = runner.proposer
        batch = RequestBatch(largest, cfg.max_seq_len + runner.step_ks[-1] + 2, cfg.block_size, cfg.max_blocks_per_seq,
                             runner.pool.shards, runner.prefix_root, proposer.lookahead, runner.kv_span)
        grammars = None
        if tokenizer is not None:
            to_json = getattr(tokenizer, "to_json", None) or getattr(tokenizer, "to_str", None)
            if to_json is None:
                raise TypeError(f"Engine: tokenizer must be a scv_jax.models.Tokenizer or a tokenizers.Tokenizer, "
                                f"got {type(tokenizer).__name__}")
            grammars = Grammars(to_json(), runner.vocab_size, self._eos)
        self._scheduler = Scheduler(batch, runner.pool, proposer, runner.controllers, k=cfg.k,
                                    max_num_seqs=self.max_num_seqs, per_shard=largest // len(runner.pool.shards),
                                    max_num_batched_tokens=self.max_num_batched_tokens,
                                    prefill_chunk=cfg.prefill_chunk, grammars=grammars,
                                    draft_ahead=cfg.draft_ahead)
        self._rng = np.random.default_rng(seed)
        self._next_id = 0
        self._in_flight: PendingStep | None = None      # the decode step dispatched, not yet fetched
        self._fetched = 0.0                              # when the last step was fetched
        self._carry = runner.new_carry()                 # what each request's last step did (``decoding.carry``)
        self.stats = GenerateStats()
        self.tally = AcceptanceTally(proposer.max_depth)
        several = runner.spans_processes
        if several and lockstep and cfg.adaptive:
            raise ValueError("DecoderConfig.adaptive: over several processes process 0 decides k, so the steps run "
                             "on an Engine that process 0 drives and the others follow(), not in generate")
        followed = several and not lockstep
        self._channel = StepChannel.open() if followed else None     # to (or from) the other processes
        self._scheduler.automata_from_leader = followed      # when to draft along an automaton: the leader says
        self._lockstep_processes = several and lockstep
        self._meet_first = self._lockstep_processes       # (a followed engine's channel meets at its first message)
        self._changes: list[tuple] = []              # the leader's changes since its last step, for the followers
        self._timings: list[tuple] = []              # the leader's step times since its last step (``take_timing``)
        self.is_leader = not followed or is_leader()

    def _leading(self, method: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"Engine.{method}: process 0 drives this engine; a follower calls follow()")

    # ------------------------------------------------------------------ requests
    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_prefilling(self) -> int:
        """Running requests whose prompts are still being prefilled (in chunks, a budget a step)."""
        return int(self._scheduler.batch.prefilling.size)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def num_free_blocks(self) -> int:
        """KV blocks free in the pool (``num_blocks`` when no request runs)."""
        return self.runner.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.runner.pool.num_blocks

    @property
    def supports_logprobs(self) -> bool:
        """Whether requests may ask for log-probabilities (chain drafts; a tree verifier has none)."""
        return self.runner.proposer.verifier == "chain"

    @property
    def supports_structured_output(self) -> bool:
        """Whether requests may have ``structured_outputs`` (``Engine(tokenizer=...)``; over several processes
        an engine that process 0 drives: each process's drafting automata are built on its own thread, and
        the leader tells the followers at which step its were ready)."""
        return self._scheduler.grammars is not None and not self._lockstep_processes

    def has_unfinished(self) -> bool:
        """Whether a request waits or runs, or an abort is still to be reported by ``step``."""
        return self._scheduler.has_unfinished()

    @property
    def overlaps(self) -> bool:
        """Whether steps run one in flight (``DecoderConfig.overlap`` on one device)."""
        return self.runner.overlaps

    def _check_fits(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises ValueError when the request can never run (alone with the whole pool)."""
        runner, cfg = self.runner, self.config
        positions = len(prompt) + params.max_tokens - 1      # drafts never outrun the budget
        limit = runner.max_position_embeddings
        if limit is not None and positions + 1 > limit:
            raise ValueError(f"add_request: prompt ({len(prompt)} tokens) + max_tokens {params.max_tokens} = "
                             f"{positions + 1} positions exceed the model's max_position_embeddings {limit}")
        if positions > cfg.max_seq_len:
            raise ValueError(f"add_request: the request needs up to {positions} cache positions (prompt "
                             f"{len(prompt)} + max_tokens {params.max_tokens} - 1) but DecoderConfig.max_seq_len "
                             f"is {cfg.max_seq_len}")
        need = self._scheduler.batch.blocks_needed(positions)
        pool = runner.pool.shards[0]
        if need > pool.num_blocks:
            where = "the cache" if len(runner.pool.shards) == 1 else "a data shard"
            raise ValueError(f"add_request: the request needs {need} KV blocks but {where} holds "
                             f"{pool.num_blocks} (raise DecoderConfig.num_blocks)")

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request (FIFO); it runs as soon as a batch row and its KV blocks are free. Returns
        its id (``request_id``, or a new one). Raises ValueError at once for a request that can never
        run (longer than ``DecoderConfig.max_seq_len``, the model's context or the cache) or bad input."""
        self._leading("add_request")
        return self._add_request(prompt_token_ids, params, request_id)

    def _add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None, request_id: str | None,
                     keys: np.ndarray | None = None) -> str:
        """``add_request``; ``keys``: its random stream's (a follower gets the leader's)."""
        runner, vocab = self.runner, self.runner.vocab_size
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"add_request: params must be a SamplingParams or None, got {type(params).__name__}")
        prompt = check_prompt("add_request", "prompt_token_ids", prompt_token_ids, vocab)
        stops = tuple(dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else self._eos)))
        if len(stops) > MAX_STOP_IDS or any(t >= vocab for t in stops):
            raise ValueError(f"add_request: SamplingParams.stop_token_ids must hold ids in [0, vocab_size="
                             f"{vocab}), at most {MAX_STOP_IDS} with the model's eos ids, got "
                             f"{params.stop_token_ids!r} (eos {self._eos!r})")
        bad = [t for t in params.token_ids() if t >= vocab]
        if bad:
            words = [t for word in params.bad_words_token_ids for t in word]
            field = next(name for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                                ("bad_words_token_ids", words))
                         if bad[0] in ids)
            raise ValueError(f"add_request: SamplingParams.{field} must hold token ids in [0, vocab_size={vocab}), "
                             f"got {bad[0]}")
        if params.prediction and (runner.proposer.predictions is None or any(t >= vocab for t in params.prediction)):
            raise ValueError(f"add_request: SamplingParams.prediction needs an engine with a host drafter (n-gram, "
                             f"suffix or a HostDrafter; not a draft model, an EAGLE head or none) and token ids in "
                             f"[0, vocab_size={vocab})")
        if params.logprobs is not None and not self.supports_logprobs:
            raise ValueError("add_request: SamplingParams.logprobs needs chain drafts (DecoderConfig.tree=None)")
        scheduler = self._scheduler
        matcher = None
        if params.structured_outputs is not None:
            if scheduler.grammars is None or self._lockstep_processes:
                raise ValueError("add_request: SamplingParams.structured_outputs needs Engine(tokenizer=...), and "
                                 "over several processes an engine that process 0 drives (not lockstep=True)")
            try:
                matcher = scheduler.grammars.matcher(params.structured_outputs)
            except ValueError as e:
                raise ValueError(f"add_request: {e}") from None
        with runner.lock:
            if request_id is None:             # never an id given before (nor one the caller uses now)
                while str(self._next_id) in scheduler.requests:
                    self._next_id += 1
                request_id = str(self._next_id)
                self._next_id += 1
            elif not isinstance(request_id, str) or not request_id:
                raise ValueError(f"add_request: request_id must be a non-empty str or None, got {request_id!r}")
            if request_id in scheduler.requests:
                raise ValueError(f"add_request: request_id {request_id!r} is already waiting or running")
            self._check_fits(prompt, params)
            sampling = np.zeros(SamplingColumn.WIDTH, np.float32)
            sampling[:SamplingColumn.PRESENCE] = np.stack(batch_sampling_arrays([params]), axis=1)[0]
            sampling[SamplingColumn.TOP_K] = min(sampling[SamplingColumn.TOP_K], vocab)
            sampling[[SamplingColumn.PRESENCE, SamplingColumn.FREQUENCY, SamplingColumn.REPETITION,
                      SamplingColumn.MIN_TOKENS, SamplingColumn.CONTROLLED]] = (
                params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_tokens,
                params.controlled)
            if keys is None:
                keys = (stream_keys(params.seed) if params.seed is not None
                        else self._rng.integers(0, 2 ** 32, 2, dtype=np.uint32).view(np.int32))
            scheduler.add(Request(request_id, prompt, params, sampling, keys, stops, runner.new_request_id(),
                                  [0] * runner.proposer.max_depth, matcher=matcher))
            self.stats.prompt_tokens += len(prompt)
            self._record("add", prompt, params, request_id, keys)
        return request_id

    def _record(self, *change) -> None:
        """Keeps a change of the requests for the followers (the leader of several processes)."""
        if self._channel is not None and self.is_leader:
            self._changes.append(change)

    def abort(self, request_id: str) -> None:
        """Ends a waiting or running request now (its blocks return to the pool); the next ``step``
        reports it with finish_reason "abort". An unknown or finished id is ignored."""
        self._leading("abort")
        with self.runner.lock:
            self._scheduler.abort(request_id)
            self._record("abort", request_id)

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (vLLM's ``reset_prefix_cache``); False, changing nothing, while a
        running request holds cached blocks."""
        self._leading("reset_prefix_cache")
        with self.runner.lock:
            if any(pool.num_cached_held for pool in self.runner.pool.shards):
                return False
            self._reset_prefix_cache()
            self._record("reset_prefix_cache")
            return True

    def _reset_prefix_cache(self) -> None:
        for pool in self.runner.pool.shards:
            pool.reset_prefix_cache()

    def abort_all(self) -> None:
        """Aborts every waiting and running request (a loop over the engine that stops early)."""
        self._leading("abort_all")
        with self.runner.lock:
            for request_id in list(self._scheduler.requests):
                self._scheduler.abort(request_id)
                self._record("abort", request_id)

    def finish_observing(self) -> None:
        """Tells the adaptive controller about the last step now (a run that ends learns from its last step)."""
        self._leading("finish_observing")
        with self.runner.lock:
            self._scheduler.observe()
            self._record("finish_observing")

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Admits waiting requests, prefills chunks of the prompts being prefilled within the step's token
        budget (``DecoderConfig.max_num_batched_tokens``), runs one decode step of the requests whose
        prompts are in the caches and returns an output for every request that emitted tokens or ended
        (aborts included). With one step in flight (``overlaps``) the decode step is dispatched, and the
        outputs are those of the step the call before dispatched."""
        self._leading("step")
        if self._meet_first:        # lockstep over several processes: every process starts its steps together
            wait_for_all()
            self._meet_first = False
        if self._channel is not None:
            if self._channel.closed:
                raise RuntimeError("Engine.step: the engine was closed (its followers returned)")
            with self.runner.lock:      # drafting automata built since the last step: used from this one on
                for request_id in self._scheduler.ready_automata():
                    self._record("automaton", request_id)
            self._channel.publish(pickle.dumps((self._changes, self._timings, False)))
            self._learn_timings(self._timings)
            self._changes, self._timings = [], []
        return self._step()

    def _learn_timings(self, timings: list[tuple]) -> None:
        """The adaptive controllers learn the step times process 0 measured (each process at the same step)."""
        with self.runner.lock:
            for timing in timings:
                self._scheduler.time_step(*timing)

    def close(self) -> None:
        """Ends ``follow()`` on the other processes (the leader of several processes; elsewhere nothing):
        the engine steps no more. Unfinished requests stay unfinished: ``abort_all`` them first."""
        if self._channel is not None and self.is_leader and not self._channel.closed:
            self._channel.publish(pickle.dumps((self._changes, self._timings, True)))
            self._channel.closed = True

    def follow(self) -> None:
        """Runs, on a process other than 0, the steps that process 0 runs on this engine, until it calls
        ``close()``. Raises ``sharding.processes.ProcessFailure`` when a process of the job stopped
        meanwhile; a process that stops while a step waits on it ends this one (status 1, one line)."""
        if self._channel is None or self.is_leader:
            raise RuntimeError("Engine.follow: only processes other than 0 follow, on an engine whose mesh spans "
                               "several processes")
        stop_watching = watch(fail_fast)
        try:
            while True:
                changes, timings, closed = pickle.loads(self._channel.receive())
                for name, *args in changes:
                    {"add": self._add_request, "abort": self._scheduler.abort,
                     "automaton": self._scheduler.automaton_ready,
                     "reset_prefix_cache": self._reset_prefix_cache,
                     "finish_observing": self._scheduler.observe}[name](*args)
                self._learn_timings(timings)
                if closed:
                    return
                self._step()
        finally:
            stop_watching.set()

    def _step(self) -> list[RequestOutput]:
        runner, scheduler, stats = self.runner, self._scheduler, self.stats
        with runner.lock:
            outputs = scheduler.take_ended()
            before, self._in_flight = self._in_flight, None
            if before is not None and not scheduler.may_run_ahead(before.work):
                outputs += self._finish(before)            # the next step's planning needs its tokens
                before = None
            stats.num_preemptions += scheduler.make_room()
            batch, admitted = scheduler.batch, scheduler.admit()
            if admitted.size and runner.prefix_root is not None:
                stats.prefix_cache_queries += int(batch.length[admitted].sum())
                stats.prefix_cache_hits += int(batch.computed[admitted].sum())
            if admitted.size:
                runner.write_controls(batch, admitted)
            prefill = scheduler.prefill()
            if prefill is not None:
                runner.prefill(prefill, batch, stats, progress=self.progress, wait=before is None)
            pending, rows = None, scheduler.decode_rows()
            if rows.size:
                started, layout = time.perf_counter(), runner.layout(batch, rows)
                work = scheduler.schedule(rows, layout.computed)
                if work.catch_up is not None:
                    runner.prefill(work.catch_up, batch, stats, wait=before is None)
                proposal = None
                if work.split:      # constrained requests' drafts: drafted, masked on the host, then verified
                    proposal, drafted, self._carry = runner.propose(work, batch, layout, stats, self._carry)
                    work = scheduler.mask_drafts(work, drafted)
                pending = runner.dispatch(work, batch, layout, stats, started, self._carry, proposal)
                self._carry = pending.carry
            if before is not None:
                outputs += self._finish(before, wait=pending is None)
            if pending is not None:
                scheduler.while_device_runs(pending.work, layout.computed)   # (it learns from ``before`` too)
                if not (runner.overlaps and scheduler.may_run_ahead(pending.work)):
                    outputs += self._finish(pending)
                elif scheduler.live(pending.work).any():
                    self._in_flight = pending
                else:                                       # every request it ran ended a step before
                    scheduler.in_flight = None
            return outputs

    def _finish(self, pending: PendingStep, wait: bool = True) -> list[RequestOutput]:
        """Fetches a dispatched step and applies it: the outputs of its requests still running, the draft
        top-up and ending of those that finished, the acceptance tally and the step's statistics.
        ``wait``: False while the next step is in flight (the top-up is not waited for)."""
        runner, scheduler = self.runner, self._scheduler
        result = runner.fetch(pending, self._fetched if runner.overlaps else 0.0)
        fetched = self._fetched = time.perf_counter()
        live = scheduler.live(pending.work)
        outputs = scheduler.update(pending.work, result)
        if self._channel is not None:       # the controllers learn process 0's time of the step with its next step
            timing = scheduler.take_timing()
            if timing is not None and self.is_leader:
                self._timings.append(timing)
        top_up = scheduler.top_up()
        if top_up is not None:
            runner.prefill(top_up, scheduler.batch, self.stats, wait=wait)
        scheduler.retire()
        if live.any():
            kept = result.subset(live) if not live.all() else result
            self.tally.add(kept.num_verified, kept.num_accepted, kept.num_emitted)
        runner.record(pending, result, self.stats, fetched)
        return outputs

    def warmup(self, max_num_seqs: int, max_len: int, *,
               temperatures: float | Sequence[float] = WARMUP_TEMPERATURES,
               logprobs: bool = False, structured_output: bool = False, progress: bool = False,
               workers: int | None = None) -> int:
        """``SpeculativeDecoder.warmup`` for this engine's steps: up to ``max_num_seqs`` requests of up to
        ``max_len`` positions; ``temperatures``: 0 compiles the all-greedy steps, > 0 the sampled ones
        (any mix of requests); ``logprobs``: also the steps of requests asking for log-probabilities;
        ``structured_output``: also those of requests with ``structured_outputs``; ``workers``: compile
        threads (default: ``graph.compiler.default_workers()``: the cores on a GPU, 1 on a CPU). Returns
        the XLA compilations."""
        return self.runner.warmup(min(max_num_seqs, self.max_num_seqs), max_len, temperatures=temperatures,
                                  logprobs=logprobs, structured_output=structured_output, progress=progress,
                                  workers=workers)

    def warmup_jobs(self, max_num_seqs: int, max_len: int, *,
                    temperatures: float | Sequence[float] = WARMUP_TEMPERATURES,
                    logprobs: bool = False, structured_output: bool = False) -> list[CompileJob]:
        """The executables ``warmup`` and ``start_warmup`` with these arguments compile (those not compiled
        yet), as ``Compiler`` jobs with abstract example arguments; compiles nothing (``largest_first``
        splits them as ``start_warmup`` does)."""
        return self.runner.warmup_jobs(min(max_num_seqs, self.max_num_seqs), max_len, temperatures=temperatures,
                                       logprobs=logprobs, structured_output=structured_output)

    def start_warmup(self, max_num_seqs: int, max_len: int, *,
                     temperatures: float | Sequence[float] = WARMUP_TEMPERATURES,
                     logprobs: bool = False, structured_output: bool = False, progress: bool = False,
                     workers: int | None = None) -> Compiler:
        """``warmup``'s executables, returning once the largest bucket of each kind of step is compiled; the
        others compile in the background while steps run padded to a compiled bucket (never compiling on
        the thread that steps: ``StepRunner.start_warmup``). ``stop()`` the returned compiler at shutdown."""
        return self.runner.start_warmup(min(max_num_seqs, self.max_num_seqs), max_len, temperatures=temperatures,
                                        logprobs=logprobs, structured_output=structured_output, progress=progress,
                                        workers=workers)
