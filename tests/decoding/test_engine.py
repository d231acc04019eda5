"""``Engine``: requests that arrive and leave at any step, each with its own ``SamplingParams``.

Greedy requests equal autoregressive decoding whatever they share the batch with and whenever they
arrive; sampled ones follow their filtered target distribution (chi-square, with a draft model and
with n-gram drafts, in batches with greedy rows) and repeat with their seed (stop ids and eos:
test_stops.py); aborts free blocks; nothing compiles after warm-up while
the mix changes; bad input gets one line naming it; threads never get wrong tokens."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams, SpeculativeDecoder
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.ops.sampling.api import filtered_probs
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.models.fixtures import TINY, TINY_DRAFT, tiny_model

K3 = DecoderConfig(**{**vars(SMALL), "k": 3})
MAX_STEPS = 400          # every loop over an engine is bounded


def run(engine: Engine, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = MAX_STEPS
        ) -> dict[str, list]:
    """Steps ``engine`` until it is done (``arrivals``: {step: [(prompt, params, id), ...]} added before
    that step); returns each request's outputs in order."""
    arrivals, outputs = dict(arrivals or {}), {}
    for step in range(max_steps):
        for prompt, params, request_id in arrivals.pop(step, []):
            engine.add_request(prompt, params, request_id)
        if not engine.has_unfinished() and not arrivals:
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"the engine did not finish in {max_steps} steps")


def tokens(outputs: dict[str, list], request_id: str) -> list[int]:
    """A request's generated tokens, checked to be the concatenation of its new tokens."""
    outs = outputs[request_id]
    assert outs[-1].finished and [t for o in outs for t in o.new_token_ids] == list(outs[-1].token_ids)
    return list(outs[-1].token_ids)


@pytest.fixture(scope="module")
def with_draft(target, partial_draft):
    return SpeculativeDecoder(target, partial_draft, config=K3)


@pytest.fixture(scope="module")
def with_ngram(target):
    return SpeculativeDecoder(target, NgramDrafter(1, 3), config=K3)


@pytest.fixture(scope="module")
def target_logits(target):
    """``logits(sequence)``: float32[V] the target's logits after ``sequence`` (a full causal forward, no
    cache; padded to SMALL.max_seq_len tokens so that one executable serves every length)."""
    graphdef, state = nnx.split(target)
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, state)(tokens))

    def logits(sequence: list[int]) -> np.ndarray:
        tokens = np.zeros((1, SMALL.max_seq_len), np.int32)
        tokens[0, :len(sequence)] = sequence
        return np.asarray(forward(tokens))[0, len(sequence) - 1]

    return logits


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.slow
def test_requests_added_mid_flight_decode_as_alone(with_draft, with_ngram, autoregressive, drafter):
    """Requests join a running batch at different steps with different budgets and sampling; each greedy
    one equals its autoregressive output, each ends at its own max_tokens, and every block comes back."""
    engine = Engine(with_draft if drafter == "model" else with_ngram)
    batch = prompts(31, 6, alphabet=4 if drafter == "ngram" else TINY.vocab_size)
    sampled = SamplingParams(temperature=1.0, top_p=0.8, seed=5, max_tokens=9)
    arrivals = {0: [(batch[0], SamplingParams(max_tokens=MAX_NEW), "a"), (batch[1], sampled, "b")],
                2: [(batch[2], SamplingParams(max_tokens=5), "c")],
                3: [(batch[3], SamplingParams(max_tokens=MAX_NEW), "d"), (batch[4], sampled, "e"),
                    (batch[5], SamplingParams(max_tokens=11), "f")]}                 # 6 > 4 rows: f waits
    outputs = run(engine, arrivals)
    for request_id, prompt, budget in (("a", batch[0], MAX_NEW), ("c", batch[2], 5), ("d", batch[3], MAX_NEW),
                                       ("f", batch[5], 11)):
        assert tokens(outputs, request_id) == autoregressive.generate([prompt], budget).tokens[0], request_id
        assert outputs[request_id][-1].finish_reason == "length"
    assert len(tokens(outputs, "b")) == len(tokens(outputs, "e")) == 9
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()
    assert sum(o[-1].num_draft_tokens for o in outputs.values()) > 0


def test_a_seeded_request_does_not_depend_on_its_company_or_arrival(with_draft):
    """The same seed gives the same tokens alone, in a full batch, and arriving while others run."""
    params = SamplingParams(temperature=1.5, top_k=10, seed=11, max_tokens=MAX_NEW)
    prompt, others = prompts(41, 1)[0], prompts(42, 3)
    noisy = SamplingParams(temperature=1.3, min_p=0.05, max_tokens=7)
    alone = tokens(run(Engine(with_draft), {0: [(prompt, params, "x")]}), "x")
    together = run(Engine(with_draft), {0: [(prompt, params, "x")] + [(p, noisy, f"o{i}") for i, p in enumerate(others)]})
    late = run(Engine(with_draft), {0: [(p, noisy, f"o{i}") for i, p in enumerate(others)], 3: [(prompt, params, "x")]})
    assert tokens(together, "x") == alone == tokens(late, "x")
    other_seed = SamplingParams(temperature=1.5, top_k=10, seed=12, max_tokens=MAX_NEW)
    assert tokens(run(Engine(with_draft), {0: [(prompt, other_seed, "x")]}), "x") != alone


def test_abort_frees_blocks_at_once(with_draft):
    engine = Engine(with_draft, max_num_seqs=2)
    for i, p in enumerate(prompts(71, 3)):
        engine.add_request(p, SamplingParams(max_tokens=MAX_NEW, temperature=float(i % 2)), f"r{i}")
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1 and engine.num_free_blocks < engine.num_blocks
    engine.abort("r0")                     # running
    engine.abort("r2")                     # waiting
    engine.abort("nobody")                 # unknown: ignored
    assert engine.num_running == 1 and engine.num_waiting == 0
    outputs = run(engine)
    assert [o.finish_reason for o in outputs["r0"]] == ["abort"] and outputs["r2"][0].finish_reason == "abort"
    assert outputs["r1"][-1].finish_reason == "length" and engine.num_free_blocks == engine.num_blocks
    engine.abort("r1")                     # finished: ignored
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_no_compile_after_warmup_while_requests_join_leave_and_change_the_mix(target):
    engine = Engine(target, NgramDrafter(1, 3), config=DecoderConfig(**{**vars(SMALL), "k": 2}))
    engine.warmup(4, SMALL.max_seq_len, temperatures=(0.0, 1.0), logprobs=True)
    batch = prompts(81, 7)
    kinds = [SamplingParams(max_tokens=6), SamplingParams(temperature=0.7, top_p=0.9, max_tokens=9, seed=1),
             SamplingParams(temperature=1.0, top_k=3, min_p=0.1, max_tokens=4, seed=2),
             SamplingParams(max_tokens=8, logprobs=2)]
    arrivals: dict[int, list] = {}
    for i, step in enumerate((0, 0, 1, 4, 5, 9, 10)):
        arrivals.setdefault(step, []).append((batch[i], kinds[i % 4], str(i)))
    with CompileCounter() as compiles:
        outputs = run(engine, arrivals)
    assert compiles.count == compiles.loads == 0 and engine.stats.compiled == []
    assert len(outputs) == 7 and engine.num_free_blocks == engine.num_blocks


@pytest.mark.slow
def test_logprobs_are_the_targets_unfiltered_ones(with_draft, target_logits):
    prompt = prompts(91, 1)[0]
    params = SamplingParams(temperature=0.9, top_k=4, seed=3, max_tokens=6, logprobs=3)
    outputs = run(Engine(with_draft), {0: [(prompt, params, "s"), (prompt, SamplingParams(max_tokens=6, logprobs=0),
                                                                   "g")]})
    for request_id in ("s", "g"):
        sequence = list(prompt)
        for out in outputs[request_id]:
            assert len(out.logprobs) == len(out.new_token_ids)
            for token, entry in zip(out.new_token_ids, out.logprobs):
                reference = jax.nn.log_softmax(target_logits(sequence))
                assert entry.token_id == token and entry.logprob == pytest.approx(float(reference[token]), abs=1e-4)
                top = np.argsort(-np.asarray(reference), kind="stable")[:len(entry.top)]
                assert [t for t, _ in entry.top] == top.tolist()
                assert len(entry.top) == (3 if request_id == "s" else 0)
                sequence.append(token)


def _chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> None:
    """Asserts ``counts`` fit ``probs`` (chi-square at ~5 sigma, small bins pooled; zero-probability
    tokens never drawn)."""
    n = counts.sum()
    assert n > 0 and counts[probs == 0].sum() == 0, (counts, probs)
    expected = probs * n
    keep = expected >= 5
    chi2 = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep]) + (
        (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum(), 1e-9))
    dof = max(int(keep.sum()), 1)
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof, counts, expected)


def first_two_tokens_follow_the_target(sampled: list[list[int]], prompt: list[int], params: SamplingParams,
                                        target_logits) -> None:
    """Asserts that tokens 1 and 2 of ``sampled`` sequences fit the filtered target distribution (``params``'
    filters): token 1's after ``prompt``, and token 2's after the most frequent token 1 (chi-square)."""
    def probs(sequence: list[int]) -> np.ndarray:
        p = filtered_probs(target_logits(sequence)[None], np.float32([params.temperature]),
                           np.int32([params.top_k]), np.float32([params.top_p]), np.float32([params.min_p]))
        return np.asarray(p)[0]

    vocab = TINY.vocab_size
    _chi_square_ok(np.bincount([t[0] for t in sampled], minlength=vocab), probs(prompt))
    first = np.bincount([t[0] for t in sampled], minlength=vocab).argmax()
    _chi_square_ok(np.bincount([t[1] for t in sampled if t[0] == first], minlength=vocab),
                   probs(prompt + [int(first)]))


FILTERS = {"T0.5": dict(temperature=0.5), "T1.5": dict(temperature=1.5), "top_k": dict(temperature=1.0, top_k=3),
           "top_p": dict(temperature=1.0, top_p=0.6), "min_p": dict(temperature=1.0, min_p=0.3),
           "all": dict(temperature=1.2, top_k=5, top_p=0.8, min_p=0.1)}


@pytest.fixture(scope="module")
def sampling_decoders(target):
    """A poor draft model (most drafts rejected) and prompt lookup (q one-hot), 2 drafts a step."""
    config = DecoderConfig(**{**vars(SMALL), "k": 2})
    return {"model": SpeculativeDecoder(target, tiny_model(TINY_DRAFT, seed=9, scale=1.0), config=config),
            "ngram": SpeculativeDecoder(target, NgramDrafter(1, 2), config=config)}


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("name", list(FILTERS))
@pytest.mark.slow
def test_sampled_tokens_follow_the_filtered_target(target_logits, autoregressive, sampling_decoders, drafter, name):
    """Tokens 1 and 2 of many seeded requests (one in four greedy, in the same batches) against the
    filtered target distribution: token 1's, and token 2's after the most frequent token 1."""
    engine = Engine(sampling_decoders[drafter])
    prompt = [3, 1, 4, 3, 1]                                   # the n-gram (3, 1) proposes [4, 3]
    params = SamplingParams(max_tokens=3, **FILTERS[name])
    count = 400
    arrivals = {0: [(prompt, SamplingParams(max_tokens=3) if i % 4 == 0 else
                     SamplingParams(**{**vars(params), "seed": i}), str(i)) for i in range(count)]}
    outputs = run(engine, arrivals, max_steps=2 * count)       # 4 rows, 3 tokens each (+1 step in flight)
    greedy = autoregressive.generate([prompt], 3).tokens[0]
    sampled = [tokens(outputs, str(i)) for i in range(count) if i % 4]
    assert all(tokens(outputs, str(i)) == greedy for i in range(0, count, 4))
    first_two_tokens_follow_the_target(sampled, prompt, params, target_logits)
    drafted = sum(outputs[str(i)][-1].num_draft_tokens for i in range(count))
    accepted = sum(outputs[str(i)][-1].num_accepted_tokens for i in range(count))
    assert drafted > 0 and accepted < drafted


@pytest.mark.parametrize("call, match", [
    (lambda e: e.add_request("abc"), "add_request: prompt_token_ids is str, not token ids"),
    (lambda e: e.add_request([]), "prompt_token_ids must be a non-empty 1-D sequence"),
    (lambda e: e.add_request([1, TINY.vocab_size]), "token id 16 at index 1, outside \\[0, vocab_size=16\\)"),
    (lambda e: e.add_request([1], {"temperature": 1.0}), "params must be a SamplingParams or None, got dict"),
    (lambda e: e.add_request([1], request_id=""), "request_id must be a non-empty str or None"),
    (lambda e: (e.add_request([1], request_id="x"), e.add_request([1], request_id="x")),
     "request_id 'x' is already waiting or running"),
    (lambda e: e.add_request([1] * 60, SamplingParams(max_tokens=6)), "needs up to 65 cache positions .* DecoderConfig.max_seq_len is 64"),
    (lambda e: e.add_request([1], SamplingParams(stop_token_ids=[16])), "stop_token_ids must hold ids in \\[0, vocab_size=16\\)"),
    (lambda e: e.add_request([1], SamplingParams(stop_token_ids=list(range(17)))), "at most 16 with the model's eos ids"),
])
def test_bad_requests_get_one_line_naming_the_argument(autoregressive, call, match):
    engine = Engine(autoregressive)
    with pytest.raises((ValueError, TypeError), match=match) as error:
        call(engine)
    assert "\n" not in str(error.value)


def test_a_request_larger_than_the_cache_is_refused(target):
    engine = Engine(target, None, config=DecoderConfig(**{**vars(SMALL), "num_blocks": 4}))
    with pytest.raises(ValueError, match="needs 5 KV blocks but the cache holds 4"):
        engine.add_request([1] * 30, SamplingParams(max_tokens=10))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kwargs, match", [(dict(eos_token_id=16), "Engine: eos_token_id must be"),
                                           (dict(max_num_seqs=0), "Engine: max_num_seqs must be an int >= 1"),
                                           (dict(seed=-1), "Engine: seed must be an int >= 0"),
                                           (dict(config=SMALL), "leave draft, config, mesh and sharding out")])
def test_bad_engine_arguments(autoregressive, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(autoregressive, **kwargs)


def test_threads_sharing_a_decoder_get_their_own_tokens(with_draft):
    """Regression: two threads in ``generate`` on one decoder used to get wrong tokens (36 of 40 calls);
    steps now take the decoder's lock, so every call's output is its single-threaded one."""
    batches = [prompts(100 + i, 2) for i in range(6)]
    expected = [with_draft.generate(b, 8, temperature=float(i % 2), seed=i).tokens for i, b in enumerate(batches)]
    results: dict[int, list] = {}

    def work(i: int) -> None:
        results[i] = with_draft.generate(batches[i], 8, temperature=float(i % 2), seed=i).tokens

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [results.get(i) for i in range(6)] == expected
