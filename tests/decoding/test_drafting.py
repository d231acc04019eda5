"""Drafting in the decoding loop: n-gram prompt lookup, per-request draft counts, k = 0 steps that run
no draft (and the draft's catch-up afterwards), budget-aware drafts, and what the adaptive controller
is told about each step. Greedy output must equal autoregressive decoding throughout."""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax import AdaptiveController, ControllerConfig, DecoderConfig, NgramDrafter, SpeculativeDecoder
from scv_jax.graph.compile_counter import CompileCounter
from tests.decoding.common import MAX_NEW, SMALL, prompts
from tests.decoding.test_ngram import matched_prefix, reference_proposal

ADAPTIVE = DecoderConfig(**{**vars(SMALL), "adaptive": True, "k_values": (0, 2, 3)})


class Scripted:
    """A controller playing a fixed sequence of k (cycled), for the decoder's sake."""

    def __init__(self, ks):
        self._ks, self._step = list(ks), 0

    def next_k(self, batch_size, request_ids=None, remaining_tokens=None) -> int:
        k = self._ks[self._step % len(self._ks)]
        self._step += 1
        return k

    def update(self, *args, **kwargs) -> None:
        pass


class Spy(AdaptiveController):
    """The real controller, recording what the decoder tells it."""

    def __init__(self, config):
        super().__init__(config)
        self.asked, self.told = [], []

    def next_k(self, batch_size, request_ids=None, remaining_tokens=None):
        k = super().next_k(batch_size, request_ids, remaining_tokens)
        self.asked.append((batch_size, np.array(request_ids), k, np.array(remaining_tokens)))
        return k

    def update(self, num_draft_tokens, num_accepted, step_seconds=None, batch_size=None, request_ids=None, *, k=None):
        self.told.append(dict(drafts=np.array(num_draft_tokens), accepted=np.array(num_accepted),
                              seconds=step_seconds, batch=batch_size, ids=np.array(request_ids), k=k))
        super().update(num_draft_tokens, num_accepted, step_seconds, batch_size, request_ids, k=k)


@pytest.mark.parametrize("config", [DecoderConfig(**{**vars(SMALL), "k": 3}), ADAPTIVE], ids=["k=3", "adaptive"])
def test_ngram_greedy_equals_autoregressive(target, autoregressive, config):
    decoder = SpeculativeDecoder(target, NgramDrafter(min_n=1, max_n=3), config=config)
    accepted = 0.0
    for seed, batch in ((0, 1), (1, 3), (2, 4)):
        batch_prompts = prompts(seed, batch, alphabet=4)        # repetitive text: the n-grams match
        out = decoder.generate(batch_prompts, MAX_NEW)
        assert out.tokens == autoregressive.generate(batch_prompts, MAX_NEW).tokens
        accepted = max(accepted, out.stats.acceptance_rate)
    assert accepted > 0                                          # drafts were proposed and accepted
    assert decoder.pool.num_free == SMALL.num_blocks
    assert SpeculativeDecoder(target, "ngram", config=config).drafter == NgramDrafter()


def test_runs_of_k0_steps_skip_the_draft_and_catch_up_later(target, partial_draft, autoregressive):
    decoder = SpeculativeDecoder(target, partial_draft, config=ADAPTIVE)
    decoder.controllers["greedy"] = Scripted([0, 0, 0, 0, 3, 0, 2, 0, 0, 0, 0, 0, 0, 3, 2])
    batch_prompts = prompts(4, 4)
    out = decoder.generate(batch_prompts, 20)
    assert out.tokens == autoregressive.generate(batch_prompts, 20).tokens
    assert out.stats.catch_up_calls >= 2 and out.stats.k_histogram[0] >= 6
    assert 0.0 < out.stats.acceptance_rate < 1.0


def test_a_k0_step_is_an_autoregressive_step(target, partial_draft):
    """The k = 0 executable of a speculative decoder does exactly the autoregressive decoder's work."""
    speculative = SpeculativeDecoder(target, partial_draft, config=ADAPTIVE)
    autoregressive = SpeculativeDecoder(target, None, config=SMALL)
    flops = []
    for decoder in (speculative, autoregressive):
        decoder.warmup(4, SMALL.max_seq_len)
        plan = decoder.runner.decode_plan(4, 8, 0, True, False)
        flops.append(decoder.runner.decode_executable.executable(plan.key).cost_analysis()["flops"])
    assert flops[0] == flops[1] > 0


@pytest.mark.parametrize("max_new, drafts, k_histogram", [(1, [], {0: 1}), (3, [1.0, 1.0], {3: 1}),
                                                          (5, [1.0, 1.0, 1.0], {3: 1, 0: 1}),
                                                          (6, [1.0, 1.0, 1.0], {3: 2})])
def test_drafts_never_outrun_the_budget(target, max_new, drafts, k_histogram):
    """The draft equals the target (every draft accepted): a request drafts at most what it can still
    emit, and a step no request can draft in runs without the draft model."""
    # (the synchronous loop: with one step in flight a step is planned before the one before is fetched)
    decoder = SpeculativeDecoder(target, target, config=DecoderConfig(**{**vars(SMALL), "k": 3, "overlap": False}))
    out = decoder.generate([[1, 2, 3]], max_new)
    assert len(out.tokens[0]) == max_new
    assert [a for a in out.stats.acceptance_per_position if a == a] == drafts     # positions drafted
    assert out.stats.k_histogram == k_histogram


def test_the_controller_is_told_the_step_the_executable_ran(target, partial_draft):
    """Regression: the controller must see the padded batch the step computes, the k it chose for the
    step (what choosing it cost), each request's verified drafts within that k, the step's time (none
    for a step that compiled), request ids unique across calls and each request's remaining tokens
    (the batch runs until its last request is done); it learns from every step (the last one's update
    is flushed at the end of the call)."""
    decoder = SpeculativeDecoder(target, partial_draft, config=ADAPTIVE)      # one step in flight, the default
    spy = decoder.controllers["greedy"] = Spy(decoder.controllers["greedy"].config)
    first = decoder.generate(prompts(5, 3), 9)                     # 3 requests in the batch-4 bucket
    calls, asked = len(spy.told), len(spy.asked)
    second = decoder.generate(prompts(6, 2), 9)
    assert calls == first.stats.steps and len(spy.told) == calls + second.stats.steps
    assert [b for b, _, _, _ in spy.asked] == [4] * len(spy.asked)   # the bucket, not the 2 or 3 real rows
    # each call asks before its first step and then during each step, for the next (the last answer unused);
    # a step is told as the k asked, or less where the budgets ended sooner
    chosen = [k for _, _, k, _ in spy.asked[:calls] + spy.asked[asked:-1]]
    assert all(t["k"] <= k for t, k in zip(spy.told, chosen)) and len(chosen) == len(spy.told)
    assert sum(t["k"] == k for t, k in zip(spy.told, chosen)) >= len(chosen) // 2
    for told in spy.told:
        assert told["batch"] == 4 and 0 <= told["k"] <= 3
        assert told["drafts"].max(initial=0) <= told["k"] and np.all(told["accepted"] <= told["drafts"])
    timed = [t["seconds"] for t in spy.told]
    assert timed[0] is None and all(s is None or 0 < s < 30 for s in timed)   # the first step compiled
    assert sum(s is not None for s in timed) >= len(timed) // 2
    ids = [set(i.tolist()) for _, i, _, _ in spy.asked]
    assert not set().union(*ids[:asked]) & set().union(*ids[asked:])          # fresh ids per call
    left = {}
    for _, asked_ids, _, remaining in spy.asked:       # tokens left, never growing, never above the budget
        assert remaining.shape == asked_ids.shape and np.all((remaining >= 1) & (remaining <= 9))
        for i, r in zip(asked_ids.tolist(), remaining.tolist()):
            assert r <= left.get(i, 9)
            left[i] = r
    assert min(left.values()) < 9


def test_the_controller_counts_drafts_the_ngram_drafter_could_not_offer(target):
    """Regression: with n-gram drafts, a request whose lookup found fewer drafts than the step computed
    is told as drafting min(budget - 1, step k), its missing drafts as rejections, so the controller's
    E(k) is what a step of k emits (told only the proposals, it would see the matches' acceptance and
    keep speculating where no match comes)."""
    decoder = SpeculativeDecoder(target, NgramDrafter(min_n=1, max_n=2), config=ADAPTIVE)
    spy = decoder.controllers["greedy"] = Spy(decoder.controllers["greedy"].config)
    step_ks, dispatch = [], decoder.runner.dispatch                # each step's executable k, in order
    decoder.runner.dispatch = lambda work, *a: step_ks.append(work.drafts.step_k) or dispatch(work, *a)
    batch_prompts = prompts(8, 2, alphabet=3) + prompts(9, 2)      # two repetitive, two that rarely match
    out = decoder.generate(batch_prompts, MAX_NEW)
    assert len(step_ks) == len(spy.told)
    budget = [MAX_NEW] * len(batch_prompts)                        # the running requests: rows in order
    for told, ran in zip(spy.told, step_ks):
        running = [r for r, left in enumerate(budget) if left]
        for r, d, a in zip(running, told["drafts"].tolist(), told["accepted"].tolist()):
            if ran:
                assert d == min(budget[r] - 1, ran) and a <= d
            budget[r] -= a + 1 if ran else 1
    assert budget == [0] * len(batch_prompts)
    verified = [t for t, ran in zip(spy.told, step_ks) if ran]     # k = 0 steps: counterfactual counts
    offered = sum(int(t["drafts"].sum()) for t in verified)
    accepted = sum(int(t["accepted"].sum()) for t in verified)
    assert 0 < accepted / offered < out.stats.acceptance_rate      # some drafts were not offered


def test_no_recompilation_after_warmup_with_ngram_and_catch_up(target, partial_draft):
    ngram = SpeculativeDecoder(target, "ngram", config=ADAPTIVE)
    catching_up = SpeculativeDecoder(target, partial_draft, config=ADAPTIVE)
    catching_up.controllers["greedy"] = Scripted([0, 0, 0, 3, 0, 0, 0, 2])
    for decoder in (ngram, catching_up):
        decoder.warmup(4, SMALL.max_seq_len)
        with CompileCounter() as compiles:
            out = decoder.generate(prompts(7, 4, alphabet=4), 16)
        assert compiles.count == compiles.loads == 0 and out.stats.compile_count == 0
    assert out.stats.catch_up_calls >= 1


@pytest.mark.parametrize("stop", [False, True], ids=["budget", "eos"])
def test_at_k0_steps_the_controller_learns_what_ngram_drafts_would_have_had_accepted(target, autoregressive, stop):
    """Regression (the k = 0 trap): a controller holding k = 0 with n-gram drafting is told what the
    drafter's proposals would have had accepted: after step t (each emits one token per request), if
    none is pending, each running request's proposal of up to min(budget - 1, k_max) drafts; L steps
    later (L: the longest proposal) each one's cap and how many of its drafts the tokens emitted since
    repeat (a request that stopped at EOS meanwhile: those it emitted). Steps in between tell nothing."""
    fixed_k0 = ControllerConfig(mode="fixed", k_init=0)
    decoder = SpeculativeDecoder(target, NgramDrafter(min_n=1, max_n=3),
                                 config=DecoderConfig(**{**vars(ADAPTIVE), "controller": fixed_k0}))
    spy = decoder.controllers["greedy"] = Spy(decoder.controllers["greedy"].config)
    batch_prompts = prompts(8, 3, alphabet=3) + prompts(9, 1)
    reference = autoregressive.generate(batch_prompts, MAX_NEW).tokens
    eos = reference[0][4] if stop else None                     # request 0 stops after 5 tokens, others maybe
    out = decoder.generate(batch_prompts, MAX_NEW, eos_token_id=eos)
    assert out.tokens == autoregressive.generate(batch_prompts, MAX_NEW, eos_token_id=eos).tokens
    texts = [p + g for p, g in zip(batch_prompts, out.tokens)]
    assert len(spy.told) == max(map(len, out.tokens)) and {t["k"] for t in spy.told} == {0}
    assert stop == (min(map(len, out.tokens)) < MAX_NEW)
    pending, due = None, 0
    for step, told in enumerate(spy.told, start=1):
        running = [r for r, tokens in enumerate(out.tokens) if len(tokens) >= step]   # one token a step each
        expected = np.zeros((2, len(running)), np.int64)
        if pending is not None:
            due -= 1
            if not due:
                expected, pending = np.array([[pending[r][j] for r in running] for j in (0, 1)]), None
        if pending is None:       # proposals at this step's end for the requests still running
            cap = min(MAX_NEW - step - 1, 3)
            after = {r: len(batch_prompts[r]) + step for r in range(len(texts)) if len(out.tokens[r]) > step}
            proposals = {r: reference_proposal(texts[r][:n], 1, 3, cap) for r, n in after.items()}
            due = max([1, *map(len, proposals.values())])
            pending = {r: (cap, matched_prefix(proposals[r], texts[r][n:])) if r in after else (0, 0)
                       for r, n in ((r, after.get(r)) for r in range(len(texts)))}
        np.testing.assert_array_equal(np.stack([told["drafts"], told["accepted"]]), expected, err_msg=f"step {step}")
    told = np.sum([t["drafts"].sum() for t in spy.told]), np.sum([t["accepted"].sum() for t in spy.told])
    assert told[0] > 0 and 0 < told[1] < told[0]
