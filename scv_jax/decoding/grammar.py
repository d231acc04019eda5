"""Structured output on the host, with llguidance (the grammar engine vLLM and SGLang also use): a
request's ``StructuredOutputsParams`` compiled to a matcher (``Grammars.matcher``), and each step's
token masks (``step_masks``): for every position a constrained request verifies, the tokens the grammar
allows after the tokens before it (its output so far and the drafts before that position). A draft the
grammar forbids ends the request's drafts there (nothing after it is scored or written); so does a draft
that completes the grammar (the bonus token then completes it, and the request ends at once). The
device sets every other token's logit to -inf at that position, in the target's (and a draft model's)
logits, so constrained speculative decoding samples what constrained autoregressive decoding would.

Masks are bit sets, 32 tokens a word (token t: bit t % 32 of word t // 32), as llguidance writes them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from scv_jax.sampling_params import StructuredOutputsParams


def mask_words(vocab_size: int) -> int:
    """The int32 words of one position's mask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def grammar_text(params: StructuredOutputsParams, llguidance) -> str:
    """llguidance's grammar for ``params`` (JSON compactly: no free whitespace)."""
    matcher = llguidance.LLMatcher
    compact = {"whitespace_flexible": False}
    if params.json is not None:
        return matcher.grammar_from_json_schema(params.json, defaults=compact)
    if params.json_object:
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
    if params.regex is not None:
        return matcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    lark = params.grammar
    if "::=" in lark:                     # GBNF (llama.cpp's), as vLLM also accepts
        lark = llguidance.gbnf_to_lark(lark)
    return matcher.grammar_from_lark(lark)


class Grammars:
    """Compiles requests' ``StructuredOutputsParams`` for one engine's vocabulary.

    ``tokenizer_json``: the model's ``tokenizer.json`` text (``Tokenizer.to_json``); ``vocab_size``: the
    model's (ids past the tokenizer's are never allowed); ``eos_ids``: the model's end-of-sequence ids
    (allowed where the grammar may end). Without one, a special token added past the tokenizer's stands
    for the end and is never allowed: such a request ends when its grammar is complete, or at max_tokens.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]):
        try:
            import llguidance
            import llguidance.numpy
        except ImportError:
            raise ImportError("structured output needs the llguidance package: pip install llguidance") from None
        import tokenizers

        self._llguidance = llguidance
        self.vocab_size, self.eos_ids = vocab_size, tuple(eos_ids)
        eos = list(eos_ids)
        self._never: tuple[int, ...] = ()
        if not eos:
            end = tokenizers.Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
            spec = json.loads(tokenizer_json)
            spec["added_tokens"] = [*(spec.get("added_tokens") or []), {
                "id": end, "content": "<|scv_jax_grammar_end|>", "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True}]
            tokenizer_json, eos, self._never = json.dumps(spec), [end], (end,)
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        except ValueError as e:
            raise ValueError(f"Engine: llguidance cannot read the tokenizer ({e})") from None
        self._words = mask_words(self._tokenizer.vocab_size)

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A new ``llguidance.LLMatcher`` of ``params``; ValueError (naming
        ``SamplingParams.structured_outputs``) when its grammar does not compile."""
        llguidance = self._llguidance
        text = grammar_text(params, llguidance)
        error = llguidance.LLMatcher.validate_grammar(text, self._tokenizer)
        if error:
            raise ValueError(f"SamplingParams.structured_outputs: invalid {_kind(params)}: {error.splitlines()[0]}")
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"SamplingParams.structured_outputs: invalid {_kind(params)}: "
                             f"{matcher.get_error().splitlines()[0]}")
        return matcher

    def step_masks(self, matchers: Sequence[Any], chains: Sequence[Sequence[int]], positions: int,
                   banned: Sequence[Sequence[int]] | None = None) -> tuple[list[list[int]], np.ndarray]:
        """The masks of a step's constrained requests and their drafts as far as the grammar allows.

        Args:
          matchers: each request's matcher, at its output so far (left there).
          chains: each request's drafts (a chain; may be empty).
          positions: the step's positions per request (its k + 1).
          banned: per request, ids its masks never allow (the eos ids of a request that ignores them).
        Returns:
          (the chains cut before the first draft the grammar forbids or that completes it, int32[R,
          positions, mask_words(vocab_size)] the masks at each position; positions past a chain's end
          allow every token: nothing is verified there).
        """
        fill = self._llguidance.numpy.fill_next_token_bitmask
        words = mask_words(self.vocab_size)
        shared = min(words, self._words)
        masks = np.full((len(matchers), positions, words), -1, np.int32)
        scratch = np.zeros((positions, self._words), np.int32)
        cut = []
        for r, (matcher, chain) in enumerate(zip(matchers, chains)):
            consumed = 0
            for j in range(min(len(chain), positions - 1) + 1):
                fill(matcher, scratch, j)
                if j == len(chain) or j == positions - 1:
                    break
                token = int(chain[j])
                if not allowed(scratch[j], token) or not matcher.consume_token(token):
                    break
                consumed += 1
                if matcher.is_stopped():          # the grammar is complete: the bonus token completes it
                    consumed -= 1
                    matcher.rollback(1)
                    break
            if consumed:
                matcher.rollback(consumed)
            cut.append(list(chain[:consumed]))
            rows = masks[r, :consumed + 1]
            rows[:, :shared] = scratch[:consumed + 1, :shared]
            rows[:, shared:] = 0                  # model ids past the tokenizer's
            bits = rows.view(np.uint32)
            for token in (*self._never, *(banned[r] if banned else ())):
                if token < self.vocab_size:
                    bits[:, token // 32] &= ~np.uint32(1 << (token % 32))
        return cut, masks


def allowed(mask: np.ndarray, token: int) -> bool:
    """Whether int32[W] ``mask`` allows ``token``."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _kind(params: StructuredOutputsParams) -> str:
    return next(name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(params, name))
