"""Stop ids, eos and what comes after a stop token, written once for every drafter: no drafter, a draft
model's chain, n-gram chains, a draft model's tree and n-gram tries.

For each, on a fresh decoder whose draft (for the draft models) is the target itself, so every draft is
accepted and a stop token is drafted with more drafts after it:
  1. the tokens after a stop never reach the cache: no position after the stop token's is written;
  2. ``Engine``: the model's eos ids end a request, ``ignore_eos`` runs to max_tokens, ``stop_token_ids``
     end it too; the tokens are autoregressive decoding's, cut after the stop ("stop" / "length");
  3. ``generate``: without eos the tokens are autoregressive decoding's (drafts accepted); with several
     eos ids each request stops at the first of them (requests finishing at different steps), the
     ``on_tokens`` stream adds up to the output, and every KV block comes back;
  4. ``num_draft_tokens`` counts only the drafts the step verified (not those after a stop token).
Replaces the near-copies that were in test_engine.py (test_stop_ids_eos_and_ignore_eos,
test_tokens_after_a_stop_never_reach_the_cache), test_decoder.py (test_eos_and_different_finish_steps,
test_eos_may_be_several_ids_and_tokens_stream) and test_tree_decoding.py (test_generate_with_trees_and_eos).
"""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams, SpeculativeDecoder, TreeConfig, \
    generate_autoregressive
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.models.fixtures import TINY, tiny_model

CHAIN = DecoderConfig(**{**vars(SMALL), "k": 3})
TREE = DecoderConfig(**{**vars(SMALL), "tree": TreeConfig(max_depth=3, branching=2, max_nodes=6)})
# drafter kind -> (draft: "model" (the target's copy), "ngram" or None, config)
DRAFTERS = {"none": (None, SMALL), "model-chain": ("model", CHAIN), "ngram-chain": ("ngram", CHAIN),
            "model-tree": ("model", TREE), "ngram-trie": ("ngram", TREE)}
MAX_STEPS = 400


def run(engine: Engine, requests: list[tuple]) -> dict[str, list]:
    """Adds ``requests`` ((prompt, params, id), ...) and steps ``engine`` until it is done; returns each
    request's outputs in order."""
    for prompt, params, request_id in requests:
        engine.add_request(prompt, params, request_id)
    outputs: dict[str, list] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"the engine did not finish in {MAX_STEPS} steps")


def tokens(outputs: dict[str, list], request_id: str) -> list[int]:
    """A request's generated tokens, checked to be the concatenation of its new tokens."""
    outs = outputs[request_id]
    assert outs[-1].finished and [t for o in outs for t in o.new_token_ids] == list(outs[-1].token_ids)
    return list(outs[-1].token_ids)


def cut_at(free: list[int], stops) -> list[int]:
    """``free`` up to and including its first token in ``stops``."""
    return free[:min([free.index(s) + 1 for s in stops if s in free] or [len(free)])]


def written_positions(decoder: SpeculativeDecoder) -> list[np.ndarray]:
    """bool[layers, positions] per cache (target, then the draft's if any): whether a position's K is
    written (nonzero), read through the decoder's runner (its caches between steps)."""
    caches = decoder.runner.caches.take()
    try:
        out = []
        for cache in caches:
            if cache is None:
                continue
            keys = np.asarray(cache.k_pages)               # [layers, blocks, block_size, ...] (NHD)
            flat = keys.reshape(keys.shape[0], keys.shape[1] * keys.shape[2], -1)
            out.append(np.any(flat != 0, axis=-1))
        return out
    finally:
        decoder.runner.caches.put(*caches)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_stop_ids_eos_and_what_follows_a_stop(target, autoregressive, kind):
    drafting, config = DRAFTERS[kind]
    draft = {"model": lambda: tiny_model(TINY, seed=0), "ngram": lambda: NgramDrafter(1, 3),
             None: lambda: None}[drafting]()
    decoder = SpeculativeDecoder(target, draft, config=config)      # fresh: its caches hold zeros
    alphabet = 3 if drafting == "ngram" else TINY.vocab_size        # n-gram drafts need repetitive text
    vocab_last = TINY.vocab_size - 1

    # 1. A request alone on the fresh decoder (blocks 0, 1, ... in order) whose output's second token
    # differs from its first: that stop token is drafted in the first step with drafts after it (all of
    # them accepted with the target as draft), and nothing after its position is ever written.
    prompt, free = next((p, f) for p, f in ((p, autoregressive.generate([p], MAX_NEW).tokens[0])
                                            for p in (prompts(s, 1, alphabet)[0] for s in range(61, 100)))
                        if f[1] != f[0])
    stop = free[1]
    outputs = run(Engine(decoder), [(prompt, SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[stop]), "r")])
    out = tokens(outputs, "r")
    assert out == cut_at(free, [stop])
    if kind == "model-chain":     # one step: 3 drafts, the stop second: the third was never verified
        assert outputs["r"][-1].num_draft_tokens == outputs["r"][-1].num_accepted_tokens == 2
    written_through = len(prompt) - 1 + len(out)                    # the stop token's position, at most
    for written in written_positions(decoder):
        assert not written[:, written_through + 1:].any() and written[:, written_through - 1].any()

    # 2. Engine: eos ids (two), ignore_eos, stop_token_ids.
    prompt = prompts(51, 1, alphabet)[0]
    free = autoregressive.generate([prompt], MAX_NEW).tokens[0]
    stop = free[4]
    engine = Engine(decoder, eos_token_id=[vocab_last, stop])
    outputs = run(engine, [(prompt, SamplingParams(max_tokens=MAX_NEW), "eos"),
                           (prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True), "ignore"),
                           (prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop]),
                            "stop")])
    assert tokens(outputs, "eos") == cut_at(free, [stop]) == tokens(outputs, "stop")
    assert outputs["eos"][-1].finish_reason == outputs["stop"][-1].finish_reason == "stop"
    if vocab_last not in free:
        assert tokens(outputs, "ignore") == free and outputs["ignore"][-1].finish_reason == "length"
    assert engine.num_free_blocks == engine.num_blocks

    # 3. generate: equal to autoregressive decoding, then stopping at the first of several eos ids.
    # A batch where request 0 stops at index 3 (or before), request 1 at 2, and another runs past 8 tokens:
    # more than two steps even when each step emits a whole chain or tree path (at most 4 tokens here).
    def stopping(seed):
        batch = prompts(seed, 4, alphabet)
        free = autoregressive.generate(batch, MAX_NEW).tokens
        first, second = free[0][3], free[1][2]
        return batch, free, (first, second), [cut_at(f, (first, second)) for f in free]

    batch, free, (first, second), cut = next(case for case in map(stopping, range(11, 60))
                                             if max(map(len, case[3])) > 8)
    assert len(cut[0]) <= 4 and len(cut[1]) <= 3 and len({len(t) for t in cut}) > 1   # different finish steps
    plain = decoder.generate(batch, MAX_NEW)
    assert plain.tokens == free
    if drafting is not None:
        assert plain.stats.mean_accepted_length > 1.0               # drafts were accepted
    streamed, calls = [[] for _ in batch], []

    def on_tokens(index, new):
        calls.append(len(new))
        streamed[index].extend(new)

    out = decoder.generate(batch, MAX_NEW, eos_token_id=[first, second], on_tokens=on_tokens)
    assert out.tokens == cut and streamed == cut
    assert 0 not in calls and len(calls) > len(batch)               # per step and request, never empty
    assert Engine(decoder).num_free_blocks == config.num_blocks     # every block came back
    if drafting is None:                    # the other spellings of several eos ids, autoregressive
        assert generate_autoregressive(target, batch, MAX_NEW, eos_token_id=(first, second),
                                       config=SMALL).tokens == cut
        assert autoregressive.generate(batch, MAX_NEW, eos_token_id=np.array([first, second])).tokens == cut
