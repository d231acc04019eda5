"""AdaptiveController's behaviour: the k it picks on simulated workloads (k = 0 where speculation loses,
the best k, adapting when acceptance or batch shifts), what a step costs, and its errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.adaptive_sim import (FixedPolicy, OraclePolicy, Scenario, StepCost, bursty_acceptance,
                                     constant_acceptance, simulate, standard_scenarios)
from scv_jax import AdaptiveController, ControllerConfig
from scv_jax.adaptive.controller import expected_tokens

LOADED = StepCost(draft_ratio=0.1, target_saturation_tokens=32.0, draft_saturation_tokens=256.0)


def _scenario(acceptance, ticks: int, batch: int | np.ndarray = 1, cost: StepCost = StepCost()) -> Scenario:
    batch_size = np.broadcast_to(np.asarray(batch, np.int64), (ticks,)).copy()
    return Scenario("test", constant_acceptance(ticks, acceptance) if np.ndim(acceptance) < 2 else acceptance,
                    batch_size, cost)


def _fixed(scenario: Scenario) -> list[float]:
    return [simulate(FixedPolicy(k), scenario).throughput for k in range(9)]


def _steps(ctrl: AdaptiveController, accepts: bool, steps: int, *, batch: int = 4, ids=None, remaining=None,
           cost=lambda k: 0.01 * (1 + 0.15 * k)) -> list[int]:
    """Runs ``steps`` steps whose requests accept every draft (``accepts``) or none; returns the k chosen."""
    chosen = []
    for _ in range(steps):
        k = ctrl.next_k(batch, ids, remaining)
        chosen.append(k)
        ctrl.update(np.full(batch, k), np.full(batch, k if accepts else 0), cost(k), batch, k=k)
    return chosen


# ----------------------------------------------------------------- estimates
@given(st.floats(0.01, 0.99), st.integers(1, 8))
def test_expected_tokens_matches_geometric_formula(a, k_max):
    k = np.arange(k_max + 1)
    np.testing.assert_allclose(expected_tokens(np.full(k_max, a)), (1 - a ** (k + 1)) / (1 - a), rtol=1e-12)


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=20))
def test_position_counts_match_a_loop(pairs):
    drafts = np.array([d for d, _ in pairs], np.int32)
    accepted = np.array([min(n, d) for d, n in pairs], np.int32)
    ctrl = AdaptiveController(k_max=6, acceptance_decay=1.0, prior_strength=1e-9)
    ctrl.update(drafts, accepted)
    trials, successes = np.zeros(6), np.zeros(6)
    for d, n in zip(drafts, accepted):
        for j in range(1, d + 1):  # position j is tried when drafts 1..j-1 were accepted
            if n >= j - 1:
                trials[j - 1] += 1
                successes[j - 1] += n >= j
    seen = trials > 0
    np.testing.assert_allclose(ctrl.acceptance()[seen], np.minimum(successes[seen] / trials[seen], 0.999),
                               atol=1e-6)


def test_unobserved_positions_extrapolate_from_the_previous_one():
    ctrl = AdaptiveController(k_max=4, prior_strength=1.0)
    for _ in range(50):
        ctrl.update(np.array([1, 1, 1, 1]), np.array([1, 1, 0, 1]))  # only position 1 ever drafted
    a = ctrl.acceptance()
    assert abs(a[0] - 0.75) < 0.03 and np.allclose(a[1:], a[0])


# ----------------------------------------------------------------- the k it picks
@pytest.mark.parametrize("a", [0.5, 0.7, 0.9])
@pytest.mark.parametrize("c", [0.02, 0.1, 0.3])
def test_it_settles_on_the_best_k(a, c):
    k = np.arange(9)
    goodput = (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))
    trace = simulate(AdaptiveController(), _scenario(a, ticks=10**6, batch=16, cost=StepCost(draft_ratio=c)),
                     max_steps=300)
    chosen = np.bincount(trace.k[-100:]).argmax()
    assert goodput[chosen] >= 0.97 * goodput.max(), (chosen, goodput)


def test_it_picks_k0_where_speculation_loses():
    scenario = _scenario(0.2, ticks=1500, cost=StepCost(draft_ratio=0.3))
    fixed = _fixed(scenario)
    assert int(np.argmax(fixed)) == 0
    trace = simulate(AdaptiveController(), scenario)
    assert np.mean(trace.k[len(trace.k) // 2:] == 0) >= 0.9
    assert trace.throughput >= 0.95 * fixed[0]


@pytest.mark.parametrize("scenario", standard_scenarios(2000), ids=lambda s: s.name.split(",")[0])
def test_near_the_best_fixed_k_on_every_simulated_workload(scenario):
    assert simulate(AdaptiveController(), scenario).throughput >= 0.97 * max(_fixed(scenario))


def test_it_adapts_when_acceptance_shifts_and_leaves_k0_when_drafting_pays_again():
    ctrl = AdaptiveController(allowed_k=(0, 2, 4, 8))
    assert _steps(ctrl, True, 60)[-1] == 8               # every draft accepted: the largest k
    assert _steps(ctrl, False, 80)[-10:] == [0] * 10     # none accepted: no drafts
    back = _steps(ctrl, True, 60)                        # a probe out of k = 0 sees drafts accepted again
    assert back.index(8) < 40 and back[-10:].count(8) >= 9   # (the runner-up runs a step every 16)


def test_it_follows_bursty_acceptance_better_than_any_fixed_k():
    scenario = _scenario(bursty_acceptance(3000, 0.2, 0.9, 300, seed=1), ticks=3000, cost=StepCost(draft_ratio=0.1))
    assert simulate(AdaptiveController(), scenario).throughput > max(_fixed(scenario))


def test_it_stops_speculating_at_high_batch_and_returns():
    ticks = 3000
    batch = np.where((np.arange(ticks) >= 1000) & (np.arange(ticks) < 2000), 64, 1)
    scenario = _scenario(0.7, ticks=ticks, batch=batch, cost=LOADED)
    oracle = simulate(OraclePolicy(scenario), scenario)
    trace = simulate(AdaptiveController(), scenario)
    assert np.all(oracle.k[(oracle.start >= 1000 * 0.02) & (oracle.start < 2000 * 0.02)] == 0)
    assert np.mean(trace.k[(trace.start >= 1500 * 0.02) & (trace.start < 2000 * 0.02)] == 0) >= 0.9
    assert np.mean(trace.k[trace.start >= 2500 * 0.02] >= 2) >= 0.9


def test_a_batch_near_its_end_drafts_no_more_than_it_has_tokens_left():
    ctrl = AdaptiveController(allowed_k=(0, 1, 2, 4, 8), decide_every=1)
    assert _steps(ctrl, True, 40, remaining=np.full(4, 500))[-1] == 8
    assert ctrl.next_k(4, remaining_tokens=np.full(4, 2)) == 1        # one draft + the bonus token: all that is left


def test_counterfactual_counts_at_k0_steps_free_a_controller_holding_k0():
    """Told at k = 0 steps what unverified n-gram proposals would have had accepted, a controller
    holding k = 0 drafts again within a few proposals, well before one told nothing."""
    settings = dict(allowed_k=(0, 2, 4, 8), probe_every=0)
    first = {}
    for told in (True, False):
        ctrl = AdaptiveController(**settings)
        _steps(ctrl, False, 80)
        for step in range(60):
            k = ctrl.next_k(4)
            if k:
                first.setdefault(told, step)
                break
            counterfactual = np.full(4, 8 if told and step % 4 == 3 else 0)
            ctrl.update(counterfactual, counterfactual, 0.01, 4, k=0)
    assert first[True] <= 12 and first.get(False, 60) >= first[True] + 8


def test_other_requests_in_a_reused_ids_buffer_are_a_new_batch():
    """Regression: a caller that writes new request ids into the same array gets a decision at once
    for them (the old controller compared the array's identity and kept deciding as for the old batch)."""
    ctrl = AdaptiveController(allowed_k=(0, 2, 8), decide_every=1000, probe_every=0)
    ids = np.arange(4)
    assert _steps(ctrl, True, 20, ids=ids)[-1] == 8
    _steps(ctrl, False, 80, ids=ids)                 # no decision due: k = 8 held
    assert ctrl.next_k(4, ids) == 8
    ids[:] = np.arange(4) + 10                       # new requests, same buffer
    assert ctrl.next_k(4, ids) == 0


@given(st.permutations(range(4)))
def test_each_request_keeps_its_own_remaining_tokens_whatever_the_order_of_its_id(order):
    """Regression: ``next_k`` sorted the request ids but not their remaining tokens, so with ids out of
    order one request's cap was applied to another's acceptance. Request 0 accepts every draft and has
    500 tokens left; the others accept none and have 1 left: the same k in any order, and it drafts."""
    def trained() -> AdaptiveController:
        ctrl = AdaptiveController(allowed_k=(0, 2, 8), decide_every=1, probe_every=0)
        for step in range(40):
            k = (0, 2, 8)[step % 3]
            ctrl.update(np.full(4, k), np.array([k, 0, 0, 0]), 0.01 * (1 + 0.02 * k), 4, np.arange(4), k=k)
        return ctrl

    ids, remaining = np.arange(4), np.array([500, 1, 1, 1])
    expected = trained().next_k(4, ids, remaining)
    assert expected == 8
    assert trained().next_k(4, ids[list(order)], remaining[list(order)]) == expected


def test_fixed_mode_is_constant():
    trace = simulate(AdaptiveController(mode="fixed", k_init=2), _scenario(0.6, ticks=300))
    assert np.all(trace.k == 2)


def test_allowed_set_is_respected():
    trace = simulate(AdaptiveController(allowed_k=(0, 2, 5)), _scenario(0.8, ticks=600))
    assert set(np.unique(trace.k)) == {0, 2, 5}


# ----------------------------------------------------------------- cost per step
def test_step_cost_per_batch_bucket_follows_the_machine_load_and_never_decreases_in_k():
    ctrl = AdaptiveController(allowed_k=(0, 2, 4, 8))
    ctrl.next_k(4)

    def step(k, seconds):
        ctrl.update(np.zeros(4, np.int64), np.zeros(4, np.int64), seconds, 4, k=k)

    for k, seconds in ((0, 1.0), (2, 3.0), (4, 2.5)):
        step(k, seconds)
    np.testing.assert_allclose(ctrl.step_seconds(4)[:3], [1.0, 2.5, 2.5])   # k = 2: 3 lowered to k = 4's 2.5
    assert ctrl.step_seconds(5)[2] == ctrl.step_seconds(4)[2]                  # batch 5 is bucket 4
    assert np.isnan(ctrl.step_seconds(4)[3]) and np.isnan(ctrl.step_seconds(16)).all()   # never timed
    step(8, None)                                                              # untimed (a compile)
    assert np.isnan(ctrl.step_seconds(4)[3])
    for _ in range(40):          # the machine at half speed, seen by k = 4 steps only
        step(4, 5.0)
    seconds = ctrl.step_seconds(4)
    assert seconds[2] == pytest.approx(5.0, rel=0.01)
    assert 1.6 < seconds[0] <= 2.0      # k = 0, never run since, is predicted dearer with the machine
    step(4, 1e3)                        # a pause counts as twice the prediction
    assert np.all(ctrl.step_seconds(4)[:3] <= 2.0 * seconds[:3])


def test_an_old_pause_in_a_rarely_run_small_k_does_not_make_larger_k_look_dear():
    """A small k timed once during a pause (e.g. at a request's end) must not hold every larger k's cost up:
    the controller would then keep k = 0 however well drafts are accepted."""
    ctrl = AdaptiveController(allowed_k=(0, 2, 8))
    ctrl.next_k(1)
    ctrl.update(np.zeros(1, np.int64), np.zeros(1, np.int64), 1.0, 1, k=0)
    ctrl.update(np.zeros(1, np.int64), np.zeros(1, np.int64), 20.0, 1, k=2)      # one step, in a pause
    for _ in range(10):
        ctrl.update(np.full(1, 8), np.full(1, 8), 2.0, 1, k=8)                   # every draft accepted
    assert ctrl.step_seconds(1).tolist() == [1.0, 2.0, 2.0]
    assert ctrl.next_k(1) == 8


def test_each_k_never_timed_at_a_batch_is_run_there_first():
    ctrl = AdaptiveController(allowed_k=(0, 2, 4))
    chosen = _steps(ctrl, True, 3)
    assert sorted(chosen) == [0, 2, 4]
    assert sorted(_steps(ctrl, True, 3, batch=16)) == [0, 2, 4]      # another bucket: timed again


@given(st.lists(st.tuples(st.booleans(), st.floats(0.001, 0.1)), min_size=1, max_size=40))
def test_a_step_timed_later_teaches_what_it_would_have_taught_at_once(steps):
    """``update`` untimed then ``time_step`` (several processes: process 0's time, a step late) leaves the
    controller as ``update`` with the time does, when the time comes before the next decision."""
    at_once, later = AdaptiveController(allowed_k=(0, 2, 4)), AdaptiveController(allowed_k=(0, 2, 4))
    for accepts, seconds in steps:
        k = at_once.next_k(4)
        assert later.next_k(4) == k
        drafts, accepted = np.full(4, k), np.full(4, k if accepts else 0)
        at_once.update(drafts, accepted, seconds, 4, k=k)
        later.update(drafts, accepted, None, 4, k=k)
        later.time_step(4, k, seconds)
    assert np.array_equal(at_once.step_seconds(4), later.step_seconds(4), equal_nan=True)


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, match", [
    ({"k_min": 5, "k_max": 2}, "k_min"),
    ({"allowed_k": (9,)}, "allowed_k"),
    ({"mode": "greedy"}, "mode"),
    ({"k_init": 3, "allowed_k": (0, 2)}, "k_init"),
    ({"acceptance_decay": 0.0}, "acceptance_decay"),
    ({"cost_rate": 1.5}, "cost_rate"),
    ({"prior_acceptance": 1.0}, "prior_acceptance"),
    ({"switch_margin": -0.1}, "switch_margin"),
    ({"k_max": -1}, "k_max"),
    ({"decide_every": 0}, "decide_every"),
    ({"probe_every": 2.5}, "probe_every must be an int"),
])
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ControllerConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        AdaptiveController(**kwargs)


@pytest.mark.parametrize("args, kwargs, match", [
    ((np.array([2, 2]), np.array([1])), {}, "same shape"),
    ((np.array([2, 2]), np.array([3, 0])), {}, "num_accepted"),
    ((np.array([9]), np.array([0])), {}, "num_draft_tokens"),
    ((np.array([2.0]), np.array([1])), {}, "num_draft_tokens"),
    ((np.array([[2]]), np.array([[1]])), {}, "num_draft_tokens"),
    ((np.array([1, 1]), np.array([1, 1]), 0.1, 1), {}, "batch_size"),
    ((np.array([1]), np.array([1]), -1.0), {}, "seconds"),
    ((np.array([1]), np.array([1])), {"k": -1}, "k must be"),
])
def test_bad_update_raises(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveController(k_max=8).update(*args, **kwargs)


@pytest.mark.parametrize("args, match", [
    ((0,), "batch_size"),
    ((4, np.arange(5)), "request_ids"),
    ((4, np.array([0, -1])), "request_ids"),
    ((4, np.arange(3), np.array([5, -1, 2])), "remaining_tokens"),
    ((4, None, np.array([1.5])), "remaining_tokens"),
    ((4, None, np.ones((1, 2), np.int64)), "remaining_tokens"),
    ((4, np.arange(3), np.ones(2, np.int64)), "remaining_tokens"),
])
def test_bad_next_k_raises(args, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveController().next_k(*args)
