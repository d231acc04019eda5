"""``Engine``: online speculative decoding, vLLM's ``EngineCore`` loop. Requests arrive at any time with
their own ``SamplingParams`` (``add_request``) and leave when done or aborted; each ``step`` admits
waiting requests (FIFO, while a batch row and their KV blocks are free), prefills them, runs one decode
step of the running batch and returns a ``RequestOutput`` for every request that emitted tokens or ended.

    engine = scv_jax.Engine(target, draft, config=scv_jax.DecoderConfig(k=4))
    engine.add_request(list(b"def main("), scv_jax.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_token_ids, out.finish_reason)

A step (``_decode``): choose k (the adaptive controller sees the running batch as it is), each request's
drafts (n-gram on the host, or the draft model inside the step), run the decode executable (propose ->
score -> accept -> commit, ``device_step``) with every request's filters, stop ids and random stream as
data, fetch its summary once, append the tokens, end the requests that stopped.

Blocks: a request reserves the KV blocks of its prompt + max_tokens - 1 positions when admitted and
allocates them as it grows, so a running request never runs out and nothing is preempted; they return
to the pool the moment it finishes or is aborted. Threads: drive an engine from one thread; its methods
hold the decoder's lock, so a second thread (or a second engine on the same decoder) waits its turn.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Literal, Sequence

import jax
import numpy as np

from scv_jax.arguments import require_int
from scv_jax.decoding.device_step import SamplingColumn
from scv_jax.decoding.ngram import NgramIndex, UnverifiedProposals, draft_grid, propose_batch
from scv_jax.decoding.positions import catch_up_rows
from scv_jax.decoding.requests import RequestBatch, check_eos, check_prompt
from scv_jax.decoding.stats import AcceptanceTally, GenerateStats
from scv_jax.decoding.step_inputs import decode_inputs, prefill_chunks
from scv_jax.sampling_params import MAX_STOP_IDS, SamplingParams, batch_sampling_arrays

PREFILL_PROGRESS_SECONDS = 2.0   # a prefill running longer than this reports its progress on stderr

FinishReason = Literal["length", "stop", "abort"]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target's unfiltered distribution at temperature 1,
    and the ``SamplingParams.logprobs`` most likely tokens there: ``top`` ((id, logprob), ...), most
    likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one request did in one ``Engine.step``.

    Attributes:
      request_id: the id ``add_request`` returned.
      new_token_ids: the tokens this step emitted; token_ids: every token generated so far (a stop
        token included).
      finished: whether the request ended; finish_reason: "length" (max_tokens), "stop" (an eos or
        stop token), "abort", or None while it runs.
      num_draft_tokens, num_accepted_tokens: drafts verified and accepted so far;
        num_accepted_per_pos: accepted drafts so far at each draft position (1, 2, ...).
      logprobs: one ``TokenLogprob`` per new token when the request asked for them, else None.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_per_pos: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None


@dataclasses.dataclass
class _Request:
    """A request's own state beside its ``RequestBatch`` row."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sampling: np.ndarray            # float32[SamplingColumn.WIDTH]
    keys: np.ndarray                # int32[2] its random stream
    stops: tuple[int, ...]
    need: int                       # KV blocks it reserves when admitted
    controller_id: int
    row: int = -1                   # its RequestBatch row while it runs
    ngram: NgramIndex | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    drafted: int = 0
    accepted_at: np.ndarray | None = None   # int64[k_max]

    def output(self, new: list[int], reason: FinishReason | None, logprobs=None) -> RequestOutput:
        return RequestOutput(self.request_id, tuple(new), tuple(self.token_ids), reason is not None, reason,
                             self.drafted, int(self.accepted_at.sum()), tuple(self.accepted_at.tolist()), logprobs)


def stream_keys(seed: int) -> np.ndarray:
    """int32[2] the key data (uint32 bits) of the random stream of a request with ``seed``."""
    return np.random.SeedSequence(seed).generate_state(2, np.uint32).view(np.int32)


class Engine:
    """Online decoding of ``target`` with a drafter: ``add_request`` / ``step`` / ``abort``.

    ``target``, ``draft``, ``config``, ``mesh``, ``sharding``: as ``SpeculativeDecoder`` (``draft``: a
    model, an ``NgramDrafter``, ``"ngram"`` or None); or ``target`` a ``SpeculativeDecoder`` to run on
    (its models, caches and compiled executables; the other arguments then left out).
    ``eos_token_id``: the model's end-of-sequence id(s) (None, an int or several), ending a request
    unless its ``ignore_eos``. ``max_num_seqs``: the most requests running at once (default and at
    most the largest batch bucket, per data shard on a mesh: a step never outgrows the compiled
    executables). ``seed``: the stream that seeds requests without a seed. ``progress``: report long
    prefills on stderr.

    A request's tokens do not depend on when it arrived or what it shares the batch with: greedy ones
    exactly, sampled ones draw from their own stream (``SamplingParams.seed``) at each position (the
    same tokens where the numerics of the batch sizes agree; drafts per step must agree too, as with
    a fixed k and no ``packed_verify``).
    """

    def __init__(self, target, draft=None, *, config=None, mesh=None, sharding=None,
                 eos_token_id: int | Sequence[int] | None = None, max_num_seqs: int | None = None, seed: int = 0,
                 progress: bool = False):
        from scv_jax.decoding.decoder import SpeculativeDecoder

        if isinstance(target, SpeculativeDecoder):
            if draft is not None or config is not None or mesh is not None or sharding is not None:
                raise ValueError("Engine: given a SpeculativeDecoder, leave draft, config, mesh and sharding out")
            self.decoder = target
        else:
            self.decoder = SpeculativeDecoder(target, draft, config=config, mesh=mesh, sharding=sharding)
        d = self.decoder
        cfg = self.config = d.config
        self._eos = check_eos(eos_token_id, d.vocab_size, "Engine")
        require_int("Engine", "seed", seed, minimum=0)
        largest = d._decode.dims["batch"].largest
        self._per_shard = largest // len(d.pool.shards)
        if max_num_seqs is not None:
            require_int("Engine", "max_num_seqs", max_num_seqs, minimum=1)
        self.max_num_seqs = largest if max_num_seqs is None else min(max_num_seqs, largest)
        self.progress = progress
        k_max = d._step_ks[-1]
        self._batch = RequestBatch(largest, cfg.max_seq_len + k_max + 2, cfg.block_size, cfg.max_blocks_per_seq)
        self._k_max = cfg.tree.max_depth if cfg.tree else max(cfg.allowed_k)   # the most drafts a step accepts
        self._requests: dict[str, _Request] = {}           # waiting and running, by id
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}            # by row
        self._ended: list[RequestOutput] = []              # aborted requests, reported by the next step
        self._rng = np.random.default_rng(seed)
        self._next_id = 0
        self.stats = GenerateStats()
        self.tally = AcceptanceTally(self._k_max)
        # the adaptive controller: the last step's counts and time (told before the next decision),
        # the k it chose for the next step while this one ran, n-gram proposals a k = 0 step left
        self._observed: tuple | None = None
        self._decided: tuple[str, int, int] | None = None
        self._unverified: UnverifiedProposals | None = None

    # ------------------------------------------------------------------ requests
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_blocks(self) -> int:
        """KV blocks free in the pool (``num_blocks`` when no request runs)."""
        return self.decoder.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.decoder.pool.num_blocks

    def has_unfinished(self) -> bool:
        """Whether a request waits or runs, or an abort is still to be reported by ``step``."""
        return bool(self._requests or self._ended)

    def _check_fits(self, prompt: list[int], params: SamplingParams) -> int:
        """The KV blocks the request reserves; raises ValueError when it can never run."""
        d, cfg = self.decoder, self.config
        positions = len(prompt) + params.max_tokens - 1      # drafts never outrun the budget
        limit = d.max_position_embeddings
        if limit is not None and positions + 1 > limit:
            raise ValueError(f"add_request: prompt ({len(prompt)} tokens) + max_tokens {params.max_tokens} = "
                             f"{positions + 1} positions exceed the model's max_position_embeddings {limit}")
        if positions > cfg.max_seq_len:
            raise ValueError(f"add_request: the request needs up to {positions} cache positions (prompt "
                             f"{len(prompt)} + max_tokens {params.max_tokens} - 1) but DecoderConfig.max_seq_len "
                             f"is {cfg.max_seq_len}")
        need = self._batch.blocks_needed(positions)
        pool = d.pool.shards[0]
        if need > pool.num_blocks:
            where = "the cache" if len(d.pool.shards) == 1 else "a data shard"
            raise ValueError(f"add_request: the request needs {need} KV blocks but {where} holds "
                             f"{pool.num_blocks} (raise DecoderConfig.num_blocks)")
        return need

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request (FIFO); it runs as soon as a batch row and its KV blocks are free. Returns
        its id (``request_id``, or a new one). Raises ValueError at once for a request that can never
        run (longer than ``DecoderConfig.max_seq_len``, the model's context or the cache) or bad input."""
        d = self.decoder
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"add_request: params must be a SamplingParams or None, got {type(params).__name__}")
        prompt = check_prompt("add_request", "prompt_token_ids", prompt_token_ids, d.vocab_size)
        stops = tuple(dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else self._eos)))
        if len(stops) > MAX_STOP_IDS or any(t >= d.vocab_size for t in stops):
            raise ValueError(f"add_request: SamplingParams.stop_token_ids must hold ids in [0, vocab_size="
                             f"{d.vocab_size}), at most {MAX_STOP_IDS} with the model's eos ids, got "
                             f"{params.stop_token_ids!r} (eos {self._eos!r})")
        if self.config.tree is not None and params.logprobs is not None:
            raise ValueError("add_request: SamplingParams.logprobs needs chain drafts (DecoderConfig.tree=None)")
        with d._lock:
            if request_id is None:             # never an id given before (nor one the caller uses now)
                while str(self._next_id) in self._requests:
                    self._next_id += 1
                request_id = str(self._next_id)
                self._next_id += 1
            elif not isinstance(request_id, str) or not request_id:
                raise ValueError(f"add_request: request_id must be a non-empty str or None, got {request_id!r}")
            if request_id in self._requests:
                raise ValueError(f"add_request: request_id {request_id!r} is already waiting or running")
            need = self._check_fits(prompt, params)
            sampling = np.stack(batch_sampling_arrays([params]), axis=1)[0].astype(np.float32)
            sampling[SamplingColumn.TOP_K] = min(sampling[SamplingColumn.TOP_K], d.vocab_size)
            keys = (stream_keys(params.seed) if params.seed is not None
                    else self._rng.integers(0, 2 ** 32, 2, dtype=np.uint32).view(np.int32))
            request = _Request(request_id, prompt, params, sampling, keys, stops, need, d._new_request_id(),
                               accepted_at=np.zeros(self._k_max, np.int64))
            self._requests[request_id] = request
            self._waiting.append(request)
            self.stats.prompt_tokens += len(prompt)
        return request_id

    def abort(self, request_id: str) -> None:
        """Ends a waiting or running request now (its blocks return to the pool); the next ``step``
        reports it with finish_reason "abort". An unknown or finished id is ignored."""
        with self.decoder._lock:
            request = self._requests.pop(request_id, None)
            if request is None:
                return
            if request.row < 0:
                self._waiting.remove(request)
            else:
                self._end([request.row])
            self._ended.append(request.output([], "abort"))

    def _abort_all(self) -> None:
        """Aborts every waiting and running request (a loop over the engine that stops early)."""
        for request_id in list(self._requests):
            self.abort(request_id)

    def _end(self, rows: list[int]) -> None:
        """Frees the rows (and blocks) of requests that ended and forgets the requests."""
        self._batch.finish(np.array(rows, np.int64))
        for row in rows:
            request = self._running.pop(row)
            request.row = -1
            self._requests.pop(request.request_id, None)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Admits waiting requests (prefilling them), runs one decode step of the running batch and
        returns an output for every request that emitted tokens or ended (aborts included)."""
        with self.decoder._lock:
            outputs, self._ended = self._ended, []
            self._admit()
            if self._running:
                outputs += self._decode()
            return outputs

    def warmup(self, max_num_seqs: int, max_len: int, *, temperatures: float | Sequence[float] = (0.0, 1.0),
               logprobs: bool = False, progress: bool = False) -> int:
        """``SpeculativeDecoder.warmup`` for this engine's steps: up to ``max_num_seqs`` requests of up to
        ``max_len`` positions; ``temperatures``: 0 compiles the all-greedy steps, > 0 the sampled ones
        (any mix of requests); ``logprobs``: also the steps of requests asking for log-probabilities.
        Returns the XLA compilations."""
        return self.decoder.warmup(min(max_num_seqs, self.max_num_seqs), max_len, temperatures=temperatures,
                                   logprobs=logprobs, progress=progress)

    def _admit(self) -> None:
        """Moves waiting requests, in order, to free rows while their blocks fit (on a mesh, on the data
        shard with the fewest requests), then prefills them."""
        d, state = self.decoder, self._batch
        admitted = []
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting[0]
            load = np.bincount(state.shards[state.active], minlength=len(d.pool.shards))
            shard = d.pool.pick(request.need, load, self._per_shard)
            if shard is None:
                break
            self._waiting.popleft()
            request.row = state.start(request.prompt, request.params.max_tokens, d.pool.shards[shard], shard,
                                      request.sampling, request.keys, request.stops)
            self._running[request.row] = request
            admitted.append(request.row)
        if admitted:
            self._unverified = None          # proposals are checked against the rows they were made for
            self._start_running(np.array(admitted, np.int64))

    def _start_running(self, rows: np.ndarray) -> None:
        """Commits the prompts of ``rows`` but their last token to both caches (the time goes to
        ``stats.prefill_seconds``) and, with n-gram drafting, indexes them."""
        begin = time.perf_counter()
        state = self._batch
        self._prefill_rows(rows, np.zeros(rows.size, np.int64), state.prompt_len[rows] - 1, draft_only=False)
        if self.decoder.drafter is not None:
            for row in rows.tolist():
                self._running[row].ngram = self.decoder.drafter.index(self._running[row].prompt)
        self.stats.prefill_seconds += time.perf_counter() - begin

    def _prefill_rows(self, rows: np.ndarray, begin: np.ndarray, count: np.ndarray, *, draft_only: bool) -> None:
        """Commits tokens [begin[b], begin[b] + count[b]) of each request to both caches (the draft's
        alone with ``draft_only``), ``prefill_chunk`` tokens a call."""
        d, state = self.decoder, self._batch
        state.ensure(rows, begin + count)
        longest = int(count.max(initial=0))
        start = reported = time.perf_counter()
        for done, sub, inputs in prefill_chunks(state, rows, begin, count, self.config.prefill_chunk):
            layout = d.placement.rows(state.shards[sub], d._prefill)
            d._run(d._prefill, self.stats, use_target=not draft_only, use_draft=d._draft is not None,
                   **layout.arrange(d._prefill, **inputs))
            if done >= longest:      # wait for the last chunk: its time is the prefill's, not the next step's
                d._caches.put(*jax.block_until_ready(d._caches.take()))
            now = time.perf_counter()
            if self.progress and now - reported > PREFILL_PROGRESS_SECONDS:
                reported = now
                print(f"prefill: {min(done, longest)}/{longest} prompt tokens "
                      f"({now - start:.1f} s, compiling {self.stats.compile_seconds:.1f} s of it)",
                      file=sys.stderr, flush=True)

    def _catch_up(self, rows: np.ndarray) -> None:
        """Before a step that runs the draft: commits the tokens that k = 0 steps left out of the draft
        cache (``positions.catch_up_rows``), so every lag is at most ``MAX_CATCH_UP``."""
        state = self._batch
        missing = catch_up_rows(state.lag[rows])
        lagging = missing > 0
        if lagging.any():
            behind = rows[lagging]
            self._prefill_rows(behind, state.length[behind] - state.lag[behind], missing[lagging], draft_only=True)
            state.lag[behind] = 1
            self.stats.catch_up_calls += 1
        state.may_lag = False

    def _choose_k(self, kind: str, batch: int, ids: np.ndarray, remaining: np.ndarray | None) -> int:
        """The k of the coming step: the config's, or the controller's (decided while the last step ran,
        unless the batch changed)."""
        controller = self.decoder.controllers.get(kind)
        if controller is None:
            return self.config.k
        if self._decided is not None and self._decided[:2] == (kind, batch):
            return self._decided[2]
        self._observe()
        return controller.next_k(batch, ids, remaining)

    def _observe(self) -> None:
        """Tells the controller about the last step (if not yet told)."""
        if self._observed is not None:
            kind, drafts, accepted, seconds, batch, ids, k = self._observed
            self.decoder.controllers[kind].update(drafts, accepted, seconds, batch, ids, k=k)
            self._observed = None

    def _decode(self) -> list[RequestOutput]:
        if self.config.tree is not None:
            from scv_jax.decoding.tree_engine import decode_tree_step
            return decode_tree_step(self)
        step_start = time.perf_counter()
        d, state, stats = self.decoder, self._batch, self.stats
        rows = state.active
        requests = [self._running[row] for row in rows.tolist()]
        layout = d.placement.rows(state.shards[rows], d._decode)
        batch = layout.computed        # the controller sees the rows computed (padding costs like real ones)
        greedy = not state.sampling[rows, SamplingColumn.TEMPERATURE].any()
        logprobs = any(r.params.logprobs is not None for r in requests)
        kind = "greedy" if greedy else "sampling"
        controller = d.controllers.get(kind)
        ids = np.array([r.controller_id for r in requests], np.int64)
        budget = state.budget[rows]                        # tokens each request has left (until this step ends)
        k = self._choose_k(kind, batch, ids, budget)
        caps = np.minimum(budget - 1, k)                   # never draft past a request's budget
        proposals = propose_batch([r.ngram for r in requests], caps) if d.drafter is not None else None
        num_drafts = caps if proposals is None else np.array([len(p) for p in proposals], np.int64)
        step_k = d._step_k(int(num_drafts.max()))
        if d._draft is not None and step_k and state.may_lag:
            self._catch_up(rows)
        state.ensure(rows, state.length[rows] + num_drafts)
        width = int(state.num_blocks[rows].max())
        planning = time.perf_counter()
        plan = d._decode_plan(layout.size, width, step_k, greedy, layout.scattered, logprobs=logprobs)
        size = plan.padded["batch"] or layout.size
        packed_k = 0 if logprobs else d._packed_k(num_drafts, size, step_k)
        if packed_k:
            plan = d._decode_plan(layout.size, width, step_k, greedy, layout.scattered, packed_k=packed_k)
        step_start += time.perf_counter() - planning     # a shape's one-off planning is no step cost
        inputs = decode_inputs(state, rows, layout.rows, size, plan.padded["blocks"] or width, num_drafts)
        if proposals is not None:
            inputs["drafts"] = draft_grid(proposals, layout.rows, size, step_k)
        if layout.scattered:
            inputs["request_mask"] = np.zeros(size, np.bool_)
            inputs["request_mask"][layout.rows] = True
        scored = size * (packed_k + 1) if packed_k else None      # tokens a packed step's target scores
        dispatch = time.perf_counter()
        summary, *step_logprobs = d._run(d._decode, stats, use_draft=d._draft is not None and step_k > 0,
                                         plan=plan, **inputs)
        if controller:     # while the device runs this step: learn from the last one, choose the next k
            self._observe()
            self._decided = (kind, batch, controller.next_k(batch, ids, budget))
        host, host_logprobs = layout.fetch(summary, *step_logprobs)     # the step's one device-to-host transfer
        cold = d._decode.last_call_first_run        # compiled now or ahead of time, never run
        fetched = time.perf_counter()
        step_seconds = fetched - step_start
        appended, done, stopped = state.advance(rows, host.output_token_ids, host.num_emitted, host.num_accepted,
                                                step_k)
        outputs = self._outputs(requests, appended, done, stopped, num_drafts, host.num_accepted, host_logprobs)
        if controller:   # a compile or an executable's first run is no step cost: leave that step untimed
            # the controller's acceptance counts a draft the drafter could not offer (no n-gram match,
            # a short one) as a rejection at that position: E(k) is then what a step of k really emits
            counts = (np.minimum(caps, step_k), host.num_accepted)
            if d.drafter is not None:
                counts = self._check_unverified(rows, step_k) or counts
            # (k as chosen, or as far as the budgets let it draft: a step that ends them costs less)
            self._observed = (kind, *counts, None if cold else step_seconds, batch, ids, int(caps.max(initial=0)))
        self.tally.add(num_drafts, host.num_accepted, host.num_emitted)
        stats.add_step(batch, step_k, None if cold else step_seconds + time.perf_counter() - fetched,
                       dispatch - step_start + time.perf_counter() - fetched, scored)
        if done.any():
            self._end(rows[done].tolist())
        return outputs

    def _outputs(self, requests: list[_Request], appended: np.ndarray, done: np.ndarray, stopped: np.ndarray,
                 num_drafts: np.ndarray, num_accepted: np.ndarray, logprobs) -> list[RequestOutput]:
        """Each request's output of the step (those that emitted or ended), after recording its tokens."""
        outputs = []
        for i, request in enumerate(requests):
            row, count = request.row, int(appended[i])
            request.drafted += int(num_drafts[i])
            request.accepted_at[:int(num_accepted[i])] += 1
            new = self._batch.tokens[row, self._batch.length[row] - count:self._batch.length[row]].tolist()
            request.token_ids += new
            if request.ngram is not None:
                request.ngram.extend(new)
            if not (count or done[i]):
                continue
            n = request.params.logprobs
            token_logprobs = None if n is None else tuple(
                TokenLogprob(token, float(logprobs.logprob[i, j]),
                             tuple(zip(logprobs.top_ids[i, j, :n].tolist(), logprobs.top_logprobs[i, j, :n].tolist())))
                for j, token in enumerate(new))
            reason = ("stop" if stopped[i] else "length") if done[i] else None
            outputs.append(request.output(new, reason, token_logprobs))
        return outputs

    def _check_unverified(self, rows: np.ndarray, step_k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """n-gram drafting at a k = 0 step (the controller's choice, or the budgets' end): the counterfactual
        (offered, accepted) of ``rows`` once the proposals made some k = 0 steps ago can be checked
        (``UnverifiedProposals``; the controller learns acceptance from them while it holds k = 0), and
        new proposals to check. None while none is due; a step with drafts drops them (it counts its own),
        and so does an admission (a row may then hold another request)."""
        state, pending = self._batch, self._unverified
        if step_k:
            self._unverified = None
            return None
        counts = None
        if pending is not None:
            pending.due -= 1
            if pending.due > 0:
                return None
            offered, accepted = np.zeros((2, state.num_slots), np.int64)
            offered[pending.rows], accepted[pending.rows] = pending.check(state.tokens, state.length)
            counts = offered[rows], accepted[rows]
        active = state.active
        self._unverified = UnverifiedProposals.propose(
            [self._running[r].ngram for r in active.tolist()], active, state.length[active],
            np.minimum(state.budget[active] - 1, self.decoder._step_ks[-1]))
        return counts

