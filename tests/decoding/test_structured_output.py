"""Structured output (``SamplingParams.structured_outputs``, llguidance) in the engine, on the tiny target
with a 16-character vocabulary: constrained autoregressive greedy decoding equals an oracle (argmax of
the target's logits over the tokens a fresh grammar allows); constrained speculative greedy decoding
(n-gram drafts, a draft model and an EAGLE-3 head in split steps, trees) equals it token for token, every output valid; a
draft the grammar forbids cuts the chain there; a request drafts freely until its automaton is built; sampled
tokens 1 and 2 follow the masked target distribution (chi-square; n-gram drafts and a draft model) in
batches mixing constrained and plain requests, nothing compiling after warm-up;
``Grammars.step_masks`` equals llguidance's masks along each chain; bad constraints get one line."""

from __future__ import annotations

import json
import re
import threading
import time

import llguidance
import llguidance.numpy
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders as token_decoders, models, pre_tokenizers

from scv_jax import DecoderConfig, Engine, HostDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from scv_jax import StructuredOutputsParams as Structured
from scv_jax.decoding import scheduler as scheduler_module
from scv_jax.decoding.grammar import Grammars, allowed
from scv_jax.decoding.proposers.base import Trie, path_trie
from scv_jax.graph.compile_counter import CompileCounter
from tests.decoding.common import SMALL
from tests.decoding.test_eagle3_decoding import random_head
from tests.decoding.test_engine import run, target_logits, tokens  # noqa: F401 (a fixture)
from tests.decoding.test_tree_decoding import TREE_CONFIG
from tests.models.fixtures import TINY
from tests.ops.sampling.oracle import fits

CHARS = '{}":,[]ab12yesno'          # token i is CHARS[i]
assert len(CHARS) == TINY.vocab_size
K3 = DecoderConfig(**{**vars(SMALL), "k": 3})
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"enum": ["yes", "no"]}, "maxItems": 3}},
          "required": ["a", "b"], "additionalProperties": False}
# (json_object is the server tests': its null / true / false need letters this vocabulary lacks)
CONSTRAINTS = {"json": Structured(json=SCHEMA),
               "regex": Structured(regex="(ab|ba)+1{2,4}"), "choice": Structured(choice=["yes", "no", "none"]),
               "lark": Structured(grammar='start: item ("," item)*\nitem: "a" | "b" "1"*')}
MAX_TOKENS = 24


def valid(name: str, text: str, complete: bool) -> bool:
    """Whether ``text`` satisfies constraint ``name`` (a prefix of it when not ``complete``)."""
    if name == "json":
        if not complete:
            return text.startswith("{")
        value = json.loads(text)
        return set(value) == {"a", "b"} and isinstance(value["a"], int) and all(v in ("yes", "no") for v in value["b"])
    patterns = {"regex": "(ab|ba)+1{2,4}", "choice": "yes|no|none", "lark": '(a|b1*)(,(a|b1*))*'}
    return bool(re.fullmatch(patterns[name], text)) if complete else True


def make_tokenizer() -> Tokenizer:
    """Byte-level: token i is the character CHARS[i]."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = token_decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def device_drafters(target, partial_draft, tmp_path_factory):
    """The drafters whose chains a constrained step splits: a draft model and a random EAGLE-3 head."""
    return {"model": partial_draft,
            "head": random_head(target, tmp_path_factory.mktemp("head"), seed=3, draft_vocab=TINY.vocab_size)}


@pytest.fixture(scope="module")
def decoders(target, device_drafters):
    return {"target": SpeculativeDecoder(target, None, config=SMALL),
            "ngram": SpeculativeDecoder(target, NgramDrafter(1, 3), config=K3),
            **{name: SpeculativeDecoder(target, drafter, config=K3) for name, drafter in device_drafters.items()},
            **{f"{name}-tree": SpeculativeDecoder(target, drafter, config=TREE_CONFIG)
               for name, drafter in device_drafters.items()},
            "tree": SpeculativeDecoder(target, NgramDrafter(1, 3), config=TREE_CONFIG)}


def text(ids) -> str:
    return "".join(CHARS[t] for t in ids)


def oracle(target_logits, tokenizer, prompt: list[int], constraint: Structured) -> list[int]:  # noqa: F811
    """Greedy decoding of the target under ``constraint`` with llguidance alone, one forward per token."""
    matcher = Grammars(tokenizer.to_str(), TINY.vocab_size, ()).matcher(constraint)
    mask = llguidance.numpy.allocate_token_bitmask(1, 17)
    out: list[int] = []
    while len(out) < MAX_TOKENS and not matcher.is_stopped():
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        ok = np.array([allowed(mask[0], t) for t in range(TINY.vocab_size)])
        token = int(np.argmax(np.where(ok, target_logits(prompt + out), -np.inf)))
        assert matcher.consume_token(token)
        out.append(token)
    return out


PROMPTS = [[7, 8, 7, 8, 7], [0, 2, 7, 2, 3], [9, 9, 1, 12]]


@pytest.mark.parametrize("drafter", ["target", "ngram", "model", "head", "tree", "model-tree", "head-tree"])
@pytest.mark.slow
def test_greedy_constrained_equals_the_oracle(target_logits, tokenizer, decoders, drafter):  # noqa: F811
    """Every constraint, three prompts each, in one batch with a plain request: greedy outputs equal the
    llguidance-only oracle's, the constrained ones are valid (complete ones end "stop"), the plain one
    equals its autoregressive output, and drafts of each constraint's requests were verified and accepted
    (the draft model's and an EAGLE-3 head's chains and trees too: drafted along the grammar's drafting
    automaton, verified with its masks; but for the Lark grammar's, which has none: a chain's free drafts
    may all be cut, a tree verifies none)."""
    engine = Engine(decoders[drafter], tokenizer=tokenizer)
    arrivals = [(p, SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=c), f"{name}-{i}")
                for name, c in CONSTRAINTS.items() for i, p in enumerate(PROMPTS)]
    arrivals.append((PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS), "plain"))
    outputs = run(engine, {0: arrivals})
    for name, constraint in CONSTRAINTS.items():
        for i, prompt in enumerate(PROMPTS):
            out = outputs[f"{name}-{i}"][-1]
            assert list(out.token_ids) == oracle(target_logits, tokenizer, prompt, constraint), (name, i)
            assert valid(name, text(out.token_ids), out.finish_reason == "stop"), (name, text(out.token_ids))
            assert out.stop_token_id is None
    assert tokens(outputs, "plain") == decoders["target"].generate([PROMPTS[0]], MAX_TOKENS).tokens[0]
    if drafter != "target":          # (the draft model's and the head's: split steps, drafted along each grammar's
        for name in CONSTRAINTS:     # automaton; a Lark grammar has none: its free drafts may all be cut)
            accepted = sum(outputs[f"{name}-{i}"][-1].num_accepted_tokens for i in range(3))
            assert accepted > 0 or (drafter not in ("ngram", "tree") and name == "lark"), name
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("drafter, num_constrained", [("target", 1), ("model", 1), ("target", 2)])
def test_constrained_requests_sit_out_every_other_step_in_flight(target_logits, tokenizer, decoders, drafter,  # noqa: F811
                                                                 num_constrained):
    """One step in flight with constrained requests a quarter of the batch: the plain requests emit every
    step, each constrained one every other step (its grammar moves on when its step is fetched, and its
    masks are computed while the step after runs), a draft model's too (its drafts verified with its
    drafting automaton's masks: one call, not split); with half the batch constrained the steps are
    synchronous, every request emitting every step. Greedy outputs equal the oracle's and the plain
    requests' autoregressive ones."""
    engine = Engine(decoders[drafter], tokenizer=tokenizer)
    assert engine.overlaps
    constrained = {"c0": (PROMPTS[0], "json"), "c1": (PROMPTS[1], "regex")}
    constrained = dict(list(constrained.items())[:num_constrained])
    for request_id, (prompt, name) in constrained.items():
        engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[name]),
                           request_id)
    plain = {f"p{i}" for i in range(4 - num_constrained)}          # (SMALL runs 4 requests at most)
    for request_id in sorted(plain):
        engine.add_request(PROMPTS[int(request_id[1])], SamplingParams(max_tokens=MAX_TOKENS), request_id)
    outputs, emitted = {}, []                 # emitted: per step, the requests that emitted
    for _ in range(200):
        if not engine.has_unfinished():
            break
        step = engine.step()
        emitted.append({out.request_id for out in step if out.new_token_ids})
        for out in step:
            outputs.setdefault(out.request_id, []).append(out)
    plain_running = [i for i, ids in enumerate(emitted) if plain <= ids]
    window = range(plain_running[0], plain_running[-1])      # (their last step ends them: the batch changes)
    assert len(window) >= 4 and all(plain <= emitted[i] for i in window)
    for request_id in constrained:
        steps = [i for i in window if request_id in emitted[i]]
        gap = 2 if num_constrained == 1 else 1
        assert len(steps) >= 2 and all(b - a == gap for a, b in zip(steps, steps[1:])), (request_id, steps)
    for request_id, (prompt, name) in constrained.items():
        assert tokens(outputs, request_id) == oracle(target_logits, tokenizer, prompt, CONSTRAINTS[name])
    for request_id in plain:
        prompt = PROMPTS[int(request_id[1])]
        assert tokens(outputs, request_id) == decoders["target"].generate([prompt], MAX_TOKENS).tokens[0]
    assert engine.num_free_blocks == engine.num_blocks


def test_a_request_drafts_freely_while_its_automaton_is_built(target_logits, tokenizer, decoders, monkeypatch):  # noqa: F811
    """A constrained request of a draft-model engine runs at once while its drafting automaton is still being
    built (on a thread of its own): its drafts are free meanwhile, its output the oracle's."""
    built = threading.Event()
    build = scheduler_module.automaton_for

    def slow_build(*args, **kwargs):
        assert built.wait(60)
        return build(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "automaton_for", slow_build)
    engine = Engine(decoders["model"], tokenizer=tokenizer)
    try:
        outputs = run(engine, {0: [(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS,
                                                               structured_outputs=CONSTRAINTS["regex"]), "c"),
                                   (PROMPTS[1], SamplingParams(max_tokens=4), "p")]})
    finally:
        built.set()
    assert tokens(outputs, "c") == oracle(target_logits, tokenizer, PROMPTS[0], CONSTRAINTS["regex"])


def test_an_automaton_that_fails_to_build_leaves_free_drafts(target_logits, tokenizer, decoders, monkeypatch,  # noqa: F811
                                                              caplog):
    """An error building a drafting automaton (on its thread) is logged; the request decodes, drafting
    freely, its output the oracle's."""
    def broken(*args, **kwargs):
        raise RuntimeError("no vocabulary")

    monkeypatch.setattr(scheduler_module, "AutomatonBuilder", broken)
    engine = Engine(decoders["model"], tokenizer=tokenizer)
    with caplog.at_level("ERROR", logger=scheduler_module.__name__):
        outputs = run(engine, {0: [(PROMPTS[2], SamplingParams(max_tokens=8, structured_outputs=CONSTRAINTS["json"]),
                                    "r")]}, max_steps=10_000)
    assert tokens(outputs, "r") == oracle(target_logits, tokenizer, PROMPTS[2], CONSTRAINTS["json"])[:8]
    assert "request r: its drafting automaton failed to build" in caplog.text


@pytest.mark.parametrize("drafter", ["model", "head"])
def test_the_warmup_of_structured_steps_holds_both_calls_of_a_split_step(target, tokenizer, device_drafters,
                                                                         drafter):
    """``warmup_jobs(structured_output=True)`` (what ``serve`` compiles in the background) holds a split
    step's first call (``draft_only``, with the drafting tables) and its second (given a proposal), greedy
    and sampled, beside the one-call constrained steps (a new decoder: nothing of it compiled yet)."""
    engine = Engine(SpeculativeDecoder(target, device_drafters[drafter], config=K3), tokenizer=tokenizer)
    assert engine.supports_structured_output
    plain = {(job.cache.name, job.key) for job in engine.warmup_jobs(4, SMALL.max_seq_len)}
    jobs = [job for job in engine.warmup_jobs(4, SMALL.max_seq_len, structured_output=True)
            if (job.cache.name, job.key) not in plain]
    described = [job.cache.describe(job.key) for job in jobs]
    for greedy in (True, False):
        assert any(f"greedy={greedy}" in d and "draft_only=True" in d and "k=3" in d for d in described)
    givens = [set(job.key[2]) for job in jobs]
    assert any({"proposal", "grammar"} <= given for given in givens)
    assert any({"draft_tables", "draft_states"} <= given and "grammar" not in given for given in givens)
    assert any({"draft_tables", "draft_states", "grammar"} <= given for given in givens)     # one call


@pytest.mark.parametrize("drafter", ["model", "head"])
def test_an_automaton_other_than_the_grammar_is_caught(target_logits, tokenizer, decoders, drafter, monkeypatch,  # noqa: F811
                                                       caplog):
    """A drafting automaton narrower than its greedy request's grammar (no ``b`` after ``ab``): the first
    step verified with its masks is cut where they lack a token the grammar's allow (its tokens from that
    position dropped as rejected), logged, and the request's later drafts are verified with the grammar's
    masks (split steps); the output is the oracle's. (A wider one is the sampled test's.)"""
    build, built = scheduler_module.automaton_for, threading.Event()

    def wider(params, builder, request_id):
        automaton = build(Structured(regex="(ab)+1{2,4}"), builder, request_id)
        built.set()
        return automaton

    monkeypatch.setattr(scheduler_module, "automaton_for", wider)
    engine = Engine(decoders[drafter], tokenizer=tokenizer)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["regex"]), "r")
    assert built.wait(60)
    time.sleep(0.1)                 # (its future done: the first step drafts along it)
    with caplog.at_level("INFO", logger=scheduler_module.__name__):
        outputs = run(engine, {})
    assert tokens(outputs, "r") == oracle(target_logits, tokenizer, PROMPTS[0], CONSTRAINTS["regex"])
    assert "request r: its drafting automaton's masks differ from its grammar's" in caplog.text
    assert engine.num_free_blocks == engine.num_blocks


class Forbidden(HostDrafter):
    """Proposes ``a`` ``1`` ``a`` every step: under the regex ``[ab]+`` (no token forced) ``1`` is forbidden."""

    def propose(self, request_ids, token_ids, max_drafts):
        return [[7, 9, 7][:int(n)] for n in max_drafts]


def test_a_forbidden_draft_cuts_the_chain(target, tokenizer):
    """Drafts after the first one the grammar forbids are never verified (one verified draft a step at
    most: ``a`` where allowed), and the output is the grammar's."""
    engine = Engine(SpeculativeDecoder(target, Forbidden(), config=K3), tokenizer=tokenizer)
    engine.add_request([1, 2], SamplingParams(max_tokens=12, structured_outputs=Structured(regex="[ab]+")), "r")
    steps = []
    while engine.has_unfinished():
        steps += engine.step()
    drafted = [o.num_draft_tokens for o in steps]
    assert all(b - a <= 1 for a, b in zip([0] + drafted, drafted)) and drafted[-1] > 0
    assert re.fullmatch("[ab]+", text(steps[-1].token_ids))


class Nothing(HostDrafter):
    """Never drafts: the drafts of its constrained requests are the tokens their grammar forces."""

    def propose(self, request_ids, token_ids, max_drafts):
        return [[] for _ in request_ids]


def test_forced_tokens_are_drafted_and_accepted(target, tokenizer, target_logits):  # noqa: F811
    """Under the JSON schema the keys and punctuation are forced: with a drafter that never drafts, those
    tokens are drafted from the grammar and all accepted, and the output is the oracle's."""
    engine = Engine(SpeculativeDecoder(target, Nothing(), config=K3), tokenizer=tokenizer)
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["json"]), "r")
    outputs = run(engine, {})
    last = outputs["r"][-1]
    assert list(last.token_ids) == oracle(target_logits, tokenizer, PROMPTS[1], CONSTRAINTS["json"])
    assert last.num_draft_tokens >= 4 and last.num_accepted_tokens == last.num_draft_tokens     # '{"a":' at least


def _masked_distribution(target_logits, prompt, output, ok) -> np.ndarray:  # noqa: F811
    logits = np.where(ok, target_logits(prompt + output), -np.inf).astype(np.float64)
    p = np.exp(logits - logits.max())
    return p / p.sum()


@pytest.mark.parametrize("drafter", ["ngram", "model", "head-tree"])
@pytest.mark.slow
def test_sampled_tokens_follow_the_masked_target(target_logits, tokenizer, decoders, drafter, monkeypatch,
                                                 caplog):  # noqa: F811
    """Tokens 1 and 2 of 320 seeded requests under ``[ab12]{2}[yes]`` (4 tokens allowed at positions 1
    and 2) against the target's distribution restricted to them (token 2's after the most frequent token
    1), beside greedy constrained and plain sampled requests in the same batches; nothing compiles
    after ``warmup(structured_output=True)``. The draft model's automaton is ``[ab12]{2}[yes12]``: tokens
    1 and 2 are verified with its masks in one call, token 3's position is where they differ from the
    grammar's (caught by the host, the token dropped, the request's later steps split). The head's trees
    are verified with their automaton's masks (the grammar's own)."""
    if drafter == "model":
        build = scheduler_module.automaton_for
        monkeypatch.setattr(scheduler_module, "automaton_for", lambda params, builder, request_id: build(
            Structured(regex="[ab12]{2}[yes12]"), builder, request_id))
    engine = Engine(decoders[drafter], tokenizer=tokenizer)
    engine.warmup(4, SMALL.max_seq_len, structured_output=True)
    prompt = [7, 8, 7, 8, 7]                                   # the n-gram (8, 7) proposes [8, 7, 8]
    constraint = Structured(regex="[ab12]{2}[yes]")
    constrained = SamplingParams(max_tokens=3, temperature=1.0, structured_outputs=constraint)
    plain = SamplingParams(max_tokens=3, temperature=1.0)
    greedy = SamplingParams(max_tokens=3, structured_outputs=constraint)
    count = 320
    kinds = [greedy if i % 8 == 0 else plain if i % 8 == 1 else constrained for i in range(count)]
    arrivals = {0: [(prompt, SamplingParams(**{**vars(kind), "seed": i}), str(i)) for i, kind in enumerate(kinds)]}
    with CompileCounter() as compiles, caplog.at_level("INFO", logger=scheduler_module.__name__):
        outputs = run(engine, arrivals, max_steps=count)
    assert compiles.count == compiles.loads == 0 and engine.stats.compiled == []
    assert (drafter == "model") == ("masks differ from its grammar's after 2 tokens" in caplog.text)
    expected_greedy = oracle(target_logits, tokenizer, prompt, constraint)
    assert all(tokens(outputs, str(i)) == expected_greedy[:3] for i in range(0, count, 8))
    sampled = [tokens(outputs, str(i)) for i in range(count) if kinds[i] is constrained]
    assert all(re.fullmatch("[ab12]{2}[yes]", text(t)) for t in sampled)
    ok = np.isin(np.arange(TINY.vocab_size), [CHARS.index(c) for c in "ab12"])
    first_counts = np.bincount([t[0] for t in sampled], minlength=TINY.vocab_size)
    first = int(first_counts.argmax())
    second_counts = np.bincount([t[1] for t in sampled if t[0] == first], minlength=TINY.vocab_size)
    assert fits(first_counts, _masked_distribution(target_logits, prompt, [], ok), min_expected=5)
    assert fits(second_counts, _masked_distribution(target_logits, prompt, [first], ok), min_expected=5)
    plain_first = np.bincount([tokens(outputs, str(i))[0] for i in range(1, count, 8)], minlength=TINY.vocab_size)
    assert not np.isin(np.flatnonzero(plain_first), np.flatnonzero(ok)).all()   # the plain ones were not masked
    assert sum(outputs[str(i)][-1].num_accepted_tokens for i in range(count) if kinds[i] is constrained) > 0


@settings(max_examples=40, deadline=None)
@given(chain=st.lists(st.integers(0, TINY.vocab_size - 1), max_size=5), prefix=st.sampled_from(["", "{", '{"a":1']),
       positions=st.integers(1, 6))
def test_step_masks_are_llguidances_along_the_chain(chain, prefix, positions):
    """The masks at each position equal a fresh matcher's after the chain's tokens before it; the chain is
    cut at its first forbidden draft (or one completing the grammar); the matcher is left as it was."""
    grammars = Grammars(make_tokenizer().to_str(), TINY.vocab_size, ())
    matcher = grammars.matcher(CONSTRAINTS["json"])
    assert matcher.consume_tokens([CHARS.index(c) for c in prefix])
    (kept,), masks = grammars.step_masks([matcher], [path_trie(chain)], positions)
    cut = kept.tokens
    fresh = grammars.matcher(CONSTRAINTS["json"])
    fresh.consume_tokens([CHARS.index(c) for c in prefix])
    reference = llguidance.numpy.allocate_token_bitmask(1, 17)
    for j in range(len(cut) + 1):
        llguidance.numpy.fill_next_token_bitmask(fresh, reference, 0)
        assert [allowed(masks[0, j], t) for t in range(16)] == [allowed(reference[0], t) for t in range(16)], j
        if j < len(cut):
            assert allowed(reference[0], cut[j]) and fresh.consume_token(cut[j]) and not fresh.is_stopped()
    assert cut == chain[:len(cut)] and len(cut) <= positions - 1
    if len(cut) < min(len(chain), positions - 1):        # cut where the next draft is forbidden or completes it
        llguidance.numpy.fill_next_token_bitmask(fresh, reference, 0)
        nxt = chain[len(cut)]
        assert not allowed(reference[0], nxt) or (fresh.consume_token(nxt) and fresh.is_stopped())
    assert (masks[0, len(cut) + 1:] == -1).all()
    again = llguidance.numpy.allocate_token_bitmask(1, 17)
    llguidance.numpy.fill_next_token_bitmask(matcher, again, 0)
    first = llguidance.numpy.allocate_token_bitmask(1, 17)
    check = grammars.matcher(CONSTRAINTS["json"])
    check.consume_tokens([CHARS.index(c) for c in prefix])
    llguidance.numpy.fill_next_token_bitmask(check, first, 0)
    assert (again == first).all()


@st.composite
def tries(draw) -> Trie:
    """A random draft tree of up to 8 nodes over the vocabulary, parents before children."""
    tokens, parents = [], []
    for node in range(draw(st.integers(0, 8))):
        tokens.append(draw(st.integers(0, TINY.vocab_size - 1)))
        parents.append(draw(st.integers(-1, node - 1)))
    return Trie(tokens, parents)


@settings(max_examples=40, deadline=None)
@given(trie=tries(), prefix=st.sampled_from(["", "{", '{"a":1', '{"a":1,"b":["']), positions=st.integers(1, 9))
def test_tree_masks_follow_each_path(trie, prefix, positions):
    """A kept node's mask row is a fresh matcher's after its path; a node is kept exactly when its parent
    is (or it is a root child), the grammar allows its token after the parent's path and the token does
    not complete the grammar, while fewer than positions - 1 nodes are kept; the kept tree keeps the order."""
    grammars = Grammars(make_tokenizer().to_str(), TINY.vocab_size, ())
    ids = [CHARS.index(c) for c in prefix]
    matcher = grammars.matcher(CONSTRAINTS["json"])
    matcher.consume_tokens(ids)
    (kept,), masks = grammars.step_masks([matcher], [trie], positions)
    reference = llguidance.numpy.allocate_token_bitmask(1, 17)

    def mask_after(path: list[int]) -> list[bool] | None:
        """The allowed tokens after ``path``; None where the path is forbidden or completes the grammar."""
        fresh = grammars.matcher(CONSTRAINTS["json"])
        fresh.consume_tokens(ids)
        for token in path:
            llguidance.numpy.fill_next_token_bitmask(fresh, reference, 0)
            if not allowed(reference[0], token) or not fresh.consume_token(token) or fresh.is_stopped():
                return None
        llguidance.numpy.fill_next_token_bitmask(fresh, reference, 0)
        return [allowed(reference[0], t) for t in range(TINY.vocab_size)]

    assert [allowed(masks[0, 0], t) for t in range(16)] == mask_after([])
    index, paths, expected_tokens, expected_parents = {}, {}, [], []
    for node, (token, parent) in enumerate(zip(trie.tokens, trie.parents)):
        if len(expected_tokens) == positions - 1 or (parent >= 0 and parent not in index):
            continue
        path = (paths[parent] if parent >= 0 else []) + [token]
        row = mask_after(path)
        if row is None:
            continue
        index[node], paths[node] = len(expected_tokens), path
        expected_tokens.append(token)
        expected_parents.append(index[parent] if parent >= 0 else -1)
        assert [allowed(masks[0, len(expected_tokens)], t) for t in range(16)] == row
    assert kept == Trie(expected_tokens, expected_parents)
    assert (masks[0, len(kept.tokens) + 1:] == -1).all()


def test_bad_constraints_get_one_line(target, tokenizer, decoders):
    engine = Engine(decoders["ngram"], tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"^add_request: SamplingParams.structured_outputs: invalid json: "):
        engine.add_request([1], SamplingParams(structured_outputs=Structured(json={"type": "nothing"})))
    with pytest.raises(ValueError, match=r"^add_request: SamplingParams.structured_outputs: invalid regex: "):
        engine.add_request([1], SamplingParams(structured_outputs=Structured(regex="(a")))
    with pytest.raises(ValueError, match=r"needs Engine\(tokenizer=...\)"):
        Engine(decoders["ngram"]).add_request([1], SamplingParams(structured_outputs=Structured(regex="a")))
    with pytest.raises(ValueError, match=r"^SamplingParams.structured_outputs must be given exactly one of"):
        Structured(regex="a", choice=["a"])
    with pytest.raises(ValueError, match=r"^SamplingParams.structured_outputs must be given exactly one of"):
        Structured()
    with pytest.raises(TypeError, match=r"choice as a non-empty sequence of non-empty strings"):
        Structured(choice="ab")
    with pytest.raises(ValueError, match=r"json as a JSON schema"):
        Structured(json="{not json")
    with pytest.raises(TypeError, match=r"^SamplingParams.structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(TypeError, match=r"^Engine: tokenizer must be"):
        Engine(decoders["ngram"], tokenizer=object())
