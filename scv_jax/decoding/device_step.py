"""Device side of the decoding loop: the building blocks the steps share (the per-request row
``StepRow`` and sampling columns ``SamplingColumn``, ``SplitModel``, the per-request random keys, the
logit controls ``ControlState`` / ``LogitControls``, ``choose_tokens``, ``commit_positions``) and the
prefill step; pure functions of the models' parameter
leaves that graph mode compiles per shape bucket. The decode step is ``step_fn.make_decode_step``, its
verifiers (chains, trees) ``verifiers``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from pallas_kernels.sampling_math import argmax_ignoring_nan
from scv_jax.decoding.plan import MAX_CATCH_UP, SamplingColumn, StepRow
from scv_jax.ops.commit.api import slots_from_block_table
from scv_jax.ops.commit.kv_cache import PagedKVCache
from scv_jax.ops.commit.sharded import sharded_commit_draft_kv
from scv_jax.ops.sampling.api import filtered_probs
from scv_jax.ops.sampling.controls import controlled_logits
from scv_jax.sampling_params import ANY_TOKEN, MAX_BAD_WORD_LEN, MAX_BAD_WORDS
from scv_jax.sharding.mesh import REPLICATED, REQUESTS, active_mesh, per_shard

# fold_in tags of a request's per-step key
ACCEPT_TAG, BONUS_TAG, DRAFT_TAG = 0, 1, 2


def sampling_filters(sampling: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """float32[B, SamplingColumn.WIDTH] -> ``filtered_probs``' (temperature, top_k, top_p, min_p)."""
    return (sampling[:, SamplingColumn.TEMPERATURE], sampling[:, SamplingColumn.TOP_K].astype(jnp.int32),
            sampling[:, SamplingColumn.TOP_P], sampling[:, SamplingColumn.MIN_P])


class SplitModel(NamedTuple):
    """A model split once on the host into its static structure and its parameter leaves' tree, so a
    step call passes a flat list of arrays (cheap to dispatch) and the step merges it back."""

    graphdef: Any
    treedef: Any

    @classmethod
    def split(cls, model) -> tuple["SplitModel", list[jax.Array]]:
        """(the structure, the parameter leaves) of an ``nnx.Module``."""
        return cls.of(*nnx.split(model))

    @classmethod
    def of(cls, graphdef, state) -> tuple["SplitModel", list[jax.Array]]:
        """(the structure, the parameter leaves) of an ``nnx.split`` model (its state placed anywhere);
        a model with ``per_layer`` (``Transformer``) as that, each layer's weights separate inputs."""
        model = nnx.merge(graphdef, state)
        if hasattr(model, "per_layer"):
            graphdef, state = nnx.split(model.per_layer())
        leaves, treedef = jax.tree.flatten(state)
        return cls(graphdef, treedef), leaves

    def state(self, leaves: list[jax.Array]):
        """The ``nnx.State`` of these parameter leaves."""
        return jax.tree.unflatten(self.treedef, leaves)

    def merge(self, leaves: list[jax.Array]):
        return nnx.merge(self.graphdef, self.state(leaves))


def request_keys(key_data: jax.Array, positions: jax.Array) -> jax.Array:
    """[B] typed keys ``fold_in(request key, position)`` from int32[B, 2] key data (uint32 bits): a
    request's random numbers depend on its own stream and position only, never on its batch."""
    data = jax.lax.bitcast_convert_type(key_data, jnp.uint32)
    return jax.vmap(lambda d, p: jax.random.fold_in(jax.random.wrap_key_data(d, impl="threefry2x32"), p))(
        data, positions.astype(jnp.uint32))


class StepInputs(NamedTuple):
    """A decode step's ``rows`` unpacked (B requests).

    Attributes:
      lag: int32[B] tokens the draft cache lacks, in [1, MAX_CATCH_UP] (1 on padding rows; an EAGLE head's
        rows the head cache lacks, 0 after a prefill: ``head_step``).
      context_lens: int32[B] positions in the target cache (the pending token's position).
      num_drafts: int32[B] a chain's drafts to verify, in [0, k]; a tree's depth cap.
      tail: int32[B, MAX_CATCH_UP] the request's last tokens, the pending one last.
      lag_tokens: int32[B, MAX_CATCH_UP] the lag tokens, left-aligned (the draft's catch-up forward).
      keys: [B] typed keys, each request's stream folded with its context length (``request_keys``).
      draft_lens: int32[B] positions in the draft cache (``context_lens + 1 - lag``).
      request_mask: bool[B], False = padding.
      stop_ids: int32[B, MAX_STOP_IDS] the token ids that end each request (-1 = none).
      slots: int32[B] each request's row of the ``ControlState``.
      controls: the step's ``LogitControls`` (None: the step has no control state).
    """

    lag: jax.Array
    context_lens: jax.Array
    num_drafts: jax.Array
    tail: jax.Array
    lag_tokens: jax.Array
    keys: jax.Array
    draft_lens: jax.Array
    request_mask: jax.Array
    stop_ids: jax.Array
    slots: jax.Array
    controls: "LogitControls | None" = None

    @property
    def pending(self) -> jax.Array:
        """int32[B] the token the target scores first (its K/V not yet cached)."""
        return self.tail[:, -1]


def step_inputs(rows: jax.Array, request_mask: jax.Array | None, sampling: jax.Array | None = None,
                state: "ControlState | None" = None, grammar: jax.Array | None = None,
                automaton: "DraftAutomaton | None" = None) -> StepInputs:
    """``StepInputs`` of int32[B, StepRow.WIDTH] rows (``request_mask`` None: every row a request), with the
    ``LogitControls`` of ``sampling``, ``state``, the step's ``grammar`` masks and drafting ``automaton``
    when the step has a control state."""
    lag, context_lens, num_drafts = rows[:, StepRow.LAG], rows[:, StepRow.CONTEXT], rows[:, StepRow.NUM_DRAFTS]
    tail = rows[:, StepRow.TOKENS:]
    catch_up = jnp.arange(MAX_CATCH_UP, dtype=jnp.int32)[None, :] + MAX_CATCH_UP - lag[:, None]
    lag_tokens = jnp.take_along_axis(tail, jnp.clip(catch_up, 0, MAX_CATCH_UP - 1), axis=1)  # left-aligned
    if request_mask is None:
        request_mask = jnp.ones((rows.shape[0],), jnp.bool_)
    keys = request_keys(rows[:, StepRow.KEY:StepRow.KEY + 2], context_lens)
    inputs = StepInputs(lag, context_lens, num_drafts, tail, lag_tokens, keys, context_lens + 1 - lag, request_mask,
                        rows[:, StepRow.STOP:StepRow.TOKENS], rows[:, StepRow.SLOT])
    if state is None:
        return inputs
    return inputs._replace(controls=LogitControls.of(state, inputs.slots, sampling, inputs.stop_ids, request_mask,
                                                     grammar, automaton))


class ControlState(NamedTuple):
    """The decoder's logit-control state on the device, one row per ``RequestBatch`` row (S rows, the
    ``StepRow.SLOT`` of a request), written when a request with controls starts (``write``) and updated
    by every decode step with the tokens it emitted (``record``): 8 bytes per row and vocabulary entry,
    and 540 bytes per row for the bad words of several tokens.

    Attributes:
      bias: float32[S, V] the request's ``SamplingParams.bias_row`` (logit_bias, -inf on masked tokens).
      history: int32[S, V] 2 x the token's count in the request's output + 1 if it is in its prompt.
      words: int32[S, MAX_BAD_WORDS, MAX_BAD_WORD_LEN] the request's ``SamplingParams.bad_word_table``.
      recent: int32[S, MAX_BAD_WORD_LEN - 1] the request's last output tokens, the latest last (-1: none
        yet): what a bad word's other tokens must equal for its last one to be masked.
    """

    bias: jax.Array
    history: jax.Array
    words: jax.Array
    recent: jax.Array

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> "ControlState":
        return cls(jnp.zeros((num_slots, vocab_size), jnp.float32), jnp.zeros((num_slots, vocab_size), jnp.int32),
                   jnp.full((num_slots, MAX_BAD_WORDS, MAX_BAD_WORD_LEN), -1, jnp.int32),
                   jnp.full((num_slots, MAX_BAD_WORD_LEN - 1), -1, jnp.int32))

    def write(self, slot: jax.Array, bias: jax.Array, history: jax.Array, words: jax.Array,
              recent: jax.Array) -> "ControlState":
        """Row ``slot`` for a request that starts (or resumes after a preemption): its bias float32[V],
        ``history`` int32[V] of its prompt and output so far, bad words int32[MAX_BAD_WORDS,
        MAX_BAD_WORD_LEN] and ``recent`` int32[MAX_BAD_WORD_LEN - 1] output tokens (see the attributes)."""
        slot = jnp.clip(slot, 0, self.bias.shape[0] - 1)
        return ControlState(self.bias.at[slot].set(bias), self.history.at[slot].set(history),
                            self.words.at[slot].set(words), self.recent.at[slot].set(recent))

    def record(self, controls: "LogitControls", slots: jax.Array, tokens: jax.Array) -> "ControlState":
        """The state with int32[B, T] emitted ``tokens`` (-1 after the last) counted in the output of each
        controlled request's row, and its latest tokens moved along (a request's tokens after its stop or
        budget count too: it ends there)."""
        vocab = self.history.shape[1]
        controlled, recent = controls.controlled, controls.recent
        mesh = active_mesh()
        if mesh is not None:    # the step's few tokens on every device, each updating its replicated state alike
            slots, tokens, controlled, recent = jax.lax.with_sharding_constraint(
                (slots, tokens, controlled, recent), NamedSharding(mesh, REPLICATED))
        valid = (tokens >= 0) & (tokens < vocab) & controlled[:, None]
        slots = jnp.clip(slots, 0, self.history.shape[0] - 1)

        def add() -> ControlState:
            history = self.history.at[slots[:, None], jnp.clip(tokens, 0, vocab - 1)].add(jnp.where(valid, 2, 0))
            latest_tokens = latest(recent, jnp.where(valid, tokens, -1), jnp.sum(valid, axis=1))
            # rows not controlled (padding among them) write nothing: their slot may be another row's
            rows = jnp.where(controlled, slots, self.recent.shape[0])
            return self._replace(history=history, recent=self.recent.at[rows].set(latest_tokens, mode="drop"))

        return jax.lax.cond(jnp.any(valid), add, lambda: self)

    def rows(self, slots: jax.Array) -> "ControlState":
        """The state's rows at int32[B] ``slots`` (in range); on a mesh each data shard gathers its own
        requests' rows from its replicated copy (no communication)."""
        def gather(state: ControlState, slots: jax.Array) -> ControlState:
            return jax.tree.map(lambda x: x[slots], state)

        if active_mesh() is None:
            return gather(self, slots)
        return per_shard(gather, in_specs=(REPLICATED, REQUESTS), out_specs=REQUESTS)(self, slots)


class LogitControls(NamedTuple):
    """A decode step's logit controls, one row per request (B), gathered from the ``ControlState``.

    Attributes:
      active: bool[] some request has controls or a ``min_tokens`` still to reach (else ``apply`` is
        the identity but for the ``grammar`` masks, at the cost of one branch).
      controlled: bool[B] the request's row of the state counts (its bias and history; else zeros).
      bias: float32[B, V]; output_counts: int32[B, V]; in_prompt: bool[B, V].
      presence, frequency, repetition: float32[B] (``SamplingParams``' penalties).
      min_tokens: int32[B] tokens still to emit before a stop token may come; stop_ids: int32[B, S].
      words: int32[B, MAX_BAD_WORDS, MAX_BAD_WORD_LEN] the bad words of several tokens (-1: none);
      recent: int32[B, MAX_BAD_WORD_LEN - 1] the last output tokens (-1: none).
      grammar: int32[B, T, ceil(V / 32)] structured output's masks (``decoding.grammar``): at row t (a
        chain's t-th position after the committed tokens; a tree's position after node t - 1, row 0 the
        root's) token v is allowed where bit v % 32 of word v // 32 is set (-1 words: every token); None:
        no structured output in the step.
      automaton: the drafting automata the drafts follow (``DraftAutomaton``) and, in a step that verifies
        them, the target's logits at draft positions too (``DraftAutomaton.along``), or None.
    """

    active: jax.Array
    controlled: jax.Array
    bias: jax.Array
    output_counts: jax.Array
    in_prompt: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    min_tokens: jax.Array
    stop_ids: jax.Array
    words: jax.Array
    recent: jax.Array
    grammar: jax.Array | None = None
    automaton: "DraftAutomaton | None" = None

    @classmethod
    def of(cls, state: ControlState, slots: jax.Array, sampling: jax.Array, stop_ids: jax.Array,
           request_mask: jax.Array, grammar: jax.Array | None = None,
           automaton: "DraftAutomaton | None" = None) -> "LogitControls":
        controlled = (sampling[:, SamplingColumn.CONTROLLED] > 0) & request_mask
        min_tokens = jnp.where(request_mask, sampling[:, SamplingColumn.MIN_TOKENS], 0).astype(jnp.int32)
        requests = state.rows(jnp.clip(slots, 0, state.bias.shape[0] - 1))
        history = jnp.where(controlled[:, None], requests.history, 0)
        active = jnp.any(controlled | (min_tokens > 0))
        return cls(active, controlled,
                   jnp.where(controlled[:, None], requests.bias, 0.0), history // 2, history % 2 == 1,
                   sampling[:, SamplingColumn.PRESENCE], sampling[:, SamplingColumn.FREQUENCY],
                   jnp.where(controlled, sampling[:, SamplingColumn.REPETITION], 1.0), min_tokens, stop_ids,
                   jnp.where(controlled[:, None, None], requests.words, -1), requests.recent, grammar, automaton)

    def apply(self, logits: jax.Array, rows: jax.Array | None = None, seen: jax.Array | None = None,
              offsets: jax.Array | None = None, previous: jax.Array | None = None,
              grammar_rows: jax.Array | None = None) -> jax.Array:
        """float[..., V] logits of the step's positions with the controls applied (same dtype).

        Without ``rows``, ``logits`` is [B, T, V] or [B, V] (request b's positions); with ``rows``
        int32[R], [R, V] rows of any requests. ``seen``: int32 of the leading shape + [S], the tokens
        each position's history holds beyond the request's committed ones (the drafts before it; -1:
        none), applied sparsely: no [..., V] array but the logits is built from them;
        ``offsets``: int32 of the leading shape, each position's tokens after the committed ones (a
        stop token is masked while offset < min_tokens); ``previous``: int32 of the leading shape +
        [MAX_BAD_WORD_LEN - 1], the last output tokens of each position's history (-1: none; a bad word's
        last token is masked where its other tokens end it). None: the position after the committed
        tokens (no drafts seen, offset 0, the request's ``recent`` tokens). ``grammar_rows``: int32 of
        the leading shape, the row of ``grammar`` each position takes (a tree's node; default: its offset).
        """
        lead, vocab = logits.shape[:-1], logits.shape[-1]
        given = rows is not None
        if given:
            rows = jnp.clip(rows.reshape(-1), 0, self.bias.shape[0] - 1)
        count = rows.shape[0] if given else math.prod(lead)

        # each position's request's values (without ``rows`` broadcast, not gathered: a data shard's
        # positions then read its own requests' rows, with no communication on a mesh)
        def per_row(x: jax.Array) -> jax.Array:           # [B, ...] -> [R, ...]
            if given:
                return x[rows]
            shape = lead + x.shape[1:]
            return jnp.broadcast_to(x.reshape(lead[:1] + (1,) * (len(lead) - 1) + x.shape[1:]), shape).reshape(
                (count,) + x.shape[1:])

        def at_offsets(x: jax.Array, at: jax.Array) -> jax.Array:     # [B, T, ...] at int32[R] -> [R, ...]
            at = jnp.clip(at, 0, x.shape[1] - 1)
            if given:
                return x[rows, at]
            at = at.reshape((x.shape[0], -1) + (1,) * (x.ndim - 2))
            return jnp.take_along_axis(x, at, axis=1).reshape((count,) + x.shape[2:])

        offsets = jnp.zeros((count,), jnp.int32) if offsets is None else offsets.reshape(-1)
        grammar_rows = offsets if grammar_rows is None else grammar_rows.reshape(-1)
        previous = per_row(self.recent) if previous is None else previous.reshape(-1, MAX_BAD_WORD_LEN - 1)

        def adjust() -> jax.Array:
            flat, index = logits.reshape(-1, vocab), jnp.arange(count)[:, None]
            penalties = per_row(self.presence), per_row(self.frequency), per_row(self.repetition)
            bias, counts, in_prompt = per_row(self.bias), per_row(self.output_counts), per_row(self.in_prompt)
            out = controlled_logits(flat, bias, counts, in_prompt, *penalties)
            if seen is not None:        # the tokens seen beyond the committed ones, again with their counts
                tokens = seen.reshape(count, -1)
                valid = (tokens >= 0) & (tokens < vocab)
                at = jnp.clip(tokens, 0, vocab - 1)
                more = jnp.sum((tokens[:, :, None] == tokens[:, None, :]) & valid[:, None, :], axis=2)
                again = controlled_logits(flat[index, at], bias[index, at], counts[index, at] + more,
                                          in_prompt[index, at], *penalties)
                out = out.at[index, jnp.where(valid, at, vocab)].set(again, mode="drop")
            # stop ids before min_tokens and bad words said: -inf (which the penalties keep), set last
            stops = per_row(self.stop_ids)
            early = (offsets < per_row(self.min_tokens))[:, None] & (stops >= 0)
            words = per_row(self.words)                                    # [R, MAX_BAD_WORDS, MAX_BAD_WORD_LEN]
            ends = words[:, :, -1]
            others = words[:, :, :-1]
            said = jnp.all((others == previous[:, None, :]) | (others == ANY_TOKEN), axis=-1) & (ends >= 0)
            banned = jnp.concatenate([jnp.where(early, stops, vocab), jnp.where(said, ends, vocab)], axis=1)
            out = out.at[index, banned].set(-jnp.inf, mode="drop")
            return out.astype(logits.dtype).reshape(logits.shape)

        out = jax.lax.cond(self.active, adjust, lambda: logits)
        verifies = self.automaton is not None and self.automaton.along is not None
        if self.grammar is None and not verifies:
            return out
        # the grammar's masks: forbidden tokens -inf (as a -inf bias would leave them through the controls)
        allowed = jnp.ones((count, vocab), jnp.bool_)
        if self.grammar is not None:
            allowed = grammar_allows(at_offsets(self.grammar, grammar_rows), vocab)
        if verifies:
            automaton = self.automaton
            allowed &= automaton.allows(per_row(automaton.slots), at_offsets(automaton.along, grammar_rows), vocab)
        return jnp.where(allowed.reshape(logits.shape), out, -jnp.inf).astype(logits.dtype)


class DraftAutomaton(NamedTuple):
    """The drafting automata of a step's constrained requests (``grammar_automaton.DraftTables``): the
    draft model samples each draft among the tokens its request's automaton allows.

    Attributes:
      next_state: int32[S, C] a state's next state by token class (-1: forbidden; global state ids).
      token_class: int32[G, V] each automaton's token classes.
      slots: int32[B] each request's automaton; states: int32[B] its state before the step's first draft
        (-1: none, every token allowed).
      along: int32[B, k + 1] each request's state at each position the step verifies after the first
        (``along_drafts``; -1 at position 0, where the host's mask is exact): the target's logits there
        take the automaton's masks (the host checks them after the step), or None: the automaton only drafts.
    """

    next_state: jax.Array
    token_class: jax.Array
    slots: jax.Array
    states: jax.Array
    along: jax.Array | None = None

    def along_drafts(self, drafts: jax.Array) -> "DraftAutomaton":
        """The automata with ``along``: the states after each non-empty prefix of int32[B, k] ``drafts``."""
        def step(states, token):
            moved = self.advance(states, token)
            return moved, moved

        _, after = jax.lax.scan(step, self.states, drafts.T)
        return self._replace(along=jnp.concatenate([jnp.full_like(self.states[:, None], -1), after.T], axis=1))

    def along_tree(self, tokens: jax.Array, parents: jax.Array) -> "DraftAutomaton":
        """The automata with ``along`` int32[B, N + 1]: -1, then the state after each node's path of a tree
        (int32[B, N] node ``tokens`` and ``parents``, parents before children; a parent outside [-1, i):
        -1, the node never accepted, ``tree_verifier.tree_inputs``)."""
        batch, n = tokens.shape

        def node(i, states):
            parent = parents[:, i]
            before = jnp.where((parent >= -1) & (parent < i), states[jnp.arange(batch), jnp.clip(parent + 1, 0, n)], -1)
            return states.at[:, i + 1].set(self.advance(before, tokens[:, i]))

        states = jnp.full((batch, n + 1), -1, jnp.int32).at[:, 0].set(self.states)
        if n:                           # (a body indexing an empty axis does not trace)
            states = jax.lax.fori_loop(0, n, node, states)
        return self._replace(along=states.at[:, 0].set(-1))

    def _allowed(self, slots: jax.Array, states: jax.Array, vocab_size: int) -> jax.Array:
        """bool[R, ..., V]: the tokens automata int32[R] ``slots`` allow at int32[R, ...] ``states`` (every
        token at -1)."""
        classes = self.token_class[jnp.clip(slots, 0, self.token_class.shape[0] - 1), :vocab_size]      # [R, V]
        classes = jnp.broadcast_to(classes.reshape(classes.shape[0], *(1,) * (states.ndim - 1), vocab_size),
                                   (*states.shape, vocab_size))
        moves = self.next_state[jnp.clip(states, 0, self.next_state.shape[0] - 1)]                 # [R, ..., C]
        return (jnp.take_along_axis(moves, classes, axis=-1) >= 0) | (states < 0)[..., None]

    def allows(self, slots: jax.Array, states: jax.Array, vocab_size: int) -> jax.Array:
        """bool[R, V]: the tokens the automata int32[R] ``slots`` allow at int32[R] ``states`` (positions'
        states ``along`` their drafts; every token without an automaton, or at state -1: a draft left it)."""
        return self._allowed(slots, states, vocab_size) | (slots < 0)[:, None]

    def mask(self, logits: jax.Array, states: jax.Array) -> jax.Array:
        """float[B, ..., V] ``logits`` with the tokens int32[B, ...] ``states`` forbid at -inf (a row whose
        allowed tokens the other controls already took away keeps its logits: a draft only proposes)."""
        allowed = self._allowed(self.slots, states, logits.shape[-1])
        masked = jnp.where(allowed, logits, -jnp.inf)
        return jnp.where(jnp.any(allowed & (logits > -jnp.inf), axis=-1, keepdims=True), masked, logits)

    def advance(self, states: jax.Array, tokens: jax.Array) -> jax.Array:
        """int32[B, ...]: ``states`` after int32[B, ...] ``tokens`` (-1 stays -1; a forbidden token gives -1)."""
        vocab = self.token_class.shape[1]
        slots = jnp.clip(self.slots, 0, self.token_class.shape[0] - 1).reshape(-1, *(1,) * (states.ndim - 1))
        classes = self.token_class[slots, jnp.clip(tokens, 0, vocab - 1)]
        moved = self.next_state[jnp.clip(states, 0, self.next_state.shape[0] - 1), classes]
        return jnp.where((states >= 0) & (tokens >= 0) & (tokens < vocab), moved, -1)


def grammar_allows(words: jax.Array, vocab_size: int) -> jax.Array:
    """bool[R, V]: the tokens int32[R, W] ``words`` (rows of the grammar's bit masks) allow."""
    token = jnp.arange(vocab_size, dtype=jnp.int32)
    return bit_set(words[:, token // 32], token)


def bit_set(words: jax.Array, tokens: jax.Array) -> jax.Array:
    """bool (their shape): whether bit ``tokens % 32`` of the int32 ``words`` holding ``tokens`` is set."""
    return (jnp.right_shift(jax.lax.bitcast_convert_type(words, jnp.uint32), (tokens % 32).astype(jnp.uint32)) & 1) == 1


def controlled(controls: LogitControls | None, logits: jax.Array, **where) -> jax.Array:
    """``controls.apply(logits, **where)``, or ``logits`` as they are without controls."""
    return logits if controls is None else controls.apply(logits, **where)


def latest(recent: jax.Array, tokens: jax.Array, count: jax.Array) -> jax.Array:
    """int32[B, W]: the last W tokens of each row's ``recent`` int32[B, W] followed by its first ``count``
    int32[B] of ``tokens`` int32[B, T]."""
    width = recent.shape[1]
    both = jnp.concatenate([recent, tokens], axis=1)
    return jnp.take_along_axis(both, count[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], axis=1)


def drafts_previous(recent: jax.Array, drafts: jax.Array) -> jax.Array:
    """int32[B, k + 1, W]: at chain position t, the last W = MAX_BAD_WORD_LEN - 1 output tokens of its
    history: ``recent`` int32[B, W] followed by drafts[:, :t] (int32[B, k])."""
    width, k = recent.shape[1], drafts.shape[1]
    both = jnp.concatenate([recent, drafts.astype(jnp.int32)], axis=1)
    return both[:, jnp.arange(k + 1)[:, None] + jnp.arange(width)[None, :]]


def drafts_seen(drafts: jax.Array) -> jax.Array:
    """int32[B, k + 1, k]: at chain position t, drafts[:, :t] (int32[B, k]) then -1: the tokens the
    position holds in its history beyond the committed ones (``LogitControls.apply``'s ``seen``)."""
    k = drafts.shape[1]
    before = jnp.arange(k)[None, :] < jnp.arange(k + 1)[:, None]                  # [k + 1, k]
    return jnp.where(before[None], drafts.astype(jnp.int32)[:, None, :], -1)


def tagged_keys(keys: jax.Array, tag: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, tag))(keys)


def choose_tokens(logits: jax.Array, keys: jax.Array, sampling: jax.Array, greedy: bool):
    """Next tokens from float[B, V] logits: with ``greedy`` (every request greedy) the argmax (probs
    None; the first index of the maximum, NaN never winning, as in the fused greedy acceptance), else
    a sample of each request's filtered distribution (``filtered_probs``; a greedy request's is the
    one-hot of its argmax) with its probs [B, V]."""
    if greedy:
        return argmax_ignoring_nan(logits), None
    probs = filtered_probs(logits, *sampling_filters(sampling), backend="xla")
    tokens = jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)
    return tokens, probs


def flatten_rows(x: jax.Array) -> jax.Array:
    """[layers, B, T, ...] -> [layers, B * T, ...]."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def commit_positions(cache: PagedKVCache, keys: jax.Array, values: jax.Array, block_tables: jax.Array,
                     first_position: jax.Array, num_rows: jax.Array, block_size: int, backend: str, *,
                     after: jax.Array) -> PagedKVCache:
    """Commits rows t < num_rows[b] of [layers, B, T, kv_heads, head_dim] K/V at positions
    first_position[b] + t.

    ``after`` (e.g. the logits) orders the write after every read of the cache: without that data
    dependence XLA copies the donated cache instead of updating it in place.
    """
    num_rows, _ = jax.lax.optimization_barrier((num_rows, after))
    t = jnp.arange(keys.shape[2], dtype=jnp.int32)
    slots = slots_from_block_table(block_tables, first_position[:, None] + t, block_size).reshape(-1)
    mask = (t[None, :] < num_rows[:, None]).reshape(-1)
    return sharded_commit_draft_kv(cache, flatten_rows(keys), flatten_rows(values), slots, mask,
                                   backend=backend)


def make_prefill_step(target: SplitModel, draft: SplitModel | None, block_size: int):
    """``prefill_step(...)``: runs a chunk of prompt tokens through the given models and commits it."""

    def prefill_step(target_params, draft_params, target_cache, draft_cache, block_tables, tokens, start,
                     count, request_mask=None, *, backend: str = "auto"):
        """tokens int32[B, C] at positions start[b] + t; rows t < count[b] of masked-in requests commit.

        A model whose params are None is skipped and its cache returned as is (``draft_params`` alone:
        the draft's catch-up after k = 0 steps, see ``positions``).
        """
        if request_mask is not None:
            count = jnp.where(request_mask, count, 0)
        caches = []
        for split, params, cache in ((target, target_params, target_cache), (draft, draft_params, draft_cache)):
            if params is None:
                caches.append(cache)
                continue
            out = split.merge(params).forward_paged(tokens, cache, block_tables, start, backend=backend)
            caches.append(commit_positions(cache, out.keys, out.values, block_tables, start, count,
                                           block_size, backend, after=out.logits))
        return caches[0], caches[1]

    return prefill_step
