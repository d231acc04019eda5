"""Logit controls in the decoder (penalties, logit_bias, allowed_token_ids, bad words, min_tokens):
autoregressive greedy decoding with controls equals a numpy oracle of vLLM's meaning; speculative greedy
decoding (draft model, n-gram drafts, trees, packed verify steps) equals it token for token in batches
mixing controls, bad words of several tokens included;
sampled tokens 1 and 2 follow the controlled target distribution (chi-square) in batches mixing greedy,
plain sampled and controlled requests, nothing compiling after warm-up; ids outside the vocabulary get
one line naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams, SpeculativeDecoder
from scv_jax.graph.compile_counter import CompileCounter
from tests.decoding.common import SMALL, prompts, ran_packed_steps
from tests.decoding.test_engine import run, target_logits, tokens  # noqa: F401 (a fixture)
from tests.decoding.test_tree_decoding import TREE_CONFIG
from tests.models.fixtures import TINY
from tests.ops.sampling.oracle import filtered_row, fits
from tests.ops.sampling.test_controls import controlled_row

K2 = DecoderConfig(**{**vars(SMALL), "k": 2})
PACKED = DecoderConfig(**{**vars(SMALL), "k": 3, "packed_verify": True})   # ragged n-gram drafts: packed steps
EOS = 5
# strong enough to move the tiny target's distributions far
CONTROLS = {"presence": dict(presence_penalty=2.0), "frequency": dict(frequency_penalty=1.5),
            "repetition": dict(repetition_penalty=2.0), "logit_bias": dict(logit_bias={6: 4.0, 2: 3.0, 5: -5.0})}
MASKS = {"allowed": dict(allowed_token_ids=[1, 4, 6, 9]), "bad_words": dict(bad_words_token_ids=[[5], [0], [8]]),
         "min_tokens": dict(min_tokens=6), "all": dict(presence_penalty=0.7, frequency_penalty=0.4,
                                                        repetition_penalty=1.4, logit_bias={3: 2.0}, min_tokens=2)}


@pytest.fixture(scope="module")
def decoders(target, partial_draft):
    return {"model": SpeculativeDecoder(target, partial_draft, config=K2),
            "ngram": SpeculativeDecoder(target, NgramDrafter(1, 2), config=K2),
            "tree": SpeculativeDecoder(target, NgramDrafter(1, 2), config=TREE_CONFIG),
            "tree-model": SpeculativeDecoder(target, partial_draft, config=TREE_CONFIG),
            "packed": SpeculativeDecoder(target, NgramDrafter(1, 3), config=PACKED)}


def oracle_greedy(target_logits, prompt: list[int], params: SamplingParams, stops=()) -> list[int]:  # noqa: F811
    """vLLM's greedy decoding with ``params``' controls, one full forward per token (float64 controls)."""
    out: list[int] = []
    while len(out) < params.max_tokens:
        token = int(np.argmax(controlled_row(target_logits(prompt + out), prompt, out, params, stops)))
        out.append(token)
        if token in stops:
            break
    return out


def test_autoregressive_greedy_with_controls_is_the_oracles(target_logits, autoregressive):  # noqa: F811
    """Four prompts, each control alone; min_tokens with the first plain token as eos (plain decoding
    would stop at once). Each control changes some prompt's output: the oracle check has teeth."""
    changed = set()
    for prompt in prompts(5, 4):
        plain = autoregressive.generate([prompt], 8).tokens[0]
        for name, control in {**CONTROLS, **MASKS}.items():
            params = SamplingParams(max_tokens=8, **control)
            stops = (plain[0],) if params.min_tokens else ()
            got = autoregressive.generate([prompt], sampling=params, eos_token_id=stops or None).tokens[0]
            assert got == oracle_greedy(target_logits, prompt, params, stops), name
            if got != (plain[:1] if stops else plain):
                changed.add(name)
    assert changed == {*CONTROLS, *MASKS}


def _phrases(plain: list[int]) -> list[list[int]]:
    """Bad words of 2 and 3 tokens that greedy decoding without them emits (output tokens 2-3, 5-7)."""
    return [plain[2:4], plain[5:8]]


def test_bad_words_of_several_tokens_are_the_oracles(target_logits, autoregressive):  # noqa: F811
    """vLLM's rule (a word's last token masked where the output ends with its other tokens; the prompt
    does not count), on words plain greedy decoding emits: the output changes, and never holds them."""
    for prompt in prompts(5, 4):
        plain = autoregressive.generate([prompt], 10).tokens[0]
        words = _phrases(plain) + [prompt[-1:] + plain[:1]]          # the prompt's last token: no match
        params = SamplingParams(max_tokens=10, bad_words_token_ids=words)
        got = autoregressive.generate([prompt], sampling=params).tokens[0]
        assert got == oracle_greedy(target_logits, prompt, params) and got != plain
        assert not any(got[i:i + len(w)] == w for w in words[:2] for i in range(len(got)))


@pytest.mark.parametrize("drafter", ["model", "ngram", "tree", "tree-model", "packed"])
@pytest.mark.slow
def test_greedy_with_controls_equals_autoregressive(decoders, autoregressive, drafter):
    """Each control beside plain requests in one batch (prompts from a small alphabet: n-grams match)."""
    decoder = decoders[drafter]
    batch = prompts(61, 4, alphabet=4)
    for group in (CONTROLS, MASKS):
        params = [SamplingParams(max_tokens=12, **control) for control in group.values()]
        params.append(SamplingParams(max_tokens=9))
        for shift in (0, 2):            # each control at two rows, beside others
            rows = params[shift:] + params[:shift]
            out = decoder.generate(batch + batch[:1], sampling=rows, eos_token_id=EOS)
            assert out.tokens == autoregressive.generate(batch + batch[:1], sampling=rows, eos_token_id=EOS).tokens
            assert out.stats.acceptance_rate > 0
    assert decoder.pool.num_free == SMALL.num_blocks
    assert drafter != "packed" or ran_packed_steps(decoder)


@pytest.mark.parametrize("drafter", ["model", "ngram", "tree", "tree-model", "packed"])
def test_bad_words_of_several_tokens_under_speculation_equal_autoregressive(decoders, autoregressive, drafter):
    """Words of 2 and 3 tokens that plain decoding emits, and every token twice in a row (the drafts
    propose them), banned beside plain and penalised requests: a draft position's history holds the
    drafts before it (trees: the node's path)."""
    batch = prompts(61, 4, alphabet=4)
    plain = autoregressive.generate(batch, 12).tokens
    params = [SamplingParams(max_tokens=12, bad_words_token_ids=_phrases(plain[0])), SamplingParams(max_tokens=12),
              SamplingParams(max_tokens=12, bad_words_token_ids=[[t, t] for t in range(TINY.vocab_size)],
                             repetition_penalty=1.3),                     # no token twice in a row
              SamplingParams(max_tokens=12, bad_words_token_ids=_phrases(plain[3]), presence_penalty=0.5)]
    want = autoregressive.generate(batch, sampling=params).tokens
    out = decoders[drafter].generate(batch, sampling=params)
    assert out.tokens == want and want[0] != plain[0] and out.stats.acceptance_rate > 0
    assert drafter != "packed" or ran_packed_steps(decoders[drafter])


def _distribution(target_logits, prompt, output, params: SamplingParams) -> np.ndarray:  # noqa: F811
    logits = controlled_row(target_logits(prompt + output), prompt, output, params)
    return filtered_row(logits, params.temperature, params.top_k, params.top_p, params.min_p)[0]


# where each control moves the tiny target's distribution of [11, 11, 5, 11, 11]'s tokens 1 and 2 (0, 1)
# far from the plain one (total variation 0.36 to 0.73): a step that ignored the control there, or left
# token 1 out of token 2's history, fails the chi-square
MOVED = {"presence": (1,), "frequency": (1,), "repetition": (0, 1), "logit_bias": (0,)}


@pytest.mark.parametrize("drafter", ["model", "ngram", "tree"])
@pytest.mark.parametrize("name", list(CONTROLS))
@pytest.mark.slow
def test_sampled_tokens_follow_the_controlled_target(target_logits, autoregressive, decoders, drafter,  # noqa: F811
                                                     name):
    """Tokens 1 and 2 of seeded controlled requests against the controlled target distribution (token 2's
    after the most frequent token 1, with it in the history), with one in eight requests greedy (with
    the same controls: equal to autoregressive decoding) and one in eight plain sampled, in the same
    batches; where the control moves the distribution (``MOVED``) the sample does not fit the plain one.
    Presence and frequency leave token 1 as it is (its history is empty) and move token 2 only through
    token 1 in its history."""
    engine = Engine(decoders[drafter])
    engine.warmup(4, SMALL.max_seq_len)
    prompt = [11, 11, 5, 11, 11]                               # the n-gram (11, 11) proposes [5, 11]
    controlled = SamplingParams(max_tokens=3, temperature=1.0, **CONTROLS[name])
    plain = SamplingParams(max_tokens=3, temperature=1.0)
    greedy = SamplingParams(max_tokens=3, **CONTROLS[name])
    count = 400
    kinds = [greedy if i % 8 == 0 else plain if i % 8 == 1 else controlled for i in range(count)]
    arrivals = {0: [(prompt, SamplingParams(**{**vars(kind), "seed": i}), str(i)) for i, kind in enumerate(kinds)]}
    with CompileCounter() as compiles:
        outputs = run(engine, arrivals, max_steps=count)
    assert compiles.count == compiles.loads == 0 and engine.stats.compiled == []
    assert all(tokens(outputs, str(i)) == autoregressive.generate([prompt], sampling=greedy).tokens[0]
               for i in range(0, count, 8))
    sampled = [tokens(outputs, str(i)) for i in range(count) if kinds[i] is controlled]
    vocab = TINY.vocab_size
    first_counts = np.bincount([t[0] for t in sampled], minlength=vocab)
    first = int(first_counts.argmax())
    second_counts = np.bincount([t[1] for t in sampled if t[0] == first], minlength=vocab)
    right = [_distribution(target_logits, prompt, [], controlled),
             _distribution(target_logits, prompt, [first], controlled)]
    unpenalised = [_distribution(target_logits, prompt, [], plain),
                   _distribution(target_logits, prompt, [first], plain)]
    for position, counts in enumerate((first_counts, second_counts)):
        assert fits(counts, right[position], min_expected=5), position
        if position in MOVED[name]:
            assert 0.5 * np.abs(right[position] - unpenalised[position]).sum() > 0.3, position
            assert not fits(counts, unpenalised[position], min_expected=5), position
    plain_first = np.bincount([tokens(outputs, str(i))[0] for i in range(1, count, 8)], minlength=vocab)
    assert fits(plain_first, unpenalised[0], min_expected=5)
    drafted = sum(outputs[str(i)][-1].num_draft_tokens for i in range(count))
    assert drafted > 0


@pytest.mark.parametrize("field, params", [
    ("logit_bias", SamplingParams(logit_bias={TINY.vocab_size: 1.0})),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=[0, TINY.vocab_size + 3])),
    ("bad_words_token_ids", SamplingParams(bad_words_token_ids=[[TINY.vocab_size]]))])
def test_ids_outside_the_vocabulary_get_one_line_naming_the_field(decoders, field, params):
    engine = Engine(decoders["ngram"])
    with pytest.raises(ValueError, match=rf"^add_request: SamplingParams\.{field} must hold token ids in \[0, "
                                         rf"vocab_size=16\), got 1[69]$"):
        engine.add_request([1, 2], params)
