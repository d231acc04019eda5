"""``TokenIndex``: token segments (one request's text, or the outputs of many finished requests) indexed for
suffix matching on the host; ``SuffixDrafter`` (``suffix.py``) keeps one per running request and one
across requests.

Each n-gram (n in ``LEVELS``) of a segment maps to the positions just after its occurrences (ascending),
keyed by a 64-bit polynomial hash (from the text's prefix hashes as tokens arrive, directly for a
lookup's context).
A lookup takes the longest of the context's last 16, 4 or 1 tokens (``LEVELS``) that occurred, then
measures its ``MAX_CANDIDATES`` most recent occurrences backwards against the context: the longest match
is the context's longest suffix found there (at most the context's length), and the occurrences that
reach it are the suffix tree's node for it. Appending tokens costs one dictionary append per token and
level (O(tokens appended), not a rebuild); a lookup costs at most O(candidates x context) whatever the text's
length, less where candidates fall short early. Positions are absolute (they survive dropping the oldest
segments); a separator (-1) ends each closed segment, so neither a match nor a continuation crosses
into another request's text.
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from typing import NamedTuple, Sequence

LEVELS = (1, 4, 16)         # the n-gram lengths indexed (an occurrence of the longest found is a candidate)
MAX_CANDIDATES = 64         # the most recent occurrences of that n-gram measured against the context
_SEPARATOR = -1
_MULTIPLIER = 0x9E3779B97F4A7C15         # odd: the hash's base, arithmetic modulo 2**64
_MASK = 2 ** 64 - 1


def context_hash(tokens: Sequence[int]) -> int:
    """The hash of one n-gram (a list of ids): sum over j of (tokens[j] + 1) x _MULTIPLIER ** (n - 1 - j),
    modulo 2**64 (``TokenIndex`` computes the same from its prefix hashes)."""
    value = 0
    for token in tokens:
        value = (value * _MULTIPLIER + token + 1) & _MASK
    return value


class Match(NamedTuple):
    """The context's longest suffix found in an index: its length, and the positions just after its
    occurrences that reach it, most recent first."""

    length: int
    ends: list[int]


class TokenIndex:
    """Token segments, appended to the last one (``extend``) until it is closed (``close_segment``); the
    oldest closed segment can be dropped (``drop_oldest``). ``levels``: the n-gram lengths indexed."""

    def __init__(self, levels: Sequence[int] = LEVELS):
        self.levels = tuple(sorted(levels))
        self._tokens = array("q")             # tokens (and separators) from absolute position ``_first`` on
        self._prefix = array("Q", [0])       # [i]: the hash of ``_tokens[:i]`` (differences give n-grams')
        self._powers = tuple(pow(_MULTIPLIER, n, 2 ** 64) for n in self.levels)
        self._first = 0
        # per level: n-gram hash -> the position just after its one occurrence, or a list of them (ascending)
        self._after: tuple[dict[int, int | list[int]], ...] = tuple({} for _ in self.levels)
        self._closed: deque[tuple[int, int]] = deque()       # the closed segments' [start, stop)
        self._open_start = 0

    @property
    def end(self) -> int:
        """The absolute position after the last token."""
        return self._first + len(self._tokens)

    @property
    def num_segments(self) -> int:
        """The closed segments held."""
        return len(self._closed)

    @property
    def num_tokens(self) -> int:
        """The tokens held (a separator after each closed segment included)."""
        return self.end - (self._closed[0][0] if self._closed else self._open_start)

    def tokens(self, start: int) -> list[int]:
        """The held tokens from absolute position ``start`` on."""
        return self._tokens[start - self._first:].tolist()

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to the open segment, indexing each n-gram that ends at a new token."""
        text, prefix, first = self._tokens, self._prefix, self._first
        levels = tuple(zip(self.levels, self._powers, self._after))
        segment, last = self._open_start - first, prefix[-1]
        for token in tokens:
            token = int(token)
            text.append(token)
            last = (last * _MULTIPLIER + token + 1) & _MASK
            prefix.append(last)
            end = len(text)
            for n, power, after in levels:
                if end - n < segment:
                    break
                key = (last - prefix[end - n] * power) & _MASK
                seen = after.get(key)
                if seen is None:
                    after[key] = end + first
                elif type(seen) is int:
                    after[key] = [seen, end + first]
                else:
                    seen.append(end + first)

    def close_segment(self) -> None:
        """Ends the open segment (a separator follows it); the next ``extend`` starts a new one."""
        if self.end > self._open_start:
            self._closed.append((self._open_start, self.end))
            self._tokens.append(_SEPARATOR)
            self._prefix.append((self._prefix[-1] * _MULTIPLIER + _SEPARATOR + 1) & _MASK)
        self._open_start = self.end

    def drop_oldest(self) -> None:
        """Forgets the oldest closed segment: its occurrences leave the index (they lead each list)."""
        start, stop = (at - self._first for at in self._closed.popleft())
        prefix = self._prefix
        for n, power, after in zip(self.levels, self._powers, self._after):
            for key in {(prefix[end] - prefix[end - n] * power) & _MASK for end in range(start + n, stop + 1)}:
                positions = after[key]
                if type(positions) is int or positions[-1] <= stop + self._first:
                    del after[key]
                else:
                    del positions[:bisect.bisect_right(positions, stop + self._first)]
        held = (self._closed[0][0] if self._closed else self._open_start) - self._first
        if held > len(self._tokens) // 2:          # compact: drop what no segment holds any more
            del self._tokens[:held]
            del self._prefix[:held]
            self._first += held

    def match(self, context: Sequence[int], before: int | None = None) -> Match | None:
        """The longest suffix of ``context`` (a list of ids) occurring in the index (ending at a position
        below ``before``, if given), or None: no token of the context's last one occurred."""
        ends = self._candidates(context, before)
        if not ends:
            return None
        text, first, width = self._tokens, self._first, len(context)
        pattern = array("q", context)
        longest, reaching, tail = 0, [], pattern[:0]
        for end in ends:
            at = end - first
            if longest and (at < longest or text[at - longest] != pattern[width - longest]
                            or text[at - longest:at] != tail):
                continue                                  # falls short of the longest so far
            length = longest
            while length < width and length < at and text[at - length - 1] == pattern[width - length - 1]:
                length += 1
            if length > longest:
                longest, reaching, tail = length, [end], pattern[width - length:]
            elif length == longest:
                reaching.append(end)
        return Match(longest, reaching) if longest else None

    def continuations(self, ends: Sequence[int], width: int) -> list[list[int]]:
        """The (at most ``width``) tokens from each position in ``ends`` on, up to its segment's end."""
        out = []
        for end in ends:
            tokens = self._tokens[end - self._first:end - self._first + width].tolist()
            out.append(tokens[:tokens.index(_SEPARATOR)] if _SEPARATOR in tokens else tokens)
        return out

    def _candidates(self, context: Sequence[int], before: int | None) -> list[int]:
        """The positions after the most recent ``MAX_CANDIDATES`` occurrences (ending below ``before``) of
        the longest indexed n-gram ending ``context``, most recent first; [] if none occurred."""
        for n, after in zip(reversed(self.levels), reversed(self._after)):
            if n > len(context):
                continue
            positions = after.get(context_hash(context[-n:]))
            if positions is None:
                continue
            if type(positions) is int:
                positions = [positions]
            stop = len(positions) if before is None else bisect.bisect_left(positions, before)
            if stop:
                return positions[max(0, stop - MAX_CANDIDATES):stop][::-1]
        return []
