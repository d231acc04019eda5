"""The drafting automata of constrained requests (``decoding.grammar_automaton``) on the 16-character
vocabulary of the structured-output tests: along random paths, an automaton's allowed tokens equal
llguidance's masks for a regex and a choice (and for the tests' JSON schema); the device's
``DraftAutomaton`` (two automata packed in one ``DraftTables``) equals the host automata; token classes
rebuild every transition; a Lark grammar has no automaton (logged); the tables hold at most
``MAX_GRAMMARS`` automata and keep those a step still uses."""

from __future__ import annotations

import json
import logging
import re

import jax.numpy as jnp
import llguidance.numpy
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from scv_jax import StructuredOutputsParams as Structured
from scv_jax.decoding import grammar_automaton
from scv_jax.decoding.device_step import DraftAutomaton
from scv_jax.decoding.grammar import Grammars, allowed
from scv_jax.decoding.grammar_automaton import (AutomatonBuilder, DraftTables, TokenAutomaton, automaton_for,
                                                draft_key, draft_regex, token_classes)
from tests.decoding.test_structured_output import CHARS, CONSTRAINTS, make_tokenizer
from tests.models.fixtures import TINY

VOCAB = TINY.vocab_size
EXACT = ("json", "regex", "choice")


def grammars() -> Grammars:
    return Grammars(make_tokenizer().to_str(), VOCAB, ())     # (no end token in the vocabulary)


def builder(g: Grammars) -> AutomatonBuilder:
    return AutomatonBuilder(g.token_bytes(), g.eos_ids)


def llguidance_allows(matcher) -> np.ndarray:
    mask = llguidance.numpy.allocate_token_bitmask(1, 17)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    return np.array([allowed(mask[0], t) for t in range(VOCAB)])


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(EXACT), picks=st.lists(st.integers(0, 10**6), max_size=12))
def test_automaton_masks_are_llguidances_along_random_paths(name, picks):
    """Each step takes a token both allow (the pick-th, cyclically): the two agree at every position."""
    g = grammars()
    automaton = automaton_for(CONSTRAINTS[name], builder(g))
    matcher = g.matcher(CONSTRAINTS[name])
    state = automaton.initial
    for pick in picks:
        expected = llguidance_allows(matcher)
        assert (automaton.allows(state) == expected).all(), (name, state, matcher.is_stopped())
        choices = np.flatnonzero(expected)
        if matcher.is_stopped() or not choices.size:
            break
        token = int(choices[pick % choices.size])
        assert matcher.consume_token(token)
        state = automaton.advance(state, [token])
        assert state >= 0


@settings(max_examples=20, deadline=None)
@given(paths=st.lists(st.lists(st.integers(-1, VOCAB), max_size=6), min_size=2, max_size=2))
def test_the_device_tables_are_the_host_automata(paths):
    """Two automata packed in ``DraftTables``: ``DraftAutomaton.mask`` and ``advance`` along any tokens (ids
    out of range included: the state becomes -1, every token then allowed) equal ``TokenAutomaton``'s."""
    g = grammars()
    build = builder(g)
    automata = {draft_key(CONSTRAINTS[n]): automaton_for(CONSTRAINTS[n], build) for n in ("json", "regex")}
    tables = DraftTables(VOCAB)
    assert tables.hold(automata) == set(automata)
    next_state, token_class = tables.arrays(jnp.asarray)
    keys = list(automata)
    slots_states = np.array([tables.state_of(key, automata[key].initial) for key in keys], np.int32)
    device = DraftAutomaton(next_state, token_class, jnp.asarray(slots_states[:, 0]), jnp.asarray(slots_states[:, 1]))
    host = [automata[key].initial for key in keys]
    states = device.states
    for step in range(max(map(len, paths))):
        logits = device.mask(jnp.zeros((2, VOCAB)), states)
        for row, key in enumerate(keys):
            expected = automata[key].allows(host[row]) if host[row] >= 0 else np.ones(VOCAB, np.bool_)
            if not expected.any():
                expected = np.ones(VOCAB, np.bool_)               # nothing allowed: the logits as they were
            assert (np.asarray(logits[row]) == 0).tolist() == expected.tolist(), (key, step)
        tokens = np.array([p[step] if step < len(p) else 0 for p in paths], np.int32)
        states = device.advance(states, jnp.asarray(tokens))
        host = [automata[key].advance(h, [int(t)]) if h >= 0 else -1 for key, h, t in zip(keys, host, tokens)]
        expected_states = [tables.state_of(key, h)[1] for key, h in zip(keys, host)]
        assert np.asarray(states).tolist() == expected_states


@settings(max_examples=20, deadline=None)
@given(nodes=st.lists(st.tuples(st.integers(-1, VOCAB), st.integers(-2, 6)), max_size=7))
def test_the_device_states_along_a_tree_are_the_host_automatas(nodes):
    """``DraftAutomaton.along_tree`` of a tree (node tokens and parents, out-of-range ones included): -1
    at the root, then each node's state after its path (a parent outside [-1, i): -1) as
    ``TokenAutomaton.advance`` gives it; ``mask`` of [B, N + 1, V] logits at those states is ``mask``'s of
    each [B, V] column."""
    g = grammars()
    build = builder(g)
    automata = {draft_key(CONSTRAINTS[n]): automaton_for(CONSTRAINTS[n], build) for n in ("json", "regex")}
    tables = DraftTables(VOCAB)
    assert tables.hold(automata) == set(automata)
    keys = list(automata)
    slots_states = np.array([tables.state_of(key, automata[key].initial) for key in keys], np.int32)
    device = DraftAutomaton(*tables.arrays(jnp.asarray), jnp.asarray(slots_states[:, 0]), jnp.asarray(slots_states[:, 1]))
    tokens = np.array([[t for t, _ in nodes]] * 2, np.int32).reshape(2, len(nodes))
    parents = np.array([[p for _, p in nodes]] * 2, np.int32).reshape(2, len(nodes))
    along = np.asarray(device.along_tree(jnp.asarray(tokens), jnp.asarray(parents)).along)
    for row, key in enumerate(keys):
        states = [automata[key].initial]
        for i, (token, parent) in enumerate(nodes):
            before = states[parent + 1] if -1 <= parent < i else -1
            states.append(automata[key].advance(before, [token]) if before >= 0 else -1)
        assert along[row].tolist() == [-1] + [tables.state_of(key, h)[1] for h in states[1:]]
    logits = device.mask(jnp.zeros((2, len(nodes) + 1, VOCAB)), jnp.asarray(along))
    for j in range(len(nodes) + 1):
        assert (np.asarray(logits[:, j]) == np.asarray(device.mask(jnp.zeros((2, VOCAB)), jnp.asarray(along[:, j])))).all()


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.dictionaries(st.integers(0, 11), st.integers(0, 4), max_size=12), min_size=1, max_size=5))
def test_token_classes_rebuild_every_transition(rows):
    next_state, token_class = token_classes(rows, 12)
    for s, row in enumerate(rows):
        assert [int(next_state[s, token_class[t]]) for t in range(12)] == [row.get(t, -1) for t in range(12)]
    assert next_state.shape[1] == len({tuple(row.get(t, -1) for row in rows) for t in range(12)})


def test_a_lark_grammar_has_no_automaton(caplog):
    with caplog.at_level(logging.INFO, logger=grammar_automaton.__name__):
        assert automaton_for(CONSTRAINTS["lark"], builder(grammars()), "r7") is None
    assert "request r7: drafts follow no automaton of its structured output: a Lark grammar" in caplog.text


def test_outlines_final_states_keep_their_moves():
    """outlines-core drops a final state's moves into non-final states; the end byte put after the regex
    keeps them: after "ab", "a" (more) is allowed under ``(ab)+``."""
    automaton = automaton_for(Structured(regex="(ab)+"), builder(grammars()))
    state = automaton.advance(automaton.initial, [CHARS.index("a"), CHARS.index("b")])
    assert np.flatnonzero(automaton.allows(state)).tolist() == [CHARS.index("a")]


def test_the_tables_hold_what_fits_and_keep_what_a_step_uses(monkeypatch):
    """At most ``MAX_GRAMMARS`` automata at once; those past it are not held (their requests draft
    freely); a step keeps the automata it shares with the one before in place (same global states)."""
    monkeypatch.setattr(grammar_automaton, "MAX_GRAMMARS", 2)
    build = builder(grammars())
    automata = {str(i): automaton_for(Structured(choice=["a" * (i + 1)]), build) for i in range(3)}
    tables = DraftTables(VOCAB)
    assert len(tables.hold(automata)) == 2
    kept = sorted(tables.hold({key: automata[key] for key in ("0", "1")}))
    placed = {key: tables.state_of(key, 0) for key in kept}
    assert tables.hold({kept[0]: automata[kept[0]], "2": automata["2"]}) == {kept[0], "2"}
    assert tables.state_of(kept[0], 0) == placed[kept[0]]
    assert isinstance(automata["0"], TokenAutomaton) and automata["0"].nbytes > 0


def test_too_many_states_draft_freely(monkeypatch, caplog):
    monkeypatch.setattr(grammar_automaton, "MAX_STATES", 4)
    with caplog.at_level(logging.INFO, logger=grammar_automaton.__name__):
        assert automaton_for(CONSTRAINTS["json"], builder(grammars())) is None
    assert "more than 4 states" in caplog.text


@pytest.mark.parametrize("regex", ["(a", "[b-a]"])
def test_a_regex_outlines_cannot_index_drafts_freely(regex, caplog):
    with caplog.at_level(logging.INFO, logger=grammar_automaton.__name__):
        assert automaton_for(Structured(regex=regex), builder(grammars())) is None
    assert "outlines-core cannot index it" in caplog.text


@settings(max_examples=40, deadline=None)
@given(drafted=st.sampled_from(["(ab|ba)+1{2,4}", "[ab1]+1{2,4}", "(ab)+1{2,4}"]), greedy=st.booleans(),
       picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=8))
def test_the_agreeing_prefix_ends_where_the_masks_first_differ(drafted, greedy, picks):
    """``Grammars.agreeing_prefix`` of a step's tokens (the first among llguidance's allowed tokens, the
    next ones among the automaton's: the grammar's own regex's automaton, a wider regex's or a narrower
    one's): the tokens before the first position after the first where the automaton's mask is not
    llguidance's (greedy: where it lacks a token llguidance's allows, or the token is not llguidance's),
    or through the token completing the grammar; the matcher is left where it was."""
    g = grammars()
    automaton = automaton_for(Structured(regex=drafted), builder(g))
    matcher, reference = g.matcher(CONSTRAINTS["regex"]), g.matcher(CONSTRAINTS["regex"])
    state, tokens, expected, differed = automaton.initial, [], None, False
    for position, pick in enumerate(picks):
        grammar_allows, drafts_allow = llguidance_allows(reference), automaton.allows(state)
        choices = np.flatnonzero(drafts_allow if position else grammar_allows)
        if not choices.size:
            break
        tokens.append(int(choices[pick % choices.size]))
        cut = ((grammar_allows & ~drafts_allow).any() or not grammar_allows[tokens[-1]] if greedy
               else (drafts_allow != grammar_allows).any())
        if position and cut:
            expected, differed = position, True
            break
        assert reference.consume_token(tokens[-1])
        if reference.is_stopped():
            expected = position + 1
            break
        state = automaton.advance(state, tokens[-1:])
    count = len(tokens) if expected is None else expected
    assert g.agreeing_prefix(matcher, automaton, automaton.initial, tokens, greedy) == (count, differed)
    assert not (differed and drafted == "(ab|ba)+1{2,4}")
    assert matcher.consume_tokens(tokens[:count])          # (from where it was: the start)


@settings(max_examples=80, deadline=None)
@given(minimum=st.sampled_from([None, -3, 0, 0.5, 1, 7]), maximum=st.sampled_from([None, -1, 2.5, 20, 500]),
       exclusive=st.booleans(), kind=st.sampled_from(["integer", "number"]),
       value=st.one_of(st.integers(-30, 30), st.floats(-30, 30, allow_nan=False).map(lambda x: round(x, 2) + 0.0)))
def test_a_schemas_bounds_narrow_its_regex(minimum, maximum, exclusive, kind, value):
    """``draft_regex`` of a schema with a bounded integer or number, in an array in an object: it matches
    every value the bounds allow (a superset of the grammar's language); none below 0 where the lower
    bound is at least 0; exactly the bounds' values for an integer range of at most 100 values, an
    integer's lower bound 0 or 1 alone and a number's minimum 0 alone."""
    bounds = {**({} if minimum is None else {"exclusiveMinimum" if exclusive else "minimum": minimum}),
              **({} if maximum is None else {"exclusiveMaximum" if exclusive else "maximum": maximum})}
    schema = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": kind, **bounds}}},
              "required": ["n"], "additionalProperties": False}
    regex, _ = draft_regex(Structured(json=schema))
    if kind == "integer":
        value = int(value)
    matched = re.fullmatch(regex, json.dumps({"n": [value]}, separators=(",", ":"))) is not None
    above = minimum is None or (value > minimum if exclusive else value >= minimum)
    below = maximum is None or (value < maximum if exclusive else value <= maximum)
    assert matched or not (above and below)
    if minimum is not None and minimum >= 0:
        assert not matched or value >= 0
    exact = ((kind == "integer" and minimum is not None and maximum is not None and 0 <= maximum - minimum < 99)
             or (maximum is None and (kind, exclusive, minimum) in {("integer", False, 0), ("integer", False, 1),
                                                                   ("integer", True, 0), ("number", False, 0)}))
    if exact:
        assert matched == (above and below)
