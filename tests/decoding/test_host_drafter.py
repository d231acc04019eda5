"""``scv_jax.HostDrafter``: a user's own host-side drafter, passed as the drafter.

A recording drafter hears every request's lifecycle as specified (start once at admission, extend with
exactly each step's tokens, finish once for every reason), an oracle that proposes the target's own
continuation has every draft accepted, a garbage drafter changes nothing of the greedy output (chains and
trees: both verifiers) and keeps sampled tokens on the filtered target distribution; bad proposals get
one line naming the drafter's class."""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, HostDrafter, SamplingParams, SpeculativeDecoder, TreeConfig
from scv_jax.decoding.proposers.base import Trie
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_engine import FILTERS, first_two_tokens_follow_the_target, run, target_logits, tokens  # noqa: F401
from tests.models.fixtures import TINY

CHAIN = DecoderConfig(**{**vars(SMALL), "k": 3})
TREE = DecoderConfig(**{**vars(SMALL), "tree": TreeConfig(max_depth=3, branching=2, max_nodes=6)})
VERIFIERS = {"chain": CHAIN, "tree": TREE}


class Recording(HostDrafter):
    """Records every call; proposes the request's last token repeated."""

    def __init__(self):
        self.calls: list[tuple] = []

    def start(self, request_id, prompt_token_ids):
        self.calls.append(("start", request_id, list(prompt_token_ids)))

    def extend(self, request_id, new_token_ids):
        self.calls.append(("extend", request_id, list(new_token_ids)))

    def finish(self, request_id):
        self.calls.append(("finish", request_id))

    def propose(self, request_ids, token_ids, max_drafts):
        self.calls.append(("propose", list(request_ids), [t.tolist() for t in token_ids], max_drafts.tolist()))
        return [[int(t[-1])] * int(n) for t, n in zip(token_ids, max_drafts)]


class Oracle(HostDrafter):
    """Proposes the target's own greedy continuation of each request (``continuations``: prompt -> tokens)."""

    def __init__(self, continuations: dict[tuple, list[int]]):
        self.continuations = continuations

    def propose(self, request_ids, token_ids, max_drafts):
        out = []
        for text, n in zip(token_ids, max_drafts.tolist()):
            text = text.tolist()
            for prompt, generated in self.continuations.items():
                full = list(prompt) + generated
                if full[:len(text)] == text:
                    out.append(full[len(text):len(text) + n])
                    break
            else:
                out.append([])
        return out


class Garbage(HostDrafter):
    """Random drafts of random lengths (at most the cap)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def propose(self, request_ids, token_ids, max_drafts):
        return [self.rng.integers(0, TINY.vocab_size, self.rng.integers(0, n + 1)).tolist() for n in max_drafts]


@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_the_lifecycle_hooks_are_called_as_specified(target, verifier):
    drafter = Recording()
    engine = Engine(target, drafter, config=VERIFIERS[verifier], eos_token_id=None)
    batch = prompts(11, 3)
    arrivals = {0: [(batch[0], SamplingParams(max_tokens=MAX_NEW), "a"),
                    (batch[1], SamplingParams(max_tokens=MAX_NEW), "b")],
                2: [(batch[2], SamplingParams(max_tokens=MAX_NEW), "c")],
                3: [(batch[1], SamplingParams(max_tokens=MAX_NEW), "d")]}
    engine.add_request(batch[0], SamplingParams(max_tokens=4), "never-runs")     # aborted while waiting
    engine.abort("never-runs")
    outputs = run(engine, arrivals, max_steps=60)
    assert "never-runs" not in {c[1] for c in drafter.calls if c[0] != "propose"}
    for request_id, prompt in (("a", batch[0]), ("b", batch[1]), ("c", batch[2])):
        mine = [c for c in drafter.calls if c[0] != "propose" and c[1] == request_id]
        assert mine[0] == ("start", request_id, prompt) and mine[-1] == ("finish", request_id)
        assert [c[0] for c in mine[1:-1]] == ["extend"] * (len(mine) - 2)
        assert [t for c in mine[1:-1] for t in c[2]] == tokens(outputs, request_id)
        assert [o.new_token_ids for o in outputs[request_id] if o.new_token_ids] == [tuple(c[2]) for c in mine[1:-1]]
        seen = [c for c in drafter.calls if c[0] == "propose" and request_id in c[1]]
        for call in seen:                      # its text so far, after its start and before its finish
            i = call[1].index(request_id)
            assert call[2][i][:len(prompt)] == prompt and call[3][i] <= MAX_NEW - 1
            assert drafter.calls.index(mine[0]) < drafter.calls.index(call) < drafter.calls.index(mine[-1])


def test_finish_is_called_for_an_abort_and_a_stop(target, autoregressive):
    drafter = Recording()
    engine = Engine(target, drafter, config=CHAIN)
    prompt = prompts(12, 1)[0]
    free = autoregressive.generate([prompt], MAX_NEW).tokens[0]
    engine.add_request(prompt, SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[free[3]]), "stops")
    # (another prompt: a request sharing a prompt being prefilled would wait for its blocks to be cached)
    engine.add_request(prompts(13, 1)[0], SamplingParams(max_tokens=MAX_NEW), "aborted")
    first = engine.step()                     # both start; "stops" may end in this step already
    engine.abort("aborted")
    outputs = run(engine, max_steps=40)
    for out in reversed(first):
        outputs.setdefault(out.request_id, []).insert(0, out)
    assert outputs["aborted"][-1].finish_reason == "abort"
    assert tokens(outputs, "stops") == free[:free.index(free[3]) + 1]
    assert sorted(c for c in drafter.calls if c[0] == "finish") == [("finish", "aborted"), ("finish", "stops")]
    assert [c[0] for c in drafter.calls if c[0] != "propose"][:2] == ["start", "start"]


@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_an_oracle_has_every_draft_accepted(target, autoregressive, verifier):
    batch = prompts(13, 3)
    free = autoregressive.generate(batch, MAX_NEW).tokens
    decoder = SpeculativeDecoder(target, Oracle({tuple(p): f for p, f in zip(batch, free)}), config=VERIFIERS[verifier])
    engine = Engine(decoder)
    outputs = run(engine, {0: [(p, SamplingParams(max_tokens=MAX_NEW), str(i)) for i, p in enumerate(batch)]})
    for i in range(len(batch)):
        last = outputs[str(i)][-1]
        assert tokens(outputs, str(i)) == free[i]
        assert last.num_draft_tokens > 0 and last.num_accepted_tokens == last.num_draft_tokens
    assert decoder.generate(batch, MAX_NEW).stats.acceptance_rate == 1.0


@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_garbage_drafts_leave_the_greedy_output_unchanged(target, autoregressive, verifier):
    batch = prompts(14, 4)
    out = SpeculativeDecoder(target, Garbage(), config=VERIFIERS[verifier]).generate(batch, MAX_NEW)
    assert out.tokens == autoregressive.generate(batch, MAX_NEW).tokens
    assert out.stats.acceptance_rate < 0.5


class Bad(HostDrafter):
    def __init__(self, answer):
        self.answer = answer

    def propose(self, request_ids, token_ids, max_drafts):
        return self.answer(max_drafts)


@pytest.mark.parametrize("answer, match", [
    (lambda m: [[1] * (int(n) + 1) for n in m], r"Bad.propose: request 0 offered 4 drafts, more than its max_drafts 3"),
    (lambda m: [[TINY.vocab_size] for _ in m], r"Bad.propose: request 0 offered a token id outside \[0, vocab_size=16\)"),
    (lambda m: [[-1] for _ in m], r"Bad.propose: request 0 offered a token id outside"),
    (lambda m: [], r"Bad.propose must return a list of one draft chain per request \(1\)"),
    (lambda m: [[0.5] for _ in m], r"Bad.propose: request 0's drafts must be a 1-D sequence of token ids"),
])
@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_bad_proposals_get_one_line_naming_the_drafter(target, answer, match, verifier):
    decoder = SpeculativeDecoder(target, Bad(answer), config=VERIFIERS[verifier])   # trees: its chains, checked
    with pytest.raises(ValueError, match=match) as error:
        decoder.generate([[1, 2, 3]], 6)
    assert "\n" not in str(error.value)


class BadTree(HostDrafter):
    def __init__(self, tree):
        self.tree = tree

    def propose_tree(self, request_ids, token_ids, max_nodes, max_depth):
        return [self.tree for _ in request_ids]


@pytest.mark.parametrize("tree", [Trie([1, 2], [-1, 1]), Trie([1] * 7, [-1] * 7), Trie([1, 2, 3, 4], [-1, 0, 1, 2]),
                                  Trie([TINY.vocab_size], [-1])],
                         ids=["parent-after-child", "too-many-nodes", "too-deep", "bad-id"])
def test_bad_trees_get_one_line_naming_the_drafter(target, tree):
    decoder = SpeculativeDecoder(target, BadTree(tree), config=TREE)
    with pytest.raises(ValueError, match=r"^BadTree.propose_tree: request 0's tree must have at most 6 nodes, "
                                         r"depth <= \d, parents in \[-1, node\) and ids in \[0, vocab_size=16\)$"):
        decoder.generate([[1, 2, 3]], 6)


@pytest.mark.parametrize("name", ["T1.5", "all"])
def test_sampled_tokens_with_garbage_drafts_follow_the_filtered_target(target, target_logits, autoregressive,  # noqa: F811
                                                                        name):
    """As ``test_engine.test_sampled_tokens_follow_the_filtered_target``, with random host drafts."""
    engine = Engine(SpeculativeDecoder(target, Garbage(1), config=DecoderConfig(**{**vars(SMALL), "k": 2})))
    prompt, count = [3, 1, 4, 3, 1], 400
    params = SamplingParams(max_tokens=2, **FILTERS[name])
    outputs = run(engine, {0: [(prompt, SamplingParams(**{**vars(params), "seed": i}), str(i)) for i in range(count)]},
                  max_steps=count)
    sampled = [tokens(outputs, str(i)) for i in range(count)]

    first_two_tokens_follow_the_target(sampled, prompt, params, target_logits)
    assert sum(outputs[str(i)][-1].num_accepted_tokens for i in range(count)) > 0
