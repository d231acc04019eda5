"""The typed records that join a decode step's roles, and the column maps of the step's per-request
inputs; host-only (no jax import), so the scheduler and the batch state use them without the device step.

A step: the scheduler's ``DecodeWork`` (which requests, how many drafts each, the static k) goes to the
runner, which calls the step executable once and fetches its ``StepResult`` once; the scheduler turns
that result into each request's output.
"""

from __future__ import annotations

import dataclasses

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
    STOP = 6            # MAX_STOP_IDS columns: the token ids that end the request (-1 = none)
    TOKENS = STOP + MAX_STOP_IDS   # the request's last MAX_CATCH_UP tokens, the pending one last
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
    """

    num_drafts: np.ndarray
    step_k: int
    host: list | None = None
    predicted: np.ndarray | None = None


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
