"""Structured output on the host, with llguidance (the grammar engine vLLM and SGLang also use): a
request's ``StructuredOutputsParams`` compiled to a matcher (``Grammars.matcher``), and each step's
token masks (``step_masks``): for every position a constrained request verifies, the tokens the grammar
allows after the tokens before it (its output so far and the drafts before that position). A draft the
grammar forbids ends the request's drafts there (nothing after it is scored or written; in a tree, its
subtree is dropped); so does a draft that completes the grammar (the bonus token then completes it, and
the request ends at once). The device sets every other token's logit to -inf at that position, so
constrained speculative decoding samples what constrained autoregressive decoding would.

Masks are bit sets, 32 tokens a word (token t: bit t % 32 of word t // 32), as llguidance writes them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from scv_jax.decoding.proposers.base import Trie
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

    def token_bytes(self) -> list[bytes]:
        """Each model id's bytes (b"" for a special token and an id past the tokenizer's)."""
        tokenizer = self._tokenizer
        return [b"" if t >= tokenizer.vocab_size or tokenizer.is_special_token(t) else tokenizer.decode_bytes([t])
                for t in range(self.vocab_size)]

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

    def step_masks(self, matchers: Sequence[Any], tries: Sequence[Trie], positions: int,
                   banned: Sequence[Sequence[int]] | None = None) -> tuple[list[Trie], np.ndarray]:
        """The masks of a step's constrained requests, and their drafts as far as the grammar allows.

        Args:
          matchers: each request's matcher, at its output so far (left there).
          tries: each request's drafts as a tree (a chain: ``path_trie``); may be empty.
          positions: the step's positions per request (k + 1; a tree: its nodes + 1).
          banned: per request, ids its masks never allow (the eos ids of a request that ignores them).
        Returns:
          (the tries without the nodes the grammar forbids, those that complete it (the bonus token
          completes it instead) and their descendants, nodes in order; int32[R, positions,
          mask_words(vocab_size)] the masks: row 0 after the request's output, row i + 1 after kept
          node i's path; rows past the kept nodes allow every token (nothing is verified there)).
        """
        fill = self._llguidance.numpy.fill_next_token_bitmask
        masks = np.full((len(matchers), positions, mask_words(self.vocab_size)), -1, np.int32)
        scratch = np.zeros((positions, self._words), np.int32)
        kept_tries = []
        for r, (matcher, trie) in enumerate(zip(matchers, tries)):
            fill(matcher, scratch, 0)
            kept: dict[int, int] = {}                     # node -> its index among the kept nodes
            paths: list[list[int]] = []                   # each kept node's path from the root
            tokens, parents = [], []
            for node, (token, parent) in enumerate(zip(trie.tokens, trie.parents)):
                if len(tokens) == positions - 1:
                    break
                if parent >= 0 and parent not in kept:    # an ancestor was dropped
                    continue
                up = kept[parent] if parent >= 0 else -1
                if not allowed(scratch[up + 1], token):
                    continue
                path = (paths[up] if up >= 0 else []) + [int(token)]
                matcher.consume_tokens(path)
                complete = matcher.is_stopped()
                if not complete:
                    fill(matcher, scratch, len(tokens) + 1)
                matcher.rollback(len(path))
                if complete:
                    continue
                kept[node] = len(tokens)
                paths.append(path)
                tokens.append(int(token))
                parents.append(up)
            kept_tries.append(Trie(tokens, parents))
            masks[r, :len(tokens) + 1] = self._model_masks(scratch[:len(tokens) + 1], banned[r] if banned else ())
        return kept_tries, masks

    def _model_masks(self, filled: np.ndarray, banned: Sequence[int] = ()) -> np.ndarray:
        """int32[R, mask_words(vocab_size)]: llguidance's masks int32[R, its words] over the model's ids (ids
        past the tokenizer's: none), without the tokens never allowed and ``banned``."""
        words = mask_words(self.vocab_size)
        shared = min(words, self._words)
        masks = np.zeros((filled.shape[0], words), np.int32)
        masks[:, :shared] = filled[:, :shared]
        bits = masks.view(np.uint32)
        for token in (*self._never, *banned):
            if token < self.vocab_size:
                bits[:, token // 32] &= ~np.uint32(1 << (token % 32))
        return masks


    def agreeing_prefix(self, matcher: Any, automaton: Any, state: int, tokens: Sequence[int],
                        greedy: bool) -> tuple[int, bool]:
        """How many of a step's emitted ``tokens`` constrained decoding would have emitted, for a request
        whose step was verified with its drafting automaton's masks (a ``TokenAutomaton``, at ``state``
        after its output so far; ``matcher`` there, and left there). The first token was chosen under the
        host's mask; each next one counts while the automaton's mask at its position is the grammar's
        (sampled: the same distribution) or, ``greedy``, allows every token the grammar's does and the token
        is the grammar's too (the argmax over the automaton's tokens is then the argmax over the grammar's);
        none after the token that completes the grammar. Returns (that count, whether a token was cut
        there: the automaton is not the grammar for this request)."""
        fill = self._llguidance.numpy.fill_next_token_bitmask
        words = mask_words(self.vocab_size)
        scratch = np.zeros((1, self._words), np.int32)
        valid = np.full(words, -1, np.int32)                  # the bits of the model's ids
        if self.vocab_size % 32:
            valid[-1] = np.int32(np.uint32((1 << (self.vocab_size % 32)) - 1).view(np.int32))
        consumed, count, differed = 0, len(tokens), False
        for position, token in enumerate(tokens):
            if position:
                fill(matcher, scratch, 0)
                grammar = self._model_masks(scratch)[0]
                drafted = automaton.packed(state) & valid
                agrees = (not (grammar & ~drafted & valid).any() and allowed(grammar, token) if greedy
                          else np.array_equal(grammar & valid, drafted))
                if not agrees:
                    count, differed = position, True
                    break
            if not matcher.consume_token(int(token)):
                count = max(position, 1)  # (a fault: the masks allowed it; ``Scheduler`` logs it, ends the request)
                break
            consumed += 1
            if matcher.is_stopped():
                count = position + 1
                break
            state = automaton.advance(state, [int(token)])
        matcher.rollback(consumed)
        return count, differed


def allowed(mask: np.ndarray, token: int) -> bool:
    """Whether int32[W] ``mask`` allows ``token``."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _kind(params: StructuredOutputsParams) -> str:
    return next(name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(params, name))
