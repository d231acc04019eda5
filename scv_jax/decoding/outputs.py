"""What an ``Engine.step`` returns for each request: ``RequestOutput`` (with ``TokenLogprob``s)."""

from __future__ import annotations

import dataclasses
from typing import Literal

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
        stop token, or its structured output complete), "abort", or None while it runs.
      num_draft_tokens, num_accepted_tokens: drafts verified and accepted so far;
        num_accepted_per_pos: accepted drafts so far at each draft position (1, 2, ...).
      logprobs: one ``TokenLogprob`` per new token when the request asked for them, else None.
      num_cached_tokens: prompt tokens served from the prefix cache, not computed (vLLM's name).
      num_accepted_prediction_tokens, num_rejected_prediction_tokens: of the drafts verified so far, those
        that came from the request's prediction (``SamplingParams.prediction``) and were accepted /
        rejected (OpenAI's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``).
      stop_token_id: the eos or stop token that ended the request (its last token), else None.
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
    num_cached_tokens: int = 0
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    stop_token_id: int | None = None
