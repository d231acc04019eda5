"""Token ids -> text as they are generated: never a broken UTF-8 character, stop strings honoured.

``IncrementalDetokenizer`` is vLLM's prefix/read-offset scheme: the text of the newest tokens is the
decoding of a short window (the tokens since the last emitted text, after a few tokens of context)
minus the decoding of that context, held back while it ends in U+FFFD (a character whose bytes are
still arriving). Decoding a window, not the whole output, keeps a token's cost independent of the
output's length; starting the window a few tokens back keeps tokenizers that drop a text's leading
space (sentencepiece) from dropping it mid-output.

``TextStream`` feeds a request's tokens one at a time through the detokenizer and the stop strings:
the output ends at the first token whose text completes a stop string (also one spanning tokens or an
accepted run of drafts), the stop string itself not emitted (emitted with ``include_stop``, and nothing
after it); while stop strings are set, the last ``len(longest) - 1`` characters are held back (they may
be the start of one).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

CONTEXT_TOKENS = 5   # tokens of context before the window (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``add(token_id) -> str``: the new text that token completes ("" while a character is partial).

    ``decode``: ids -> text; ``context``: the ids before the output (the prompt's tail gives the first
    output token its leading space where a tokenizer would drop it).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()):
        self._decode = decode
        self._ids = list(context[-CONTEXT_TOKENS:])
        self._prefix = 0                 # window start: context for the tokens after read
        self._read = len(self._ids)      # tokens before this have had their text emitted

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """What is held back (an incomplete character's U+FFFD) at the end of the output."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = max(self._read, len(self._ids) - CONTEXT_TOKENS), len(self._ids)
        return text[len(prefix):]


@dataclasses.dataclass
class StreamUpdate:
    """What a batch of new tokens adds: ``text`` to emit, ``num_tokens`` of them used (fewer than given
    when a stop string ended the output), ``stopped``: a stop string ended it."""

    text: str
    num_tokens: int
    stopped: bool


class TextStream:
    """One request's output text: ``add(token_ids)`` -> ``StreamUpdate``; ``finish()`` -> the rest.

    ``text`` is everything emitted so far (the final text once finished)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = (),
                 stop: Sequence[str] = (), *, include_stop: bool = False):
        self._detokenizer = IncrementalDetokenizer(decode, context)
        self._stop, self._include_stop = tuple(s for s in stop if s), include_stop
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""     # decoded, not yet emitted (may begin a stop string)
        self.text = ""
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> StreamUpdate:
        if self.stopped:
            return StreamUpdate("", 0, True)
        emitted = len(self.text)
        for used, token_id in enumerate(token_ids, 1):
            start = len(self._pending)        # a new stop string ends after this (earlier text was checked)
            self._pending += self._detokenizer.add(token_id)
            end = self._stop_end(start)
            if end is not None:
                self.text += self._pending[:end]
                self._pending, self.stopped = "", True
                return StreamUpdate(self.text[emitted:], used, True)
        cut = max(0, len(self._pending) - self._hold)
        self.text, self._pending = self.text + self._pending[:cut], self._pending[cut:]
        return StreamUpdate(self.text[emitted:], len(token_ids), False)

    def finish(self) -> str:
        """The held-back rest of the text (the request ended for another reason than a stop string)."""
        if self.stopped:
            return ""
        rest = self._pending + self._detokenizer.flush()
        end = self._stop_end(0, rest)
        rest = rest if end is None else rest[:end]
        self._pending, self.text = "", self.text + rest
        return rest

    def _stop_end(self, start: int, text: str | None = None) -> int | None:
        """Where ``text`` (default the pending text) ends at the earliest stop string that ends past
        ``start``: before it, or after it with ``include_stop``; None without one."""
        text = self._pending if text is None else text
        hits = [(i, i + len(s)) for s in self._stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if not hits:
            return None
        begin, end = min(hits)
        return end if self._include_stop else begin
