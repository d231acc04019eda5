"""Predicted outputs (OpenAI's ``prediction``): a request's expected output drafts for it.

A request with ``SamplingParams.prediction`` (token ids) drafts from its prediction, in the place of the
engine's host drafter, wherever its output so far lines up with the prediction; where it does not (the
output diverged and has not re-aligned, or the prediction is used up) the host drafter drafts for it as
for any request. The drafts are verified like any other (a point mass, ``q`` one-hot), so the
prediction changes the speed, never the output.

The alignment rule (``PredictionIndex.propose``): with no output yet, the prediction's first tokens;
then the longest suffix of the output, at most ``PREDICTION_MATCH`` tokens, that occurs in the
prediction ending after the alignment point (where the last match ended; the start at first), at its
first such occurrence, proposes the prediction's tokens after it and becomes the alignment point. A
one-token match counts only right at the alignment point (the output continuing the prediction): one
common token elsewhere must neither skip the rest of the prediction nor keep the host drafter out.
Host-side and incremental: a proposal is at most ``PREDICTION_MATCH`` dict
lookups and a bisection.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

PREDICTION_MATCH = 3    # the longest suffix of the output matched against the prediction


class PredictionIndex:
    """One request's prediction: the end positions of each of its n-grams (n <= ``PREDICTION_MATCH``),
    ascending, and the alignment point."""

    def __init__(self, prediction: Sequence[int], prompt_len: int):
        self.prediction, self.prompt_len, self.aligned = list(prediction), prompt_len, 0
        self._ends: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(self.prediction) + 1):
            for n in range(1, min(PREDICTION_MATCH, end) + 1):
                self._ends.setdefault(tuple(self.prediction[end - n:end]), []).append(end)

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` prediction tokens to follow ``tokens`` (the request's prompt + output so far)."""
        output = tokens[self.prompt_len:]
        if k <= 0:
            return []
        if not output.size:
            return self.prediction[:k]
        for n in range(min(PREDICTION_MATCH, output.size), 0, -1):
            ends = self._ends.get(tuple(output[-n:].tolist()), ())
            i = bisect.bisect_right(ends, self.aligned)        # the match ends after the alignment point
            if i < len(ends) and (n > 1 or ends[i] == self.aligned + 1):
                self.aligned = ends[i]
                return self.prediction[ends[i]:ends[i] + k]
        return []


class Predictions:
    """The running requests' ``PredictionIndex``es, by request id (a host proposer's)."""

    def __init__(self):
        self._indexes: dict[str, PredictionIndex] = {}

    def __bool__(self) -> bool:
        return bool(self._indexes)

    def start(self, request_id: str, prompt_len: int, prediction: Sequence[int]) -> None:
        """A request with a prediction starts (or resumes after a preemption)."""
        self._indexes[request_id] = PredictionIndex(prediction, prompt_len)

    def finish(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray],
                caps: np.ndarray) -> list[list[int]]:
        """Each request's prediction drafts, at most ``caps[i]`` ([] without a prediction or a match)."""
        return [[] if index is None else index.propose(tokens, cap)
                for index, tokens, cap in zip(map(self._indexes.get, request_ids), token_ids, caps.tolist())]
