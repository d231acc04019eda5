"""The typed records that join a decode step's roles, and the column maps of the step's per-request
inputs; host-only (no jax import), so the scheduler and the batch state use them without the device step.

A step: the scheduler's ``DecodeWork`` (which requests, how many drafts each, the static k) goes to the
runner, which calls the step executable once and fetches its ``StepResult`` once; the scheduler turns
that result into each request's output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from scv_jax.sampling_params import MAX_STOP_IDS

MAX_CATCH_UP = 2   # the width of a step's catch-up forward: the most tokens a k > 0 step's draft may lag


class StepRow:
    """Columns of a decode step's per-request input row (``decode_step``'s ``rows``, int32[B, WIDTH]):
    one array per step, so the host builds and transfers one buffer instead of several."""

    LAG = 0             # tokens the draft cache lacks, in [1, MAX_CATCH_UP] (0 on padding rows)
    CONTEXT = 1         # positions in the target cache (the pending token's position)
    NUM_DRAFTS = 2      # drafts the request verifies, in [0, k] (a tree: the most nodes it may accept)
    KEY = 3             # 2 columns: the request's random stream (uint32[2] key data, bits as int32)
    SLOT = 5            # the request's row of the decoder's logit-control state (its RequestBatch row)
    BUDGET = 6          # tokens the request may still emit (>= 1; 0 on padding rows)
    CARRIED = 7         # 1: the step before (still in flight) moves this row on (``carry``), 0: the row is exact
    STOP = 8            # MAX_STOP_IDS columns: the token ids that end the request (-1 = none)
    TOKENS = STOP + MAX_STOP_IDS   # the request's last MAX_CATCH_UP tokens, the pending one last
    WIDTH = TOKENS + MAX_CATCH_UP


class CarryColumn:
    """Columns of the decoder's device-resident carry (int32[slots, WIDTH], ``decoding.carry``): what each
    request's last decode step did to its row, so the next step, dispatched before the host fetched that
    one, moves its ``StepRow`` on by it (one step in flight)."""

    EMITTED = 0         # the tokens the step appended (cut at the request's budget and its first stop id)
    DONE = 1            # 1: the request ended there (a stop id or its budget)
    LAG = 2             # the drafter's lag after the step (the proposer's ``lag_after_step``, at most max_lag)
    TOKENS = 3          # the request's last MAX_CATCH_UP tokens after the step, the pending one last
    WIDTH = TOKENS + MAX_CATCH_UP


class SamplingColumn:
    """Columns of a decode step's ``sampling`` input (float32[B, WIDTH]): each request's
    ``SamplingParams`` filters (``scv_jax.sampling_params.SamplingArrays``) and logit controls (padding
    rows all 0: greedy, no controls)."""

    TEMPERATURE = 0     # 0 = greedy
    TOP_K = 1           # 0 = off (exact in float32: vocabularies are < 2**24)
    TOP_P = 2
    MIN_P = 3
    PRESENCE = 4        # presence_penalty
    FREQUENCY = 5       # frequency_penalty
    REPETITION = 6      # repetition_penalty (1 = off)
    MIN_TOKENS = 7      # in a request's row: min_tokens; in a step's: the tokens before a stop may come
    CONTROLLED = 8      # 1: the request's bias and token counts are in the control state (``StepRow.SLOT``)
    WIDTH = 9


@dataclasses.dataclass(frozen=True)
class Drafts:
    """What a proposer offers for one step of B requests, before the device runs.

    Attributes:
      num_drafts: int64[B] the drafts each request verifies (a tree: the deepest path it may accept).
      step_k: the step's static k (drafts computed per request; a tree: its node count); 0 = none.
      host: the drafts made on the host, one entry per request (a chain: a list of token ids; a tree:
        an ``ngram_trie.Trie``), or None when the step's device half drafts (a draft model).
      predicted: bool[B] whether each request's drafts came from its prediction (predicted outputs), or
        None when none did.
      guesses: host chains planned with a step in flight: each request's guess of the token that step
        ends with (the drafter's first proposal, the chain after it; [] where none), or None.
    """

    num_drafts: np.ndarray
    step_k: int
    host: list | None = None
    predicted: np.ndarray | None = None
    guesses: list[list[int]] | None = None


@dataclasses.dataclass(frozen=True)
class Assumption:
    """What a step of host chains planned with a step in flight assumes that step appends to each of its
    requests (its chains follow these tokens): from position ``start`` (int64[B], the request's length
    when planned), ``tokens``: the step in flight's drafts, all accepted, then the drafter's guess of the
    token after them ([] for a request the step in flight does not run)."""

    start: np.ndarray
    tokens: list[list[int]]

    def held(self, i: int, tokens: np.ndarray, length: int) -> bool:
        """Whether request i's assumption came true, its row holding ``length`` ``tokens`` now."""
        start = int(self.start[i])
        end = start + len(self.tokens[i])
        return length >= end and tokens[start:end].tolist() == self.tokens[i]

    def subset(self, keep: np.ndarray) -> "Assumption":
        return Assumption(self.start[keep], [t for t, k in zip(self.tokens, keep.tolist()) if k])


@dataclasses.dataclass(frozen=True)
class DecodeWork:
    """One decode step as the scheduler planned it.

    Attributes:
      rows: int64[B] the running requests' ``RequestBatch`` rows, in step order.
      request_ids: their ids; k: the k chosen (config or controller); caps: int64[B] the most drafts
        each may offer (its budget - 1, at most k); drafts: the proposer's ``Drafts``.
      greedy: every request greedy; logprobs: some request asks for log-probabilities.
      kind: "greedy" or "sampling" (the controller that chose k and learns from the step).
      catch_up: the draft-only prefill to run before the step (lagging drafts), or None.
      grammar: int32[B, step_k + 1, ceil(V / 32)] structured output's token masks at each position
        (``decoding.grammar``; -1: every token), or None when no request is constrained.
      epochs: int64[B] the rows' ``RequestBatch.epoch`` (whose requests the step is for).
      carried: bool[B] the requests the step in flight (planned before this one, not yet fetched) runs
        too: the device moves their rows on by it (``decoding.carry``); None: no step in flight.
      number: the step's number among the scheduler's steps.
      assumed: host chains planned with a step in flight: what they assume that step appends, or None.
      split: the step runs in two calls: the device drafts, the host masks the constrained
        requests' drafts with their grammars (``Scheduler.mask_drafts``), the second call verifies them.
      automaton: the drafting automata (``grammar_automaton.DraftTables``) of a step with a draft model's or
        a head's chains and a constrained request, or None; draft_states: int32[B, 2] each request's
        automaton and state in them (-1: none). Unless ``split``, the requests with one are verified with
        its masks (the host checks them against the grammar's: ``Scheduler.update``).
    """

    rows: np.ndarray
    request_ids: list[str]
    k: int
    caps: np.ndarray
    drafts: Drafts
    greedy: bool
    logprobs: bool
    kind: str
    catch_up: "PrefillWork | None" = None
    grammar: np.ndarray | None = None
    epochs: np.ndarray | None = None
    carried: np.ndarray | None = None
    number: int = 0
    assumed: Assumption | None = None
    split: bool = False
    automaton: Any = None
    draft_states: np.ndarray | None = None

    def subset(self, keep: np.ndarray) -> "DecodeWork":
        """The work of the requests where bool[B] ``keep`` (those still running as planned)."""
        drafts = self.drafts
        host = None if drafts.host is None else [d for d, k in zip(drafts.host, keep.tolist()) if k]
        drafts = Drafts(drafts.num_drafts[keep], drafts.step_k, host,
                        None if drafts.predicted is None else drafts.predicted[keep],
                        None if drafts.guesses is None else [g for g, k in zip(drafts.guesses, keep.tolist()) if k])
        return dataclasses.replace(
            self, rows=self.rows[keep], request_ids=[r for r, k in zip(self.request_ids, keep.tolist()) if k],
            caps=self.caps[keep], drafts=drafts, grammar=None if self.grammar is None else self.grammar[keep],
            epochs=None if self.epochs is None else self.epochs[keep],
            carried=None if self.carried is None else self.carried[keep],
            assumed=None if self.assumed is None else self.assumed.subset(keep),
            draft_states=None if self.draft_states is None else self.draft_states[keep])


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the runner's one fetch brought back for a ``DecodeWork``.

    Attributes:
      output_token_ids: int32[B, K + 1] each request's emitted tokens (its first ``num_emitted``);
      num_emitted, num_accepted: int[B]; num_verified: int[B] the drafts the device verified (a chain's
        drafts after a stop token are not).
      logprobs: the emitted tokens' ``TokenLogprobs`` (numpy) when the work asked for them, else None.
      batch: the rows the step computed (padding included: what the controller's costs see).
      seconds: the step's wall time (planning excluded), None when it compiled or first ran an
        executable (no step cost); host_seconds: its host part.
    """

    output_token_ids: np.ndarray
    num_emitted: np.ndarray
    num_accepted: np.ndarray
    num_verified: np.ndarray
    logprobs: object | None
    batch: int
    seconds: float | None
    host_seconds: float

    def subset(self, keep: np.ndarray) -> "StepResult":
        """The results of the requests where bool[B] ``keep``."""
        logprobs = None if self.logprobs is None else type(self.logprobs)(*(f[keep] for f in self.logprobs))
        return dataclasses.replace(self, output_token_ids=self.output_token_ids[keep],
                                   num_emitted=self.num_emitted[keep], num_accepted=self.num_accepted[keep],
                                   num_verified=self.num_verified[keep], logprobs=logprobs)


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the controller learns from one step: per-request drafts offered and accepted, the step's
    time (None: no step cost), its batch, the requests' controller ids, and the k it ran at."""

    kind: str
    offered: np.ndarray
    accepted: np.ndarray
    seconds: float | None
    batch: int
    ids: np.ndarray
    k: int


@dataclasses.dataclass(frozen=True)
class PrefillWork:
    """Tokens [begin[b], begin[b] + count[b]) of the requests at ``rows`` to commit: to both caches (a new
    request's prompt but its last token), or to the draft's alone (``draft_only``: a catch-up after
    k = 0 steps, ``positions``)."""

    rows: np.ndarray
    begin: np.ndarray
    count: np.ndarray
    draft_only: bool
