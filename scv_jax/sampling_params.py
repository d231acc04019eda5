"""Per-request sampling parameters (vLLM's names and meanings), checked on construction, free of jax.

``SamplingParams`` describes one request; ``batch_sampling_arrays`` stacks a batch's into the numpy
arrays that ``scv_jax.ops.sampling.filtered_probs`` takes as device arrays, so that a batch's mix of
greedy and sampled requests is data, not a static argument (changing it compiles nothing). The logit
controls (penalties, ``logit_bias``, ``allowed_token_ids``, ``bad_words_token_ids``, ``min_tokens``) are
data too: ``SamplingParams.bias_row`` is a request's additive bias over the vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from scv_jax.arguments import is_int

GREEDY_EPSILON = 1e-5   # vLLM's _SAMPLING_EPS: a temperature below it means greedy decoding
MAX_LOGPROBS = 20       # the most top log-probabilities a request may ask for (as vLLM's default)
MAX_SEED = 2 ** 63      # seeds are ints in [0, 2**63)
INT32_MAX = 2 ** 31 - 1  # a larger top_k is stored as this (it keeps every token either way)
MAX_STOP_IDS = 16       # the most token ids that may end one request (its stop_token_ids and the model's eos ids)
MAX_PENALTY = 2.0       # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI, vLLM)
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
MAX_BAD_WORDS = 16      # the most bad words of several tokens one request may have (one-token ones: any number)
MAX_BAD_WORD_LEN = 8    # the most tokens in one bad word
ANY_TOKEN = -2          # a ``bad_word_table`` entry before a word shorter than MAX_BAD_WORD_LEN: matches anything


def _fail(name: str, expected: str, value: Any, error: type[Exception] = ValueError) -> None:
    raise error(f"SamplingParams.{name} must be {expected}, got {value!r}")


def _real(name: str, value: Any, expected: str) -> float:
    """``value`` as a finite Python float (ints and numpy reals count, bools and strings do not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        _fail(name, expected, value, TypeError)
    if not math.isfinite(float(value)):
        _fail(name, expected, value)
    return float(value)


def _token_ids(name: str, value: Any, expected: str) -> tuple[int, ...]:
    """``value`` (a sequence of ints >= 0, not a str) as a tuple of Python ints."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        _fail(name, expected, value, TypeError)
    return tuple(_integer(name, t, expected, 0) for t in value)


def _integer(name: str, value: Any, expected: str, minimum: int, maximum: int | None = None) -> int:
    """``value`` as a Python int in [minimum, maximum) (bools and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        _fail(name, expected, value, TypeError)
    if not is_int(value, minimum) or (maximum is not None and value >= maximum):
        _fail(name, expected, value)
    return int(value)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
      json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid against it.
      json_object: True: the output is one JSON object (OpenAI's ``response_format: json_object``).
      regex: a regular expression the whole output matches (Rust ``regex`` syntax, as llguidance's).
      choice: a non-empty sequence of strings: the output is one of them.
      grammar: a context-free grammar in Lark syntax (llguidance's dialect; GBNF with ``::=`` is
        converted), its start rule ``start``.

    JSON is generated compactly (no free whitespace between tokens: a small model cannot loop on
    whitespace runs). ``scv_jax.decoding.grammar`` compiles it with llguidance when the request is added.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        def fail(expected: str, value: Any, error: type[Exception] = ValueError) -> None:
            raise error(f"SamplingParams.structured_outputs must be {expected}, got {value!r}")

        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if not isinstance(self.json_object, (bool, np.bool_)):
            fail("given json_object as a bool", self.json_object, TypeError)
        if len(given) + bool(self.json_object) != 1:
            fail("given exactly one of json, json_object, regex, choice, grammar", self)
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    fail(f"given json as a JSON schema (a dict or its JSON text; {e})", self.json)
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                fail("given json as a JSON schema (an object)", self.json, TypeError)
            object.__setattr__(self, "json", json.dumps(schema, sort_keys=True))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                fail(f"given {name} as a non-empty str", value, TypeError)
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence) or not choice \
                    or not all(isinstance(c, str) and c for c in choice):
                fail("given choice as a non-empty sequence of non-empty strings", choice, TypeError)
            object.__setattr__(self, "choice", tuple(choice))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen (vLLM's ``SamplingParams`` fields and meanings).

    Attributes:
      temperature: >= 0; the logits are divided by it. Below ``GREEDY_EPSILON`` (1e-5, as vLLM) the
        request is greedy: its token is the argmax and top_k / top_p / min_p do not apply.
      top_k: keep the k most likely tokens (ties with the k-th kept); 0 or -1 = off.
      top_p: in (0, 1]; keep the smallest set of most likely tokens whose probability reaches top_p
        (ties with its last token kept); 1 = off.
      min_p: in [0, 1]; keep tokens with probability >= min_p * the most likely token's; 0 = off.
      seed: an int in [0, 2**63) for this request's random numbers, or None (the engine's stream).
      max_tokens: >= 1, the most tokens to generate.
      stop_token_ids: token ids (ints >= 0) that end the request (any sequence; stored as a tuple; with
        the model's eos ids at most ``MAX_STOP_IDS`` = 16 in all, checked when the request is added).
      ignore_eos: keep generating after the end-of-sequence token.
      logprobs: None, or how many top log-probabilities to return per token, 0 <= n <= 20
        (``scv_jax.ops.sampling.token_logprobs``; the emitted token's own is always returned).
      presence_penalty: in [-2, 2]; subtracted from the logit of every token the request has generated
        (vLLM: over the output tokens so far). 0 = off.
      frequency_penalty: in [-2, 2]; times the number of times the request has generated the token,
        subtracted from its logit. 0 = off.
      repetition_penalty: > 0; the logit of every token in the prompt or the output so far is divided
        by it where positive and multiplied by it otherwise (vLLM's). 1 = off.
      logit_bias: {token id: bias in [-100, 100]} added to those tokens' logits (OpenAI's; given as a
        mapping, stored as sorted (id, bias) pairs).
      allowed_token_ids: None, or a non-empty sequence of token ids: every other token is masked out.
      bad_words_token_ids: token-id sequences that may never be generated (vLLM's ``bad_words`` after
        tokenization), of 1 to ``MAX_BAD_WORD_LEN`` = 8 tokens, at most ``MAX_BAD_WORDS`` = 16 of them
        longer than one: a word's last token is masked out where the tokens generated last are the
        others (a one-token word's everywhere; a prompt's tokens never count, as in vLLM).
      min_tokens: >= 0, <= max_tokens; the stop tokens (``stop_token_ids`` and, unless ``ignore_eos``,
        the model's eos ids) are masked out until this many tokens were generated.
      num_speculative_tokens: scv-jax's own: None (the engine's choice: its k, or the adaptive
        controller's), or an int >= 0: the most drafts this request verifies per step (0: it never
        drafts; a tree's depth is capped there). Drafts are verified losslessly: its output's
        distribution does not depend on it (a greedy request's tokens neither); the speed does. The adaptive controller counts the request as
        one that can emit at most n + 1 tokens a step.
      structured_outputs: None, or a ``StructuredOutputsParams``: every token, drafts included, is masked
        by the grammar state the tokens before it reach; the request ends ("stop") when the grammar is
        complete. Needs ``Engine(tokenizer=...)``.

    The ids are checked against the vocabulary when the request is added (``Engine.add_request``). The
    controls apply, in vLLM's order, to the logits before the temperature and the filters: the bias
    and the masks, then the repetition, frequency and presence penalties; to greedy requests too.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Any = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    num_speculative_tokens: int | None = None
    prediction: tuple[int, ...] = ()
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        temperature = _real("temperature", self.temperature, "a finite float >= 0")
        if temperature < 0:
            _fail("temperature", "a finite float >= 0", self.temperature)
        set_("temperature", temperature)
        top_k = _integer("top_k", self.top_k, "an int >= 1, or 0 / -1 (off)", -1)
        set_("top_k", top_k)
        top_p = _real("top_p", self.top_p, "a float in (0, 1]")
        if not 0 < top_p <= 1:
            _fail("top_p", "a float in (0, 1]", self.top_p)
        set_("top_p", top_p)
        min_p = _real("min_p", self.min_p, "a float in [0, 1]")
        if not 0 <= min_p <= 1:
            _fail("min_p", "a float in [0, 1]", self.min_p)
        set_("min_p", min_p)
        if self.seed is not None:
            set_("seed", _integer("seed", self.seed, "None or an int in [0, 2**63)", 0, MAX_SEED))
        set_("max_tokens", _integer("max_tokens", self.max_tokens, "an int >= 1", 1))
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (Sequence, np.ndarray)):
            _fail("stop_token_ids", "a sequence of ints >= 0", stop, TypeError)
        set_("stop_token_ids", tuple(_integer("stop_token_ids", t, "a sequence of ints >= 0", 0) for t in stop))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            _fail("ignore_eos", "a bool", self.ignore_eos, TypeError)
        set_("ignore_eos", bool(self.ignore_eos))
        if self.logprobs is not None:
            set_("logprobs", _integer("logprobs", self.logprobs, f"None or an int in [0, {MAX_LOGPROBS}]", 0,
                                      MAX_LOGPROBS + 1))
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name), "a float in [-2, 2]")
            if abs(value) > MAX_PENALTY:
                _fail(name, "a float in [-2, 2]", getattr(self, name))
            set_(name, value)
        repetition = _real("repetition_penalty", self.repetition_penalty, "a finite float > 0")
        if not repetition > 0:
            _fail("repetition_penalty", "a finite float > 0", self.repetition_penalty)
        set_("repetition_penalty", repetition)
        set_("logit_bias", self._checked_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _token_ids("allowed_token_ids", self.allowed_token_ids,
                                 "None or a non-empty sequence of ints >= 0")
            if not allowed:
                _fail("allowed_token_ids", "None or a non-empty sequence of ints >= 0", self.allowed_token_ids)
            set_("allowed_token_ids", allowed)
        bad = self.bad_words_token_ids
        expected = (f"a sequence of sequences of 1 to {MAX_BAD_WORD_LEN} ints >= 0, at most {MAX_BAD_WORDS} of "
                    "them longer than one")
        if isinstance(bad, (str, bytes)) or not isinstance(bad, (Sequence, np.ndarray)):
            _fail("bad_words_token_ids", expected, bad, TypeError)
        words = tuple(_token_ids("bad_words_token_ids", word, expected) for word in bad)
        if (any(not 1 <= len(word) <= MAX_BAD_WORD_LEN for word in words)
                or sum(len(word) > 1 for word in words) > MAX_BAD_WORDS):
            _fail("bad_words_token_ids", expected, bad)
        set_("bad_words_token_ids", words)
        set_("min_tokens", _integer("min_tokens", self.min_tokens, "an int >= 0 and <= max_tokens", 0,
                                    self.max_tokens + 1))
        if self.num_speculative_tokens is not None:
            set_("num_speculative_tokens", _integer("num_speculative_tokens", self.num_speculative_tokens,
                                                    "None or an int >= 0", 0))
        set_("prediction", _token_ids("prediction", self.prediction, "a sequence of ints >= 0"))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs, TypeError)

    @staticmethod
    def _checked_bias(bias: Any) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` (a mapping, or (id, bias) pairs) as sorted (int id, float bias) pairs."""
        expected = "a mapping of ints >= 0 to floats in [-100, 100]"
        if isinstance(bias, Mapping):
            pairs = list(bias.items())
        elif isinstance(bias, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in bias):
            pairs = list(bias)
        else:
            _fail("logit_bias", expected, bias, TypeError)
        checked = {}
        for token, value in pairs:
            token = _integer("logit_bias", token, expected, 0)
            value = _real("logit_bias", value, expected)
            if abs(value) > MAX_LOGIT_BIAS or token in checked:
                _fail("logit_bias", expected, bias)
            checked[token] = value
        return tuple(sorted(checked.items()))

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax (temperature below ``GREEDY_EPSILON``)."""
        return self.temperature < GREEDY_EPSILON

    @property
    def filters(self) -> bool:
        """Whether a sampled request truncates its distribution (top-k, top-p or min-p on)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def penalties(self) -> bool:
        """Whether a penalty is on (presence, frequency or repetition)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def controlled(self) -> bool:
        """Whether the request's logits depend on its own state: a penalty, a bias or a mask (the decoder
        keeps its bias and token counts on the device); ``min_tokens`` alone does not need them."""
        return (self.penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))

    def token_ids(self) -> tuple[int, ...]:
        """Every token id the controls name (checked against the vocabulary when the request is added)."""
        return (tuple(t for t, _ in self.logit_bias) + (self.allowed_token_ids or ())
                + tuple(t for word in self.bad_words_token_ids for t in word))

    def bias_row(self, vocab_size: int) -> np.ndarray:
        """float32[vocab_size]: the request's additive logit bias: ``logit_bias``, and -inf outside
        ``allowed_token_ids`` and on the one-token ``bad_words_token_ids`` (ids must be < ``vocab_size``)."""
        row = np.zeros(vocab_size, np.float32)
        if self.logit_bias:
            ids, values = zip(*self.logit_bias)
            row[list(ids)] = values
        if self.allowed_token_ids is not None:
            allowed = np.zeros(vocab_size, np.bool_)
            allowed[list(self.allowed_token_ids)] = True
            row[~allowed] = -np.inf
        for word in self.bad_words_token_ids:
            if len(word) == 1:
                row[word[0]] = -np.inf
        return row

    def bad_word_table(self) -> np.ndarray:
        """int32[MAX_BAD_WORDS, MAX_BAD_WORD_LEN]: the bad words of several tokens, one a row, right-aligned
        after ``ANY_TOKEN`` entries; unused rows -1 (their last token bans nothing)."""
        table = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_LEN), -1, np.int32)
        for row, word in enumerate(w for w in self.bad_words_token_ids if len(w) > 1):
            table[row] = ANY_TOKEN
            table[row, MAX_BAD_WORD_LEN - len(word):] = word
        return table


class SamplingArrays(NamedTuple):
    """A batch's filter parameters, one entry per request row: ``filtered_probs``'s inputs.

    temperature: float32[B] (0 for greedy rows); top_k: int32[B] (0 = off); top_p: float32[B]
    (1 = off); min_p: float32[B] (0 = off).
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray


GREEDY = SamplingParams()


def batch_sampling_arrays(params: Sequence[SamplingParams], rows: int | None = None) -> SamplingArrays:
    """``params`` stacked into ``SamplingArrays`` of ``rows`` entries (default ``len(params)``); the
    rows past ``len(params)`` (padding) are greedy. Greedy requests get temperature 0 and their filters
    switched off, so that only the filters of sampled requests count (e.g. in ``filters`` tests)."""
    rows = len(params) if rows is None else rows
    if not is_int(rows, len(params)):
        raise ValueError(f"batch_sampling_arrays: rows must be an int >= len(params) = {len(params)}, got {rows!r}")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("batch_sampling_arrays: params must be SamplingParams")
    padded = list(params) + [GREEDY] * (rows - len(params))
    sampled = [not p.greedy for p in padded]
    return SamplingArrays(
        temperature=np.array([p.temperature if s else 0.0 for p, s in zip(padded, sampled)], np.float32),
        top_k=np.array([min(max(p.top_k, 0), INT32_MAX) if s else 0 for p, s in zip(padded, sampled)], np.int32),
        top_p=np.array([p.top_p if s else 1.0 for p, s in zip(padded, sampled)], np.float32),
        min_p=np.array([p.min_p if s else 0.0 for p, s in zip(padded, sampled)], np.float32))
