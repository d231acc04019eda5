"""``Scheduler``: the engine's host policy, no JAX. It holds the waiting queue and the running requests'
``RequestBatch``; makes room for the running requests' next step (preempting the most recently admitted
when the blocks run out); admits requests FIFO while a row and their KV blocks are free; plans each decode step
(k from the config or the adaptive controller, each request's cap, the proposer's drafts, a catch-up of
lagging drafts) as a ``DecodeWork``; and turns the step's ``StepResult`` into ``RequestOutput``s,
ending the requests that finished. The proposer's host drafter hears every request's lifecycle.

Blocks are allocated on demand: a request is admitted when its tokens so far and its first step's
drafts fit beside what the running requests need for their next step; it allocates blocks as it grows;
they return to the pool the moment it ends. When the running requests' next step does not fit its pool,
the most recently admitted one is preempted by recompute: its blocks return to the pool, its drafter
hears ``finish``, and it waits at the front of the queue with its tokens so far, which it prefills again
when it resumes (its output is unchanged: the random streams are by position).

Prompts are prefilled in chunks under a token budget (``max_num_batched_tokens``), as vLLM v1 does: each
step first counts every decoding request's tokens (1 + the most drafts its step may verify), then gives
the requests being prefilled, in admission order, chunks of their prompts with the rest (at least one
``prefill_chunk``), so a long prompt never stalls the running requests for more than a budget's worth of
prefill; a request joins the decode steps once its prompt is in the caches.

One step in flight (``DecoderConfig.overlap``): the engine may plan a step while the one before runs
(``in_flight``, not yet fetched). That step's requests run in the new one with their rows moved on by the
device (``DecodeWork.carried``); their blocks cover what both steps may append; the results of a step are
applied only to the requests still running as it was planned (``live``): one that ended, was aborted or
preempted since is dropped. With ``draft_ahead``, a host drafter's chains for such a request continue
its tokens and the drafts of the step in flight, assumed accepted, after a guess of the token that step
ends with (the drafter's first proposal; ``DecodeWork.assumed``); where that step turns out otherwise
they are rejected, and the next step assumes none of them accepted. A constrained request (structured
output) sits out the step after one it runs in (``decode_rows``): its masks follow its grammar, which the
host moves on only once that step is fetched; it runs again in the step after, its masks computed while the
device runs. When constrained requests are more than a quarter of the batch, its steps run synchronously
instead (``may_run_ahead``). Steps whose planning needs the last tokens (``may_run_ahead``) are fetched first.
With drafts made on the device (a draft model's or an EAGLE-3 head's, ``Proposer.device_drafts``), each
constrained request drafts along its grammar's drafting automaton (``grammar_automaton``, built on a
thread: free drafts until it is ready), and the step verifies its drafts with the automaton's masks too;
``update`` cuts its tokens where those masks would choose otherwise than its grammar's
(``Grammars.agreeing_prefix``). A constrained request that cannot be verified so (no automaton yet, one
cut before, logit controls) splits a chain step (``DecodeWork.split``, synchronous: the device drafts,
``mask_drafts`` cuts the drafts with the grammars and masks the positions the second call verifies), and
verifies no drafts in a tree step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
from typing import Any, Protocol, Sequence

import numpy as np

from scv_jax.decoding.grammar import Grammars
from scv_jax.decoding.grammar_automaton import AutomatonBuilder, DraftTables, automaton_for, draft_key
from scv_jax.decoding.outputs import FinishReason, RequestOutput, TokenLogprob
from scv_jax.decoding.plan import Assumption, DecodeWork, Drafts, Observation, PrefillWork, SamplingColumn, StepResult
from scv_jax.decoding.positions import catch_up_rows
from scv_jax.decoding.proposers.base import Proposer, Trie, path_trie, smallest_fitting
from scv_jax.decoding.proposers.ngram import UnverifiedProposals
from scv_jax.decoding.requests import RequestBatch
from scv_jax.sampling_params import SamplingParams, StructuredOutputsParams


class Controller(Protocol):
    """The adaptive controller as the scheduler uses it (``scv_jax.adaptive.AdaptiveController``)."""

    def next_k(self, batch: int, ids: np.ndarray, remaining: np.ndarray | None) -> int: ...

    def update(self, drafts, accepted, seconds, batch, ids, *, k: int | None = None) -> None: ...

    def time_step(self, batch: int, k: int, seconds: float) -> None: ...


class BlockPools(Protocol):
    """The KV block pools, one per data shard (``placement.ShardedBlockPool``)."""

    shards: list

    def pick(self, need: Sequence[int], load: Sequence[int], growth: Sequence[int], per_shard: int) -> int | None: ...


MAX_AUTOMATA = 16    # drafting automata kept for constraints seen before (``Scheduler._drafting_automaton``;
                     # up to ~2 MB each at a 150k vocabulary)
# the largest share of the running requests that may be constrained for steps to overlap (each constrained
# request sitting out every other step); more make the steps synchronous (docs/engine.md, "One step in flight")
CONSTRAINED_SIT_OUT_SHARE = 0.25
# one-call steps verify a draft model's or a head's constrained drafts with their drafting automata's masks
# where they may (``Scheduler._verified_on_device``); False: every such chain step splits, trees verify none
# (bench_structured's A/B)
VERIFY_WITH_AUTOMATA = True


@dataclasses.dataclass
class Request:
    """A request's own state beside its ``RequestBatch`` row."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sampling: np.ndarray            # float32[SamplingColumn.WIDTH]
    keys: np.ndarray                # int32[2] its random stream
    stops: tuple[int, ...]
    controller_id: int
    accepted_at: list[int]          # [max_depth] accepted drafts at each position
    row: int = -1                   # its RequestBatch row while it runs
    num_cached_tokens: int = 0      # prompt tokens its first admission found in the prefix cache
    token_ids: list[int] = dataclasses.field(default_factory=list)      # generated so far
    drafted: int = 0
    matcher: Any = None             # its structured output's grammar state (an llguidance LLMatcher), at token_ids
    automaton: Any = None           # its drafting automaton being built (a Future of a ``TokenAutomaton`` or None)
    automaton_ready: bool = False   # its steps draft with that automaton (``Scheduler.ready_automata``)
    automaton_at: tuple[int, int] | None = None   # (its automaton's state, after that many of token_ids)
    automaton_agrees: bool = True   # no step found its automaton's masks other than its grammar's
    prediction_accepted: int = 0    # drafts from its prediction verified and accepted
    prediction_rejected: int = 0    # ... and rejected

    def output(self, new: list[int], reason: FinishReason | None, logprobs=None) -> RequestOutput:
        stop_token = self.token_ids[-1] if reason == "stop" and self.token_ids[-1:] and \
            self.token_ids[-1] in self.stops else None
        return RequestOutput(self.request_id, tuple(new), tuple(self.token_ids), reason is not None, reason,
                             self.drafted, sum(self.accepted_at), tuple(self.accepted_at), logprobs,
                             self.num_cached_tokens, self.prediction_accepted, self.prediction_rejected,
                             stop_token_id=stop_token)


def step_budget(budget: np.ndarray, requests: list[Request]) -> np.ndarray:
    """int64[B] the tokens each request may emit in one step: its ``budget`` (the tokens it has left), at
    most its ``SamplingParams.num_speculative_tokens`` + 1 (its drafts, and the caps and remaining tokens
    the adaptive controller sees, stop there)."""
    limits = [r.params.num_speculative_tokens for r in requests]
    if all(n is None for n in limits):
        return budget
    return np.minimum(budget, [b if n is None else n + 1 for b, n in zip(budget.tolist(), limits)])


class Scheduler:
    """Queues, admission, per-step k and caps, drafts, finishing (see the module docstring).

    ``batch``: the running requests' rows; ``pools``: the KV block pools; ``proposer``: the drafter's host
    half; ``controllers``: {"greedy" | "sampling": controller} (empty: ``k`` always); ``max_num_seqs``:
    the most requests running; ``per_shard``: the most on one data shard; ``max_num_batched_tokens``: the
    tokens a step computes; ``prefill_chunk``: the prompt tokens per request of one prefill call;
    ``grammars``: structured output's masks (``grammar.Grammars``; None: no request is constrained);
    ``draft_ahead``: host chains are drafted with a step in flight (``DecoderConfig.draft_ahead``).
    """

    def __init__(self, batch: RequestBatch, pools: BlockPools, proposer: Proposer,
                 controllers: dict[str, Controller], *, k: int, max_num_seqs: int, per_shard: int,
                 max_num_batched_tokens: int, prefill_chunk: int, grammars: Grammars | None = None,
                 draft_ahead: bool = False):
        self.batch, self._pools, self.proposer, self._controllers = batch, pools, proposer, controllers
        self.draft_ahead = draft_ahead
        self.grammars = grammars
        # constrained requests' drafts made on the device follow their drafting automata; chains not verified
        # with them run split steps (``mask_drafts``), trees verify none
        self.automata = grammars is not None and proposer.device_drafts
        self.splits = self.automata and proposer.device_chains
        self.draft_tables = DraftTables(grammars.vocab_size) if self.automata else None
        self._builder: AutomatonBuilder | None = None
        self._automata: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._builds: concurrent.futures.ThreadPoolExecutor | None = None     # (one thread, made at first use)
        self._k, self.max_num_seqs, self._per_shard = k, max_num_seqs, per_shard
        self.max_num_batched_tokens, self._chunk = max_num_batched_tokens, prefill_chunk
        self.requests: dict[str, Request] = {}             # waiting and running, by id
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}              # by row
        self._ended: list[RequestOutput] = []              # aborted requests, reported by the next step
        # the controller: the last step (told before the next decision), the k it chose for the next step
        # while this one ran, a k = 0 step's host proposals still to check
        self._observed: Observation | None = None
        self._decided: tuple[str, int, int] | None = None
        self._unverified: UnverifiedProposals | None = None
        self._finished = np.zeros(0, np.int64)            # rows that finished in the last update, until retire
        self.in_flight: DecodeWork | None = None          # the step dispatched and not yet fetched (overlap)
        # an engine over several processes: its leader's step() decides which automata are ready (every process
        # then drafts along them from the same step); else each step uses those built by its planning
        self.automata_from_leader = False

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        if request.matcher is not None and self.automata:
            request.automaton = self._drafting_automaton(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _drafting_automaton(self, request: Request) -> concurrent.futures.Future:
        """The drafting automaton of a constrained request (``grammar_automaton.automaton_for``), built on a
        thread of its own (seconds at a 150k vocabulary; the request drafts freely until it is ready: the
        automaton only speeds it up), once per constraint: the last ``MAX_AUTOMATA`` are kept."""
        params = request.params.structured_outputs
        key = draft_key(params)
        if key not in self._automata:
            if self._builds is None:
                self._builds = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scv-jax-automata")
            self._automata[key] = self._builds.submit(self._build, params, request.request_id)
            while len(self._automata) > MAX_AUTOMATA:
                self._automata.popitem(last=False)
        self._automata.move_to_end(key)
        return self._automata[key]

    def _build(self, params: StructuredOutputsParams, request_id: str) -> Any:
        """(On the builds' thread.) The automaton, or None; an error here never reaches the engine's thread:
        it is logged, and the request drafts freely."""
        try:
            if self._builder is None:
                self._builder = AutomatonBuilder(self.grammars.token_bytes(), self.grammars.eos_ids)
            return automaton_for(params, self._builder, request_id)
        except Exception:
            logging.getLogger(__name__).exception("request %s: its drafting automaton failed to build", request_id)
            return None

    def ready_automata(self) -> list[str]:
        """Lets the requests whose drafting automaton was built since the last call draft along it from the
        step planned next; returns their ids (what a followed engine's followers learn: ``automaton_ready``)."""
        ready = [request.request_id for request in self.requests.values()
                 if request.automaton is not None and not request.automaton_ready and request.automaton.done()]
        for request_id in ready:
            self.requests[request_id].automaton_ready = True
        return ready

    def automaton_ready(self, request_id: str) -> None:
        """(A follower.) Request ``request_id``'s drafting automaton was ready on the leader at this step:
        waits for this process's own build of it, so every process plans the same steps."""
        request = self.requests.get(request_id)
        if request is not None and request.automaton is not None:
            request.automaton.result()
            request.automaton_ready = True

    def abort(self, request_id: str) -> None:
        """Ends a waiting or running request now; ``take_ended`` reports it. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.row < 0:
            self.waiting.remove(request)
        else:
            self._end([request.row])
        self._ended.append(request.output([], "abort"))

    def take_ended(self) -> list[RequestOutput]:
        """The outputs of the requests aborted since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._ended)

    def _end(self, rows: list[int]) -> None:
        """Frees the rows (and blocks) of requests that ended, tells the drafter, forgets them."""
        self.batch.finish(np.array(rows, np.int64))
        for row in rows:
            request = self.running.pop(row)
            request.row = -1
            self.requests.pop(request.request_id, None)
            self._forget(request)

    def _forget(self, request: Request) -> None:
        """Tells the drafter (and the predictions) that a running request ended or was preempted."""
        if self.proposer.host is not None:
            self.proposer.host.finish(request.request_id)
        if request.params.prediction:
            self.proposer.predictions.finish(request.request_id)

    # ------------------------------------------------------------------ blocks
    def _ahead(self, rows: np.ndarray) -> np.ndarray:
        """int64[len(rows)] the most tokens the step in flight may still append to each request (0: none)."""
        ahead = np.zeros(self.batch.num_slots, np.int64)
        work = self.in_flight
        if work is not None:
            live = self.live(work)
            ahead[work.rows[live]] = work.drafts.num_drafts[live] + 1
        return ahead[rows]

    def live(self, work: DecodeWork) -> np.ndarray:
        """bool[B] the requests of ``work`` still running as it was planned (not ended, aborted or
        preempted since)."""
        state = self.batch
        running = np.array([row in self.running for row in work.rows.tolist()], np.bool_)
        return running & (state.epoch[work.rows] == work.epochs)

    def may_run_ahead(self, work: DecodeWork) -> bool:
        """Whether the step after ``work`` may be planned before ``work``'s results are known: not with a
        host drafter (its drafts continue the tokens), unless its chains are drafted ahead (``draft_ahead``:
        past ``work``'s drafts assumed accepted, ``_host_views``), a draft model after a k = 0 step (its
        catch-up reads the lag), or while constrained requests are more than a quarter of the running ones:
        each would sit out every other step (``decode_rows``), which costs more than the host's share of a
        synchronous step unless that share is large (docs/engine.md, "One step in flight")."""
        constrained = sum(r.matcher is not None for r in self.running.values())
        return (not work.split and (self.proposer.host is None or (self.draft_ahead and self.proposer.host_chains))
                and constrained <= CONSTRAINED_SIT_OUT_SHARE * len(self.running)
                and not (self.proposer.has_draft_model and (work.drafts.step_k == 0 or self.batch.may_lag)))

    def _growth(self, rows: np.ndarray) -> np.ndarray:
        """int64[len(rows)] the blocks each running request may need for its next step: its tokens, what
        the step in flight may append and as many drafts as the deepest step may verify (never past its
        budget)."""
        state = self.batch
        drafts = np.minimum(state.budget[rows] - 1, self._ahead(rows) + self.proposer.max_depth)
        return state.blocks_short(rows, state.length[rows] + drafts)

    def _shard_growth(self) -> np.ndarray:
        """int64[shards] the blocks the running requests of each data shard may need for their next step."""
        state = self.batch
        rows = state.active
        return np.bincount(state.shards[rows], self._growth(rows), minlength=len(self._pools.shards)).astype(np.int64)

    def make_room(self) -> int:
        """Preempts running requests, the most recently admitted first, until every data shard's pool
        holds the blocks its running requests may need for their next step; returns how many it preempted
        (a request alone always fits: ``Engine.add_request`` refuses one larger than a pool)."""
        state, preempted = self.batch, 0
        for shard, pool in enumerate(self._pools.shards):
            while True:
                rows = state.active[state.shards[state.active] == shard]     # in admission order
                if rows.size <= 1 or self._growth(rows).sum() <= pool.num_free:
                    break
                self._preempt(int(rows[-1]))
                preempted += 1
        return preempted

    def _preempt(self, row: int) -> None:
        """Frees ``row``'s request and its blocks (its full ones stay cached), tells the drafter, and
        queues it first again."""
        request = self.running.pop(row)
        self.batch.finish(np.array([row], np.int64))
        request.row = -1
        self._forget(request)
        self.waiting.appendleft(request)
        self._unverified = None          # proposals are checked against the rows they were made for

    # ------------------------------------------------------------------ admission
    def admit(self) -> np.ndarray:
        """Moves waiting requests, in order, to free rows while their tokens so far and their first step
        fit beside the running requests' next step (on a mesh, on the data shard with the fewest
        requests), each starting from the cached blocks of its longest cached prefix (``batch.computed``),
        and while this step's token budget has room for their prefill (one at least when none is being
        prefilled); a request whose prefix a request being prefilled is about to cache waits for it
        (``_prefix_pending``); returns their rows. ``prefill`` then plans their prompts' chunks."""
        state, pools = self.batch, self._pools
        admitted = []
        growth = self._shard_growth() if self.waiting else None
        room = self._prefill_room() - int(state.to_prefill(state.prefilling).sum()) if self.waiting else 0
        while self.waiting and len(self.running) < self.max_num_seqs and (room > 0 or not state.prefilling.size):
            request = self.waiting[0]
            params = request.params
            tokens = request.prompt + request.token_ids
            budget = params.max_tokens - len(request.token_ids)
            need = state.blocks_needed(len(tokens) + min(budget - 1, self.proposer.max_depth))
            hashes = state.prefix_hashes(tokens)
            cached = [pool.cached_prefix(hashes) for pool in pools.shards]
            # a cached block no request holds is counted free: taking it costs as much as a new one
            cost = [need - len(hit) + pool.num_unheld(hit) for pool, hit in zip(pools.shards, cached)]
            if self._prefix_pending(tokens, max(map(len, cached))):
                break
            load = np.bincount(state.shards[state.active], minlength=len(pools.shards))
            shard = pools.pick(cost, load, growth, self._per_shard)
            if shard is None:
                break
            self.waiting.popleft()
            growth[shard] += need - len(cached[shard])
            pools.shards[shard].hold(cached[shard])
            request.row = state.start(tokens, len(request.prompt), budget, shard, request.sampling, request.keys,
                                      request.stops, params if params.controlled else None, cached=cached[shard],
                                      hashes=hashes[:len(cached[shard])], lag=self.proposer.lag_after_prefill)
            if not request.token_ids:
                request.num_cached_tokens = min(int(state.computed[request.row]), len(request.prompt))
            self.running[request.row] = request
            admitted.append(request.row)
            room -= len(tokens) - 1 - int(state.computed[request.row])
            if self.proposer.host is not None:
                self.proposer.host.start(request.request_id, request.prompt)
                if request.token_ids:
                    self.proposer.host.extend(request.request_id, request.token_ids)
            if params.prediction:
                self.proposer.predictions.start(request.request_id, len(request.prompt), params.prediction)
        if admitted:
            self._unverified = None          # proposals are checked against the rows they were made for
        return np.array(admitted, np.int64)

    def _prefix_pending(self, tokens: list[int], cached: int) -> bool:
        """Whether a request being prefilled shares more full blocks with ``tokens`` (a waiting request's)
        than the ``cached`` ones its prefix finds now: the waiting request then waits until they are
        cached rather than compute them again (the siblings of an ``n > 1`` request, prompts that share
        a long system prompt). False without prefix caching."""
        state, size = self.batch, self.batch.block_size
        full = (len(tokens) - 1) // size          # the blocks a request may find cached
        rows = state.prefilling
        if state.prefix_root is None or full <= cached or not rows.size:
            return False
        probe = np.asarray(tokens[:full * size], np.int32)
        for row in rows.tolist():
            limit = min(full, (int(state.length[row]) - 1) // size) * size
            same = state.tokens[row, :limit] == probe[:limit]
            if (limit if same.all() else int(np.argmin(same))) // size > cached:
                return True
        return False

    # ------------------------------------------------------------------ chunked prefill
    def _prefill_room(self) -> int:
        """The tokens of this step's budget left for prefill once every decoding request has its decode
        tokens (1 + the most drafts its step may verify); at least one ``prefill_chunk``."""
        rows = self.batch.decoding
        budget = step_budget(self.batch.budget[rows], [self.running[row] for row in rows.tolist()])
        decode = int((1 + np.minimum(budget - 1, self.proposer.step_ks[-1])).sum())
        return max(self.max_num_batched_tokens - decode, self._chunk)

    def prefill(self) -> PrefillWork | None:
        """This step's prompt chunks: the requests being prefilled, in admission order, each the rest of
        its prompt or as many whole ``prefill_chunk``s as the step's budget has room for; None when none
        is being prefilled. Counts the chunks as computed, allocates their blocks and caches those they fill;
        gives back those no query from the chunks on attends to (``RequestBatch.release_behind``)."""
        state = self.batch
        rows = state.prefilling
        if not rows.size:
            return None
        room, counts = self._prefill_room(), []
        for left in state.to_prefill(rows).tolist():
            count = min(left, room)
            if count < left:
                count -= count % self._chunk
            if not count:
                break
            counts.append(count)
            room -= count
        rows = rows[:len(counts)]
        work = PrefillWork(rows, state.computed[rows].copy(), np.array(counts, np.int64), draft_only=False)
        state.computed[rows] += work.count
        state.ensure(rows, state.computed[rows])
        state.register(rows, state.computed[rows])
        self._release_behind(rows, work.begin)
        return work

    # ------------------------------------------------------------------ a step
    def _token_views(self, rows: np.ndarray, lengths: np.ndarray | None = None) -> list[np.ndarray]:
        """Each row's prompt + generated tokens (read-only views; ``lengths``: their first ``lengths[i]``
        tokens instead)."""
        lengths = self.batch.length[rows] if lengths is None else lengths
        views = [self.batch.tokens[row, :length] for row, length in zip(rows.tolist(), lengths.tolist())]
        for view in views:
            view.flags.writeable = False
        return views

    def _host_views(self, rows: np.ndarray, ahead: np.ndarray) -> tuple[list[np.ndarray], list[list[int]] | None]:
        """What the host drafter reads for the requests at ``rows``: each one's prompt + generated tokens
        (read-only views), and with a step in flight, the tokens assumed for the requests it runs
        (``ahead`` > 0) after them: that step's drafts, all accepted, where the assumption they were made
        under held (``Assumption.held``; else none: the device most likely rejects them). The assumed
        tokens go past the request's length in its row, where its next tokens will be written."""
        flight = self.in_flight
        if flight is None:
            return self._token_views(rows), None
        state, assumed = self.batch, []
        place = {row: i for i, row in enumerate(flight.rows.tolist())}
        for row, more in zip(rows.tolist(), ahead.tolist()):
            length, tokens = int(state.length[row]), []
            if more:
                i = place[row]
                if flight.assumed is None or flight.assumed.held(i, state.tokens[row], length):
                    tokens = list(flight.drafts.host[i])
                state.tokens[row, length:length + len(tokens)] = tokens
            assumed.append(tokens)
        return self._token_views(rows, state.length[rows] + np.array([len(t) for t in assumed], np.int64)), assumed

    def decode_rows(self) -> np.ndarray:
        """int64[n] the requests the next decode step runs: those prefilled (``RequestBatch.decoding``) but
        those the step in flight surely ends (it emits at least one token: their last) and the constrained
        ones it runs (their grammars move on when it is fetched: they run in the step after)."""
        rows = self.batch.decoding
        if self.in_flight is None:
            return rows
        ahead = self._ahead(rows) > 0
        constrained = np.array([self.running[row].matcher is not None for row in rows.tolist()], np.bool_)
        return rows[~ahead | ((self.batch.budget[rows] > 1) & ~constrained)]

    def schedule(self, rows: np.ndarray, computed_rows: int) -> DecodeWork:
        """The next decode step, of the requests at ``rows`` (``decode_rows``); ``computed_rows``: the rows
        its executable computes (the controller's costs see padding like real rows)."""
        state = self.batch
        requests = [self.running[row] for row in rows.tolist()]
        request_ids = [r.request_id for r in requests]
        greedy = not state.sampling[rows, SamplingColumn.TEMPERATURE].any()
        kind = "greedy" if greedy else "sampling"
        ahead = self._ahead(rows)        # the step in flight appends 1 to ``ahead`` tokens first (then moves the rows)
        budget = step_budget(state.budget[rows] - (ahead > 0), requests)  # tokens each may emit now (at most)
        k = self.proposer.depth_for(self._choose_k(kind, computed_rows, requests, budget))
        caps = np.minimum(budget - 1, k)                    # never draft past a request's budget
        constrained = np.array([i for i, r in enumerate(requests) if r.matcher is not None], np.int64)
        draft_states = verified = None
        if constrained.size and self.automata:
            draft_states = self._draft_states(requests, constrained)
            verified = self._verified_on_device(rows, requests, draft_states)
            if not self.splits:     # a tree: its constrained requests' drafts are verified so or not at all
                caps[constrained[~verified[constrained]]] = 0
        views, assumed, guessing = [], None, None
        if self.proposer.host is not None:              # host drafters read the tokens
            views, assumed = self._host_views(rows, ahead)
            guessing = None if assumed is None else (ahead > 0) & (caps > 0)
        drafts = self.proposer.drafts(request_ids, views, caps, guessing)
        grammar, split = None, False
        if draft_states is not None and drafts.step_k:
            # a chain's request whose drafts only its grammar's masks can verify splits the step
            split = self.splits and bool(((caps > 0) & ~verified)[constrained].any())
            if not split:           # (one step shape: the tables are given with none verified too)
                draft_states = np.where(verified[:, None], draft_states, -1)
        else:
            draft_states = None
        if constrained.size and not split:      # (a split step's masks follow the drafts: ``mask_drafts``)
            drafts, grammar = self._grammar_masks(requests, constrained, drafts, caps)
        catch_up = None
        if self.proposer.has_draft_model and drafts.step_k and state.may_lag:
            catch_up = self._catch_up(rows)
        state.ensure(rows, state.length[rows] + np.minimum(ahead + drafts.num_drafts, state.budget[rows] - 1))
        logprobs = any(r.params.logprobs is not None for r in requests)
        work = DecodeWork(rows, request_ids, k, caps, drafts, greedy, logprobs, kind, catch_up, grammar,
                          state.epoch[rows].copy(), None if self.in_flight is None else ahead > 0,
                          0 if self.in_flight is None else self.in_flight.number + 1,
                          None if assumed is None else Assumption(state.length[rows].copy(), [
                              tokens + guess for tokens, guess in zip(assumed, drafts.guesses)]),
                          split, None if draft_states is None else self.draft_tables, draft_states)
        self.in_flight = work
        return work

    def _verified_on_device(self, rows: np.ndarray, requests: list[Request], draft_states: np.ndarray) -> np.ndarray:
        """bool[B] the constrained requests whose drafts the step may verify with their drafting automaton's
        masks (``DecodeWork.automaton``; the host checks them after: ``update``): those whose automaton is
        in the tables and never disagreed with their grammar, with no logit controls (the device's counts
        would hold the tokens a disagreement drops) and no end token their grammar's masks ban."""
        controlled = self.batch.sampling[rows, SamplingColumn.CONTROLLED] > 0
        eos = self.grammars.eos_ids
        return np.array([VERIFY_WITH_AUTOMATA and draft_states[i, 0] >= 0 and r.automaton_agrees and not controlled[i]
                         and all(t in r.stops for t in eos) for i, r in enumerate(requests)], np.bool_)

    def _draft_states(self, requests: list[Request], constrained: np.ndarray) -> np.ndarray:
        """int32[B, 2] each request's drafting automaton and state in ``draft_tables`` (-1: none), its
        automaton moved over the tokens it emitted since (-1 for good once one is outside it)."""
        states = np.full((len(requests), 2), -1, np.int32)
        if not self.automata_from_leader:       # one process: the constrained requests' automata built by now
            for i in constrained.tolist():
                requests[i].automaton_ready = requests[i].automaton.done()
        # (an automaton still being built: the request drafts freely meanwhile)
        automata = {i: requests[i].automaton.result() if requests[i].automaton_ready else None
                    for i in constrained.tolist()}
        keys = {i: draft_key(requests[i].params.structured_outputs) for i, a in automata.items() if a is not None}
        held = self.draft_tables.hold({key: automata[i] for i, key in keys.items()})
        for i, key in keys.items():
            request = requests[i]
            state, upto = request.automaton_at if request.automaton_at else (automata[i].initial, 0)
            state = automata[i].advance(state, request.token_ids[upto:])
            request.automaton_at = (state, len(request.token_ids))
            if key in held:
                states[i] = self.draft_tables.state_of(key, state)
        return states

    def mask_drafts(self, work: DecodeWork, drafted: np.ndarray) -> DecodeWork:
        """A split step's work after its first call: int32[B, k] ``drafted``, the device drafter's drafts,
        cut where a constrained request's grammar forbids one (or one completes it), with the masks of
        the positions the second call verifies (``grammar.Grammars.step_masks``)."""
        requests = [self.running[row] for row in work.rows.tolist()]
        constrained = np.array([i for i, r in enumerate(requests) if r.matcher is not None], np.int64)
        num_drafts = work.drafts.num_drafts.copy()
        tries = [path_trie(drafted[i, :num_drafts[i]].tolist()) for i in constrained.tolist()]
        kept, grammar = self._masks_along(requests, constrained, tries, work.drafts.step_k)
        num_drafts[constrained] = [len(trie.tokens) for trie in kept]
        work = dataclasses.replace(work, drafts=dataclasses.replace(work.drafts, num_drafts=num_drafts),
                                   grammar=grammar)
        self.in_flight = work
        return work

    def _grammar_masks(self, requests: list[Request], constrained: np.ndarray, drafts: Drafts, caps: np.ndarray
                       ) -> tuple[Drafts, np.ndarray]:
        """The step's drafts without the constrained requests' drafts their grammar forbids (``grammar.
        Grammars.step_masks``), and int32[B, step_k + 1, W] the masks at each position (-1: every token).
        With host drafts, the tokens a request's grammar forces next (up to its cap) are its drafts
        unless the drafter's go further along them: the masked target allows nothing else, so they are
        always accepted."""
        host, chains = self.proposer.host is not None, self.proposer.host_chains
        tries = []
        for i in constrained.tolist():
            trie = Trie([], []) if not host else path_trie(drafts.host[i]) if chains else drafts.host[i]
            if host and caps[i] > 0:
                forced = requests[i].matcher.compute_ff_tokens()[:int(caps[i])]
                if forced and (len(forced) >= trie.depth or trie.tokens[:len(forced)] != forced):
                    trie = path_trie(forced)
            tries.append(trie)
        step_k = smallest_fitting(self.proposer.step_ks, max(drafts.step_k, *(len(t.tokens) for t in tries)))
        kept, grammar = self._masks_along(requests, constrained, tries, step_k)
        if not host:
            return drafts, grammar
        offered, num_drafts = list(drafts.host), drafts.num_drafts.copy()
        for i, trie in zip(constrained.tolist(), kept):
            offered[i] = trie.tokens if chains else trie
            num_drafts[i] = min(trie.depth, int(caps[i]))
        return Drafts(num_drafts, step_k, offered), grammar

    def _masks_along(self, requests: list[Request], constrained: np.ndarray, tries: list[Trie], step_k: int
                     ) -> tuple[list[Trie], np.ndarray]:
        """(the constrained requests' ``tries`` as far as their grammars allow, int32[B, step_k + 1, W] the
        masks at each position of every request: -1 for the others)."""
        ignored = [[t for t in self.grammars.eos_ids if t not in requests[i].stops] for i in constrained.tolist()]
        kept, masks = self.grammars.step_masks([requests[i].matcher for i in constrained.tolist()], tries,
                                               step_k + 1, ignored)
        grammar = np.full((len(requests), step_k + 1, masks.shape[2]), -1, np.int32)
        grammar[constrained] = masks
        return kept, grammar

    def _catch_up(self, rows: np.ndarray) -> PrefillWork | None:
        """Before a step that runs the draft: the tokens k = 0 steps left out of the draft cache
        (``positions.catch_up_rows``), so every lag is then at most ``MAX_CATCH_UP``."""
        state = self.batch
        missing = catch_up_rows(state.lag[rows])
        lagging = missing > 0
        state.may_lag = False
        if not lagging.any():
            return None
        behind = rows[lagging]
        work = PrefillWork(behind, state.length[behind] - state.lag[behind], missing[lagging], draft_only=True)
        state.lag[behind] = 1
        return work

    def _choose_k(self, kind: str, batch: int, requests: list[Request], remaining: np.ndarray) -> int:
        """The k of the coming step: the config's, or the controller's (decided while the last step ran,
        unless the batch changed)."""
        controller = self._controllers.get(kind)
        if controller is None:
            return self._k
        if self._decided is not None and self._decided[:2] == (kind, batch):
            return self._decided[2]
        self.observe()
        return controller.next_k(batch, self._controller_ids(requests), remaining)

    @staticmethod
    def _controller_ids(requests: list[Request]) -> np.ndarray:
        return np.array([r.controller_id for r in requests], np.int64)

    def observe(self) -> None:
        """Tells the controller about the last step (if not yet told)."""
        seen, self._observed = self._observed, None
        if seen is not None:
            self._controllers[seen.kind].update(seen.offered, seen.accepted, seen.seconds, seen.batch, seen.ids,
                                                k=seen.k)

    def take_timing(self) -> tuple[str, int, int, float] | None:
        """The time of the step ``update`` just observed, as (kind, batch, k, seconds), taken out of its
        observation (None: no observation or no time). Over several processes a process's own step times
        differ from the others': each controller must learn the same time at the same step, so process 0's
        reaches every process with its next step's changes (``time_step``)."""
        seen = self._observed
        if seen is None or seen.seconds is None:
            return None
        self._observed = dataclasses.replace(seen, seconds=None)
        return seen.kind, seen.batch, seen.k, seen.seconds

    def time_step(self, kind: str, batch: int, k: int, seconds: float) -> None:
        """Tells ``kind``'s controller the time of a step it observed untimed (``take_timing``)."""
        self._controllers[kind].time_step(batch, k, seconds)

    def while_device_runs(self, work: DecodeWork, computed_rows: int) -> None:
        """While the device runs ``work``: the controller learns from the last step fetched and chooses the
        next k for ``work``'s requests still running (one step in flight: the step before ``work`` may have
        ended some)."""
        controller = self._controllers.get(work.kind)
        if controller is not None:
            self.observe()
            rows, self._decided = work.rows[self.live(work)], None
            if rows.size:
                requests = [self.running[row] for row in rows.tolist()]
                budget = step_budget(self.batch.budget[rows], requests)
                self._decided = (work.kind, computed_rows,
                                 controller.next_k(computed_rows, self._controller_ids(requests), budget))

    def update(self, work: DecodeWork, result: StepResult) -> list[RequestOutput]:
        """Appends each request's emitted tokens, tells the drafter, records what the controller learns,
        ends the requests that finished; returns the outputs of those that emitted or ended. Requests no
        longer running as ``work`` was planned (``live``) are left out."""
        if self.in_flight is not None and self.in_flight.number == work.number:
            self.in_flight = None
        live = self.live(work)
        if not live.any():
            return []
        if not live.all():
            work, result = work.subset(live), result.subset(live)
        state, rows, step_k = self.batch, work.rows, work.drafts.step_k
        requests = [self.running[row] for row in rows.tolist()]
        lag = state.lag[rows]
        if work.automaton is not None and not work.split:
            result = self._agreeing(work, requests, result)
        appended, done, stopped = state.advance(rows, result.output_token_ids, result.num_emitted)
        if work.grammar is not None:
            self._advance_grammars(requests, appended, done, stopped)
        state.lag[rows] = self.proposer.lag_after_step(lag, result.num_accepted, step_k)
        state.may_lag |= step_k == 0
        outputs = self._outputs(work, requests, appended, done, stopped, result)
        self._register(rows)
        self._release_behind(rows, state.computed[rows])
        if work.kind in self._controllers:
            # the controller's acceptance counts a draft the drafter could not offer (no n-gram match,
            # a short one) as a rejection at that position: E(k) is then what a step of k really emits
            counts = (np.minimum(work.caps, step_k), result.num_accepted)
            if self.proposer.host_chains:
                counts = self._check_unverified(rows, step_k) or counts
            # (k as chosen, or as far as the budgets let it draft: a step that ends them costs less)
            self.observe()          # one step in flight: the step before, when no dispatch told it since
            self._observed = Observation(work.kind, *counts, result.seconds, result.batch,
                                         self._controller_ids(requests), int(work.caps.max(initial=0)))
        self._finished = rows[done]
        return outputs

    def _agreeing(self, work: DecodeWork, requests: list[Request], result: StepResult) -> StepResult:
        """``result`` with the tokens of requests verified with their drafting automaton's masks cut where
        constrained decoding could have chosen otherwise (``Grammars.agreeing_prefix``: sampled, where
        those masks were not their grammar's; greedy, where they lacked a token it allows or the token is
        not its): what follows is dropped as if rejected; such a request's drafts are verified with its
        grammar's masks from then on."""
        num_emitted, num_accepted = result.num_emitted.copy(), result.num_accepted.copy()
        for i in np.flatnonzero(work.draft_states[:, 0] >= 0).tolist():
            request, emitted = requests[i], int(num_emitted[i])
            if emitted < 2:
                continue            # (the first token's mask is the host's)
            state, upto = request.automaton_at
            count, differed = 1, True
            if upto == len(request.token_ids):
                count, differed = self.grammars.agreeing_prefix(
                    request.matcher, request.automaton.result(), state, result.output_token_ids[i, :emitted].tolist(),
                    greedy=not self.batch.sampling[work.rows[i], SamplingColumn.TEMPERATURE])
            num_emitted[i] = count
            num_accepted[i] = min(int(num_accepted[i]), count - 1)
            if differed:
                request.automaton_agrees = False
                logging.getLogger(__name__).info(
                    "request %s: its drafting automaton's masks differ from its grammar's after %d tokens; its "
                    "drafts are verified with the grammar's masks from now on", request.request_id,
                    len(request.token_ids) + count)
        return dataclasses.replace(result, num_emitted=num_emitted, num_accepted=num_accepted)

    def _advance_grammars(self, requests: list[Request], appended: np.ndarray, done: np.ndarray,
                          stopped: np.ndarray) -> None:
        """Moves each constrained request's grammar over its new tokens; one whose grammar is complete
        is done now, ended by a stop (``done`` and ``stopped`` are updated in place)."""
        state = self.batch
        for i, request in enumerate(requests):
            matcher = request.matcher
            if matcher is None or done[i]:
                continue
            row, count = request.row, int(appended[i])
            new = state.tokens[row, state.length[row] - count:state.length[row]].tolist()
            if not matcher.consume_tokens(new):     # the masks allow no such token: a fault, never silent
                logging.getLogger(__name__).error("request %s: its grammar refused its tokens %s (%s); ending it",
                                                  request.request_id, new, matcher.get_error())
            if matcher.is_stopped():
                done[i] = stopped[i] = True

    def _register(self, rows: np.ndarray) -> None:
        """Caches the blocks of ``rows`` now full in every cache: the target holds all but the pending
        token, a draft model's cache or an EAGLE head's lags (``Proposer.committed``)."""
        state = self.batch
        state.register(rows, self.proposer.committed(state.length[rows], state.lag[rows]))

    def _release_behind(self, rows: np.ndarray, target_next: np.ndarray) -> None:
        """Gives back the blocks of ``rows`` behind every window of their next queries: the target's from
        ``target_next`` (int64[len(rows)]), a draft cache's from what it holds (``Proposer.committed``)."""
        state = self.batch
        state.release_behind(rows, np.minimum(target_next, self.proposer.committed(state.length[rows],
                                                                                   state.lag[rows])))

    def top_up(self) -> PrefillWork | None:
        """With prefix caching and a draft model or an EAGLE head: the draft-only prefill of the positions
        the requests that finished in the last ``update`` lack in blocks full in the target cache (a draft
        model ends a row behind when its last drafts were all accepted, a head by the tokens of its last
        step), so that those blocks are cached as they would be without speculation; None when none
        lacks any."""
        state, rows = self.batch, self._finished
        if state.prefix_root is None or not rows.size:
            return None
        length = state.length[rows]
        committed = self.proposer.committed(length, state.lag[rows])
        short = committed // state.block_size < (length - 1) // state.block_size
        if not short.any():
            return None
        rows = rows[short]
        work = PrefillWork(rows, committed[short], length[short] - 1 - committed[short], draft_only=True)
        state.lag[rows] = self.proposer.lag_after_prefill
        return work

    def retire(self) -> None:
        """Ends the requests that finished in the last ``update`` (after ``top_up``): their full blocks
        stay cached, the rest return to the pool."""
        rows, self._finished = self._finished, np.zeros(0, np.int64)
        if rows.size:
            self._register(rows)
            self._end(rows.tolist())

    def _outputs(self, work: DecodeWork, requests: list[Request], appended: np.ndarray, done: np.ndarray,
                 stopped: np.ndarray, result: StepResult) -> list[RequestOutput]:
        """Each request's output of the step (those that emitted or ended), after recording its tokens."""
        outputs, host, predicted = [], self.proposer.host, work.drafts.predicted
        # one conversion per array: per-row numpy indexing is what a step's host time at batch 256 was
        emitted, counts, ended, by_stop = (result.output_token_ids.tolist(), appended.tolist(), done.tolist(),
                                           stopped.tolist())
        verified, accepted = result.num_verified.tolist(), result.num_accepted.tolist()
        for i, request in enumerate(requests):
            count, verified_i, accepted_i = counts[i], verified[i], accepted[i]
            request.drafted += verified_i
            at = request.accepted_at
            for position in range(accepted_i):
                at[position] += 1
            if predicted is not None and predicted[i]:
                request.prediction_accepted += accepted_i
                request.prediction_rejected += verified_i - accepted_i
            new = emitted[i][:count]            # what ``RequestBatch.advance`` appended
            request.token_ids += new
            if host is not None and new:
                host.extend(request.request_id, new)
            if not (count or ended[i]):
                continue
            n, logprobs = request.params.logprobs, result.logprobs
            token_logprobs = None if n is None else tuple(
                TokenLogprob(token, float(logprobs.logprob[i, j]),
                             tuple(zip(logprobs.top_ids[i, j, :n].tolist(), logprobs.top_logprobs[i, j, :n].tolist())))
                for j, token in enumerate(new))
            reason = ("stop" if by_stop[i] else "length") if ended[i] else None
            outputs.append(request.output(new, reason, token_logprobs))
        return outputs

    def _check_unverified(self, rows: np.ndarray, step_k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Host drafting at a k = 0 step (the controller's choice, or the budgets' end): the counterfactual
        (offered, accepted) of ``rows`` once the proposals made some k = 0 steps ago can be checked
        (``UnverifiedProposals``; the controller learns acceptance from them while it holds k = 0), and
        new proposals to check. None while none is due; a step with drafts drops them (it counts its own),
        and so does an admission (a row may then hold another request)."""
        state, pending = self.batch, self._unverified
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
        active = state.decoding
        requests = [self.running[r] for r in active.tolist()]     # (requests done this step: cap 0)
        caps = np.clip(step_budget(state.budget[active], requests) - 1, 0, self.proposer.step_ks[-1])
        ids = [r.request_id for r in requests]
        self._unverified = UnverifiedProposals.of(self.proposer.chains(ids, self._token_views(active), caps),
                                                  active, state.length[active], caps)
        return counts
