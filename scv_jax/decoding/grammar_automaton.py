"""Grammar-valid drafts from a device drafter: a token-level automaton of a constrained request's grammar,
which a device drafter's own sampling (a draft model's, an EAGLE-3 head's) follows inside the draft scan.

The automaton need not equal the grammar for decoding to stay lossless: a split step's drafts are masked
by llguidance on the host before they are verified (``decoding.grammar``), and a one-call step verified
with the automaton's masks is checked against llguidance's after (``Grammars.agreeing_prefix``, its tokens
cut where the two would choose differently); where they differ, fewer drafts are kept. It is built with
outlines-core (the token-level regex index vLLM's "outlines" backend uses) from a regular expression of
the request's constraint: a JSON schema through outlines-core's schema-to-regex (compact: no free
whitespace, as ``decoding.grammar`` generates JSON; integer and number bounds narrowed, which it
ignores: ``draft_regex``), a regex as it is,
a choice as the alternation of its strings. A Lark grammar and ``json_object`` (not regular) have none:
their requests draft freely and the host's masks cut the drafts (``automaton_for`` logs why).

Tables (``TokenAutomaton``): tokens that move every state alike share a class, so a state costs one int32
per class, not per token: ``next_state`` int32[S, C] (-1: the grammar forbids the class there) and
``token_class`` int32[V]. ``DraftTables`` packs the automata of a step's requests into one
fixed-capacity pair of device arrays (``TABLE_STATES`` states, ``max_classes(V)`` classes, ``MAX_GRAMMARS``
grammars), so the executables see one shape; ``device_step.DraftAutomaton`` reads them on the device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from typing import Any, Callable, Sequence

import numpy as np

from scv_jax.sampling_params import StructuredOutputsParams

TABLE_STATES = 4096        # the states of all automata a step drafts with (a fixed shape: no recompiles)
MAX_STATES = TABLE_STATES  # the most states of one automaton (a larger one drafts freely)
MAX_GRAMMARS = 8           # distinct automata a step drafts with; requests past them draft freely
MAX_CLASSES = 1024         # token classes of one automaton (at most the vocabulary)


def max_classes(vocab_size: int) -> int:
    """The token classes ``DraftTables`` holds per automaton at a vocabulary of ``vocab_size``."""
    return min(MAX_CLASSES, vocab_size)


@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
    """A token-level automaton: state s moves to ``next_state[s, token_class[t]]`` on token t (-1: t is
    forbidden there); ``initial``: the state before any output."""

    next_state: np.ndarray      # int32[S, C]
    token_class: np.ndarray     # int32[V]
    initial: int = 0
    _packed: dict[int, np.ndarray] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Host bytes of the tables (``DraftTables`` holds ``next_state`` padded to its classes)."""
        return self.next_state.nbytes + self.token_class.nbytes

    def allows(self, state: int) -> np.ndarray:
        """bool[V]: the tokens ``state`` allows (none at -1)."""
        if state < 0:
            return np.zeros(self.token_class.shape, np.bool_)
        return self.next_state[state, self.token_class] >= 0

    def packed(self, state: int) -> np.ndarray:
        """int32[ceil(V / 32)] ``allows(state)`` as a bit mask (token t: bit t % 32 of word t // 32, as
        llguidance writes masks); every token at -1 (as the device verifies: ``DraftAutomaton.allows``).
        Each state's is computed once."""
        mask = self._packed.get(state)
        if mask is None:
            vocab = self.token_class.shape[0]
            allows = np.ones(vocab, np.bool_) if state < 0 else self.allows(state)
            bits = np.zeros(-(-vocab // 32) * 32, np.bool_)
            bits[:vocab] = allows
            mask = self._packed[state] = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
        return mask

    def advance(self, state: int, tokens: Sequence[int]) -> int:
        """The state after ``tokens`` from ``state`` (-1 once one is forbidden, or an id past V)."""
        for token in tokens:
            if state < 0 or not 0 <= token < self.token_class.shape[0]:
                return -1
            state = int(self.next_state[state, self.token_class[token]])
        return state


def draft_regex(params: StructuredOutputsParams) -> tuple[str | None, str]:
    """(the regular expression whose language the drafts follow, or None; why there is none)."""
    if params.regex is not None:
        return params.regex, ""
    if params.choice is not None:
        return "(" + "|".join(re.escape(c) for c in params.choice) + ")", ""
    if params.json is not None:
        from outlines_core.json_schema import build_regex_from_schema
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        bounded: list[str] = []
        marked = _mark_bounded(schema, bounded)
        try:
            regex = build_regex_from_schema(json.dumps(marked), whitespace_pattern="")
        except Exception as e:       # outlines-core raises its own types for what it does not cover
            return None, f"outlines-core does not compile the schema to a regex ({str(e).splitlines()[0]})"
        for i, number in enumerate(bounded):
            regex = regex.replace(f'"{_MARK}{i}x"', number)
        return regex, ""
    return None, "a Lark grammar or json_object is not regular"


_MARK = "scvjaxbound"     # (a const string marking a bounded number's place in outlines-core's regex)
_UNSIGNED = "(0|[1-9][0-9]*)"
MAX_ENUMERATED = 100      # an integer range of at most this many values is drafted as their alternation


def _number_regex(schema: dict) -> str | None:
    """The regex of a bounded integer or number schema, where its bounds make it narrower than
    outlines-core's (which ignores them): an integer range of at most ``MAX_ENUMERATED`` values as their
    alternation; else, with a lower bound of at least 0, no sign (``[1-9][0-9]*`` for an integer above 0);
    else None."""
    def bound(name: str) -> float | None:
        value = schema.get(name)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    minimum, above, maximum, below = (bound(name) for name in ("minimum", "exclusiveMinimum", "maximum",
                                                               "exclusiveMaximum"))
    if schema.get("type") == "integer":             # (the least and the greatest integer allowed)
        lows = ([] if minimum is None else [math.ceil(minimum)]) + ([] if above is None else [math.floor(above) + 1])
        highs = ([] if maximum is None else [math.floor(maximum)]) + ([] if below is None else [math.ceil(below) - 1])
        lo, hi = max(lows, default=None), min(highs, default=None)
        if lo is not None and hi is not None and 0 <= hi - lo < MAX_ENUMERATED:
            return "(" + "|".join(str(v) for v in range(lo, hi + 1)) + ")"
        if lo is not None and lo >= 0:
            return "[1-9][0-9]*" if lo >= 1 else _UNSIGNED
    elif schema.get("type") == "number" and max((b for b in (minimum, above) if b is not None), default=-1) >= 0:
        return rf"({_UNSIGNED})(\.[0-9]+)?([eE][+-][0-9]+)?"
    return None


def _mark_bounded(schema: Any, bounded: list[str]) -> Any:
    """``schema`` with each integer or number schema that ``_number_regex`` narrows replaced by a const
    string ``_MARK{i}x``, that regex appended to ``bounded``: a target drawn past a bound the drafts
    ignore (a ``-`` where the minimum is 0, a third digit below a maximum of 20) would be cut by the
    grammar's masks (``Grammars.agreeing_prefix``)."""
    if isinstance(schema, list):
        return [_mark_bounded(s, bounded) for s in schema]
    if not isinstance(schema, dict):
        return schema
    regex = _number_regex(schema)
    if regex is not None:
        bounded.append(regex)
        return {"const": f"{_MARK}{len(bounded) - 1}x"}
    return {key: value if key in ("const", "enum", "default", "examples") else _mark_bounded(value, bounded)
            for key, value in schema.items()}


def token_classes(rows: Sequence[dict[int, int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(int32[S, C] next states by class, int32[V] each token's class) of the transitions ``rows``
    (state s: {token: next state}; tokens absent are forbidden). Tokens whose column of next states is
    the same share a class (found by a 64-bit hash of the column, then checked exactly)."""
    weights = np.random.default_rng(0).integers(1, 2**63, size=len(rows), dtype=np.uint64) | np.uint64(1)
    dense = np.empty(vocab_size, np.int64)

    def column(row: dict[int, int]) -> np.ndarray:
        """int64[V] the row's next state per token (-1: forbidden), in ``dense``."""
        dense.fill(-1)
        if row:
            dense[np.fromiter(row.keys(), np.int64, len(row))] = np.fromiter(row.values(), np.int64, len(row))
        return dense

    signature = np.zeros(vocab_size, np.uint64)
    for s, row in enumerate(rows):
        signature += (column(row) + 2).astype(np.uint64) * weights[s]
    _, first, token_class = np.unique(signature, return_index=True, return_inverse=True)
    next_state = np.full((len(rows), first.size), -1, np.int32)
    for s, row in enumerate(rows):
        next_state[s] = column(row)[first]
        if not np.array_equal(next_state[s, token_class], dense):       # a hash collision: never silent
            raise RuntimeError("token_classes: two token columns share a hash; report this grammar")
    return next_state, token_class.astype(np.int32)


class AutomatonBuilder:
    """Builds ``TokenAutomaton``s over one vocabulary: ``token_bytes[t]`` each token's bytes (b"": never
    drafted, e.g. a special token), ``eos_ids`` the ids allowed where the grammar may end.

    outlines-core (0.2.10 to 0.2.14) leaves out a final state's moves into states that are not final
    (``(ab)*`` would allow nothing after "ab" but the end), so the index is built for the regex followed
    by an end byte, b"\\x00", of a token of its own (id V): where it may come, the grammar may end. A token
    holding that byte is never drafted."""

    def __init__(self, token_bytes: Sequence[bytes], eos_ids: Sequence[int]):
        import outlines_core
        self.vocab_size, self.eos_ids = len(token_bytes), tuple(eos_ids)
        by_bytes: dict[bytes, list[int]] = {b"\x00": [self.vocab_size]}
        for token, text in enumerate(token_bytes):
            if text and b"\x00" not in text and token not in self.eos_ids:
                by_bytes.setdefault(bytes(text), []).append(token)
        self._vocabulary = outlines_core.Vocabulary(self.vocab_size + 1, by_bytes)
        self._outlines = outlines_core

    def build(self, regex: str) -> TokenAutomaton | None:
        """The automaton of ``regex`` over the vocabulary, or None past ``MAX_STATES`` states."""
        index = self._outlines.Index(f"({regex})\\x00", self._vocabulary)
        transitions, initial = index.get_transitions(), index.get_initial_state()
        end = self.vocab_size
        ended = {row[end] for row in transitions.values() if end in row}      # after the end byte: dropped
        states = {initial, *transitions, *(t for row in transitions.values() for t in row.values())} - ended
        if len(states) > MAX_STATES:
            return None
        ids = {state: i for i, state in enumerate(sorted(states))}
        rows: list[dict[int, int]] = [{} for _ in ids]
        for state, row in transitions.items():
            if state in ended:
                continue
            out = rows[ids[state]]
            for token, target in row.items():
                if token == end:
                    out.update(dict.fromkeys(self.eos_ids, ids[state]))
                elif token < end:
                    out[token] = ids[target]
        next_state, token_class = token_classes(rows, self.vocab_size)
        return TokenAutomaton(next_state, token_class, ids[initial])


def automaton_for(params: StructuredOutputsParams, builder: AutomatonBuilder,
                  request_id: str = "") -> TokenAutomaton | None:
    """The drafting automaton of a request's constraint, or None (logged with the reason: its drafts are
    then free, cut by the host's masks)."""
    regex, why = draft_regex(params)
    automaton = None
    if regex is not None:
        try:
            automaton = builder.build(regex)
        except Exception as e:       # outlines-core's errors (unsupported regex syntax, no valid token)
            why = f"outlines-core cannot index it ({str(e).splitlines()[0]})"
        else:
            if automaton is None:
                why = f"more than {MAX_STATES} states"
            elif automaton.next_state.shape[1] > max_classes(builder.vocab_size):
                automaton, why = None, f"more than {max_classes(builder.vocab_size)} token classes"
    if automaton is None:
        logging.getLogger(__name__).info("request %s: drafts follow no automaton of its structured output: %s",
                                         request_id, why)
    return automaton


class DraftTables:
    """The automata of the running constrained requests in one fixed-shape pair of tables (host copies;
    ``arrays`` the device ones): ``next_state`` int32[TABLE_STATES, max_classes(V)] (global state ids),
    ``token_class`` int32[MAX_GRAMMARS, V]. Automata are keyed by their constraint (``draft_key``), kept while
    steps draft with them (``hold``); ``state_of`` gives a request's global state."""

    def __init__(self, vocab_size: int):
        self.next_state = np.full((TABLE_STATES, max_classes(vocab_size)), -1, np.int32)
        self.token_class = np.zeros((MAX_GRAMMARS, vocab_size), np.int32)
        self._placed: dict[str, tuple[int, int, TokenAutomaton]] = {}   # key -> (slot, first state, automaton)
        self._device: tuple[Any, Any] | None = None

    def hold(self, automata: dict[str, TokenAutomaton]) -> set[str]:
        """Places the automata a step drafts with (by key), keeping those already placed and dropping the
        others. Returns the keys placed (those past the capacity are not: their requests draft freely)."""
        if any(key not in self._placed for key in automata):
            self._placed = {key: placed for key, placed in self._placed.items() if key in automata}
            for key, automaton in automata.items():
                if key not in self._placed:
                    self._place(key, automaton)
        return {key for key in automata if key in self._placed}

    def _place(self, key: str, automaton: TokenAutomaton) -> None:
        size = automaton.next_state.shape[0]
        first = self._free_rows(size)
        slot = next((s for s in range(MAX_GRAMMARS) if s not in {p[0] for p in self._placed.values()}), None)
        if first is None or slot is None:
            return
        rows = slice(first, first + size)
        table = automaton.next_state
        self.next_state[rows] = -1
        self.next_state[rows, :table.shape[1]] = np.where(table >= 0, table + first, -1)
        self.token_class[slot] = automaton.token_class
        self._placed[key] = (slot, first, automaton)
        self._device = None

    def _free_rows(self, size: int) -> int | None:
        """The first state row of a free run of ``size`` rows (first fit), or None."""
        start = 0
        for first, end in sorted((f, f + a.next_state.shape[0]) for _, f, a in self._placed.values()):
            if first - start >= size:
                return start
            start = max(start, end)
        return start if TABLE_STATES - start >= size else None

    def state_of(self, key: str, state: int) -> tuple[int, int]:
        """(slot, global state) of ``key``'s automaton at its own ``state`` (-1: no constraint)."""
        slot, first, _ = self._placed[key]
        return slot, (first + state if state >= 0 else -1)

    def arrays(self, put: Callable[[np.ndarray], Any]) -> tuple[Any, Any]:
        """The device tables (``put``: host array -> device array), uploaded again after a change."""
        if self._device is None:
            self._device = put(self.next_state), put(self.token_class)
        return self._device


def draft_key(params: StructuredOutputsParams) -> str:
    """What identifies a constraint's automaton (its regex's source)."""
    return json.dumps(dataclasses.asdict(params), sort_keys=True, default=list)
