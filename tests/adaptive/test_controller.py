"""AdaptiveController: estimates, decisions per mode, cost model, configuration errors, simulated throughput."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scv_jax import AdaptiveController, ControllerConfig
from benchmarks.adaptive_sim import (DECAYING_MARGINALS, FixedPolicy, OraclePolicy, Scenario, StepCost,
                                  conditional_from_marginal, constant_acceptance, drifting_acceptance, simulate)
from scv_jax.adaptive.controller import expected_tokens
from scv_jax.adaptive.cost_model import CostPrior, StepCostModel, step_features

LOADED = StepCost(draft_ratio=0.1, target_saturation_tokens=32.0, draft_saturation_tokens=256.0)


def _scenario(acceptance, ticks: int, batch: int | np.ndarray = 1, cost: StepCost = StepCost()) -> Scenario:
    batch_size = np.broadcast_to(np.asarray(batch, np.int64), (ticks,)).copy()
    return Scenario("test", constant_acceptance(ticks, acceptance) if np.ndim(acceptance) < 2 else acceptance,
                    batch_size, cost)


def _best_fixed(scenario: Scenario) -> float:
    return max(simulate(FixedPolicy(k), scenario).throughput for k in range(9))


# ----------------------------------------------------------------- estimates
@given(st.floats(0.01, 0.99), st.integers(1, 8))
def test_expected_tokens_matches_geometric_formula(a, k_max):
    emitted = expected_tokens(np.full(k_max, a))
    k = np.arange(k_max + 1)
    np.testing.assert_allclose(emitted, (1 - a ** (k + 1)) / (1 - a), rtol=1e-12)


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


# ----------------------------------------------------------------- goodput mode
@pytest.mark.parametrize("a", [0.5, 0.7, 0.8, 0.9])
@pytest.mark.parametrize("c", [0.02, 0.1, 0.3])
def test_goodput_converges_to_brute_force_k(a, c):
    k = np.arange(9)
    goodput = (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))
    scenario = _scenario(a, ticks=10**6, batch=16, cost=StepCost(draft_ratio=c))
    ctrl = AdaptiveController(seed=1)  # default cost prior c = 0.1: it must learn c from step times
    simulate(ctrl, scenario, max_steps=300)
    chosen = ctrl.state()["held_k"]
    # the argmax, or a near-tie the controller's hysteresis (switch_margin) deliberately does not chase
    near_tie = goodput[chosen] >= (1 - ctrl.config.switch_margin) * goodput.max()
    assert chosen == np.argmax(goodput) or near_tie, (chosen, goodput)


def test_goodput_within_5_percent_of_best_fixed_on_stationary():
    for acceptance, c in ((0.8, 0.05), (conditional_from_marginal(DECAYING_MARGINALS), 0.05), (0.6, 0.3)):
        scenario = _scenario(acceptance, ticks=1000, cost=StepCost(draft_ratio=c))
        assert simulate(AdaptiveController(), scenario).throughput >= 0.95 * _best_fixed(scenario)


def test_goodput_beats_best_fixed_on_drifting():
    scenario = _scenario(drifting_acceptance(2000, 0.3, 0.9), ticks=2000, cost=StepCost(draft_ratio=0.1))
    assert simulate(AdaptiveController(), scenario).throughput > _best_fixed(scenario)


def test_goodput_stops_speculating_at_high_batch_and_returns():
    ticks = 3000
    batch = np.where((np.arange(ticks) >= 1000) & (np.arange(ticks) < 2000), 64, 1)
    scenario = _scenario(0.7, ticks=ticks, batch=batch, cost=LOADED)
    oracle = simulate(OraclePolicy(scenario), scenario)
    trace = simulate(AdaptiveController(), scenario)
    late_high = (trace.start >= 1500 * 0.02) & (trace.start < 2000 * 0.02)
    late_low = trace.start >= 2500 * 0.02
    assert np.all(oracle.k[(oracle.start >= 1000 * 0.02) & (oracle.start < 2000 * 0.02)] == 0)
    assert np.mean(trace.k[late_high] == 0) >= 0.9
    assert np.mean(trace.k[late_low] >= 2) >= 0.9  # speculating again, and nearly as well as the oracle:
    oracle_late = oracle.start >= 2500 * 0.02
    # expected tokens of the k chosen (a = 0.7), so the two runs' different random draws do not count
    expected = lambda k: (1 - 0.7 ** (k + 1)) / 0.3  # noqa: E731
    rate = lambda t, rows: expected(t.k[rows]).sum() / t.seconds[rows].sum()  # noqa: E731
    assert rate(trace, late_low) >= 0.95 * rate(oracle, oracle_late)
    target = simulate(AdaptiveController(mode="target"), scenario)
    assert trace.throughput > 1.05 * target.throughput  # the acceptance target ignores load


def test_exploration_and_warmup_are_deterministic():
    scenario = _scenario(0.7, ticks=400)
    first, second = (simulate(AdaptiveController(seed=3), scenario) for _ in range(2))
    np.testing.assert_array_equal(first.k, second.k)
    assert first.k[0] == 8 and first.k[1] == 1  # warm-up alternates k_init and the smallest positive k


# ----------------------------------------------------------------- target and fixed modes
def test_target_mode_holds_its_target():
    ctrl = AdaptiveController(mode="target", target_acceptance=0.5, target_band=0.05)
    simulate(ctrl, _scenario(0.7, ticks=2000, batch=4))
    # ratio(k) = (E(k) - 1) / k for a = 0.7: 0.70, 0.60, 0.51, 0.44, ... -> k = 3 is the one in band
    assert ctrl.state()["held_k"] == 3
    assert abs(ctrl.summary()["acceptance_ratio"] - 0.5) <= 0.05


def test_fixed_mode_is_constant_and_matches_the_fixed_policy():
    scenario = _scenario(0.6, ticks=300)
    ctrl = AdaptiveController(mode="fixed", k_init=2)
    trace = simulate(ctrl, scenario)
    assert np.all(trace.k == 2)
    assert trace.throughput == simulate(FixedPolicy(2), scenario).throughput
    assert ctrl.summary()["k_histogram"] == {2: len(trace.k)}


def test_allowed_set_is_respected():
    trace = simulate(AdaptiveController(allowed_k=(0, 2, 5)), _scenario(0.8, ticks=600))
    assert set(np.unique(trace.k)) <= {0, 2, 5}


# ----------------------------------------------------------------- per-request k
def test_per_request_k_trims_poor_requests():
    acceptance = np.broadcast_to(np.where(np.arange(16) % 2 == 0, 0.9, 0.2)[None, :, None], (1500, 16, 8))
    scenario = _scenario(acceptance, ticks=1500, batch=16, cost=LOADED)
    ctrl = AdaptiveController(per_request=True)
    shared = simulate(AdaptiveController(), scenario).throughput
    assert simulate(ctrl, scenario).throughput > shared
    ctrl.next_k(16)
    ks = ctrl.request_k(range(16))
    assert ks[0::2].mean() > ks[1::2].mean()
    assert ks.max() <= ctrl.state()["k"]


def test_packed_steps_make_a_large_k_as_cheap_as_what_it_verifies():
    """Drafting free (n-gram): a k whose dense step is too slow wins once its packed steps
    (update(target_tokens=...)) show that it verifies about one draft per row: its cost is then the
    table's between k = 0 and k = 2."""
    ctrl = AdaptiveController(allowed_k=(0, 2, 4), k_max=4, k_init=2, draft_model=False,
                              explore_prob=0.0, warmup_steps=0, min_dwell_steps=1)
    batch, ids = 8, np.arange(8)
    dense = {0: 0.010, 2: 0.014, 4: 0.030}
    for _ in range(12):                          # every draft accepted: E(2) = 3, E(4) = 5 tokens a step
        for k, seconds in dense.items():
            ctrl.update(np.full(batch, k), np.full(batch, k), seconds, batch, ids, step_k=k)
    assert ctrl.next_k(batch, ids) == 2         # 5 / 0.030 < 3 / 0.014
    for _ in range(12):                          # k = 4 steps verifying one draft per row, packed
        ctrl.update(np.full(batch, 1), np.full(batch, 1), 0.012, batch, ids, step_k=4, target_tokens=2 * batch)
        ctrl.update(np.full(batch, 2), np.full(batch, 2), dense[2], batch, ids, step_k=2)
    assert ctrl.next_k(batch, ids) == 4


# ----------------------------------------------------------------- cost model
def test_cost_model_learns_a_linear_cost():
    truth = np.array([0.01, 2e-5, 1e-3, 5e-6])
    model = StepCostModel(CostPrior())
    rng = np.random.default_rng(0)
    for _ in range(300):
        k, batch = int(rng.integers(0, 9)), int(rng.choice([16, 24]))
        features = step_features(batch, batch * k, k)
        model.observe(features, float(features @ truth))
    features = step_features(20, 20 * np.arange(9), np.arange(9))
    np.testing.assert_allclose(model.predict(features), features @ truth, rtol=0.02)


def test_cost_model_skips_slow_outliers_and_restarts_after_a_slow_first_step():
    model = StepCostModel(CostPrior())
    features = step_features(1, 2, 2)
    model.observe(features, 5.0)  # e.g. a step that compiled
    model.observe(features, 0.02)
    assert abs(float(model.predict(features)) - 0.02) < 1e-3
    assert not model.observe(features, 1.0)
    assert abs(float(model.predict(features)) - 0.02) < 1e-3


def test_draft_sync_forward_charges_k0_a_draft_forward():
    catch_up, forward = AdaptiveController(), AdaptiveController(draft_sync="forward")
    assert forward.predicted_step_cost(1, np.array([0]))[0] > catch_up.predicted_step_cost(1, np.array([0]))[0]
    assert forward.predicted_step_cost(1, np.array([1]))[0] == catch_up.predicted_step_cost(1, np.array([1]))[0]


def test_state_and_summary():
    ctrl = AdaptiveController(k_max=4)
    k = ctrl.next_k(2)
    ctrl.update(np.array([k, k]), np.array([1, k]), step_seconds=0.03, batch_size=2)
    state, summary = ctrl.state(), ctrl.summary()
    assert state["k"] == k and state["acceptance"].shape == (4,) and state["cost_timed"]
    assert summary["steps"] == 1 and summary["emitted_tokens"] == 1 + k + 2
    assert summary["acceptance_ratio"] == pytest.approx((1 + k) / (2 * k))


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, match", [
    ({"k_min": 5, "k_max": 3}, "k_min"),
    ({"allowed_k": ()}, "allowed_k"),
    ({"allowed_k": (9, 10), "k_max": 8}, "allowed_k"),
    ({"target_acceptance": 0.0}, "target_acceptance"),
    ({"target_acceptance": 1.0}, "target_acceptance"),
    ({"target_acceptance": 1.5}, "target_acceptance"),
    ({"mode": "greedy"}, "mode"),
    ({"k_init": 3, "allowed_k": (0, 2)}, "k_init"),
    ({"acceptance_decay": 0.0}, "acceptance_decay"),
    ({"explore_prob": 1.0}, "explore_prob"),
    ({"k_max": -1}, "k_max"),
    ({"max_dwell_steps": -1}, "max_dwell_steps"),
    ({"min_dwell_steps": 2.5}, "min_dwell_steps must be an int"),
])
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ControllerConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        AdaptiveController(**kwargs)


@pytest.mark.parametrize("drafts, accepted, match", [
    (np.array([2, 2]), np.array([1]), "same shape"),
    (np.array([2, 2]), np.array([3, 0]), "num_accepted"),
    (np.array([9]), np.array([0]), "num_draft_tokens"),
    (np.array([2.0]), np.array([1]), "num_draft_tokens"),
    (np.array([[2]]), np.array([[1]]), "num_draft_tokens"),
])
def test_bad_update_raises(drafts, accepted, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveController(k_max=8).update(drafts, accepted)


def test_bad_step_seconds_and_batch_size_raise():
    ctrl = AdaptiveController()
    with pytest.raises(ValueError, match="step_seconds"):
        ctrl.update(np.array([1]), np.array([1]), step_seconds=-1.0)
    with pytest.raises(ValueError, match="batch_size"):
        ctrl.next_k(0)
    with pytest.raises(ValueError, match="per_request"):
        ctrl.request_k([0])


def test_padding_rows_are_charged_their_drafts():
    # the decoder reports the padded batch (16) of a step with 5 real requests: the padding rows
    # also draft k tokens each, so the cost model must see 16 * k draft tokens, not 5 * k
    truth = np.array([0.01, 2e-4, 1e-3, 5e-5])
    ctrl = AdaptiveController(k_max=8, draft_sync="forward", cost_decay=1.0)
    for k in (2, 8) * 30:
        ctrl.update(np.full(5, k), np.zeros(5, np.int64), float(step_features(16, 16 * k, k) @ truth), 16)
    ks = np.array([2, 8])
    np.testing.assert_allclose(ctrl.predicted_step_cost(16, ks), step_features(16, 16 * ks, ks) @ truth,
                               rtol=0.05)


def test_a_dense_step_is_charged_its_computed_drafts():
    # the decoder's steps compute k drafts for every row whatever each request verifies (ragged n-gram
    # proposals, budgets): with step_k the cost model sees batch * step_k draft tokens
    truth = np.array([0.01, 2e-4, 1e-3, 5e-5])
    ctrl = AdaptiveController(k_max=8, allowed_k=(0, 2, 8), cost_decay=1.0)
    rng = np.random.default_rng(0)
    for k in (2, 8) * 30:
        verified = rng.integers(0, k + 1, 5)                       # ragged: what requests verified
        ctrl.update(verified, np.zeros(5, np.int64), float(step_features(16, 16 * k, k) @ truth), 16, step_k=k)
    ks = np.array([2, 8])
    np.testing.assert_allclose(ctrl.predicted_step_cost(16, ks), step_features(16, 16 * ks, ks) @ truth, rtol=0.02)


def test_measured_shapes_override_a_cost_the_linear_model_cannot_follow():
    # a step-wise cost in k (XLA:CPU's kernels): measured shapes are predicted by their measurements
    seconds = {0: 0.010, 2: 0.020, 4: 0.021, 8: 0.040}
    ctrl = AdaptiveController(k_max=8, allowed_k=tuple(seconds), cost_decay=1.0)
    for _ in range(20):
        for k, s in seconds.items():
            ctrl.update(np.full(4, k), np.zeros(4, np.int64), s, 4, step_k=k)
    np.testing.assert_allclose(ctrl.predicted_step_cost(4), list(seconds.values()), rtol=0.05)


def test_without_a_draft_model_drafting_costs_no_forwards():
    """Before any timing (the default model): drafting 4 tokens costs 4 target tokens, plus 4 draft
    forwards and 4 draft tokens with a draft model, and nothing more without one (n-gram)."""
    prior = CostPrior().coefficients()
    ks = np.array([0, 4])
    free = np.diff(AdaptiveController(allowed_k=(0, 4), draft_model=False).predicted_step_cost(1, ks))[0]
    model = np.diff(AdaptiveController(allowed_k=(0, 4)).predicted_step_cost(1, ks))[0]
    assert free == pytest.approx(4 * prior[1]) and model == pytest.approx(4 * prior[1:].sum())


def test_per_request_estimates_follow_the_batch_that_runs():
    """Requests 0-3 accept everything, 4-7 nothing: k follows whichever requests the next step runs."""
    ctrl = AdaptiveController(per_request=True, allowed_k=(0, 2, 4, 8), warmup_steps=0, explore_prob=0.0,
                              min_dwell_steps=0)
    good, poor, both = np.arange(4), np.arange(4, 8), np.arange(8)
    for _ in range(40):
        k = ctrl.next_k(8, both)
        ctrl.update(np.full(8, k), np.where(both < 4, k, 0), 0.01 + 0.001 * k, 8, both, step_k=k)
    assert ctrl.predicted_goodput(8, good).argmax() > ctrl.predicted_goodput(8, poor).argmax()
    assert ctrl.next_k(4, good) > ctrl.next_k(4, poor) == 0
    assert ctrl.request_k(both)[:4].min() >= ctrl.request_k(both)[4:].max()


@pytest.mark.parametrize("remaining", [[3.5, 2.0], [[3, 2]], [3, 2, 1]])
def test_remaining_tokens_must_be_ints_one_per_request(remaining):
    ctrl = AdaptiveController(per_request=True)
    with pytest.raises(ValueError, match="remaining_tokens must be an int"):
        ctrl.next_k(2, np.array([0, 1]), remaining)


def test_request_ids_must_be_ints_one_per_request():
    ctrl = AdaptiveController(per_request=True)
    with pytest.raises(ValueError, match="request_ids must be 2 non-negative ints"):
        ctrl.update(np.array([1, 1]), np.array([0, 1]), request_ids=["a", "b"])


def test_a_step_at_a_batch_size_never_timed_keeps_the_other_measurements():
    """Regression: a batch that shrinks to a size never timed gets a fast step against an extrapolated
    prediction; it must be taken as a first measurement there, not as proof that every earlier timing
    was a slow outlier (which wiped the whole cost table each time the decoder's batch shrank)."""
    ctrl = AdaptiveController(allowed_k=(0, 2, 4), warmup_steps=0, explore_prob=0.0)
    for step in range(60):
        k = (0, 2, 4)[step % 3]
        ctrl.update(np.full(16, k), np.zeros(16, np.int64), 0.006 * (1 + 0.45 * k), 16, step_k=k)
    before = ctrl.predicted_step_cost(16)
    np.testing.assert_allclose(before, [0.006, 0.0114, 0.0168], rtol=0.05)
    ctrl.update(np.full(1, 2), np.zeros(1, np.int64), 0.0002, 1, step_k=2)      # 1 / 60 of a batch-16 step
    np.testing.assert_allclose(ctrl.predicted_step_cost(16), before, rtol=0.05)
    assert ctrl.summary()["skipped_timings"] == 0


@given(st.lists(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=3, max_size=3),
                min_size=1, max_size=40), st.integers(1, 7))
def test_deferred_steps_fold_as_if_each_was_folded_at_once(steps, read_every):
    """The controller folds steps into its estimates when one is read (``_fold``): reading after every
    step or every few steps (or past the pending limit) gives the same decayed position counts, totals
    and per-request accepted counts as a loop that decays at every step."""
    decay = 0.9
    ctrl = AdaptiveController(k_max=6, acceptance_decay=decay, prior_strength=1e-9, per_request=True,
                              min_dwell_steps=2, max_dwell_steps=3)      # at most 3 steps pending
    ids = np.arange(3)
    trials, successes, accepted_by_request, totals = np.zeros(6), np.zeros(6), np.zeros(3), np.zeros(2)
    for i, pairs in enumerate(steps):
        drafts = np.array([d for d, _ in pairs])
        accepted = np.array([min(n, d) for d, n in pairs])
        ctrl.update(drafts, accepted, request_ids=ids)
        totals += drafts.sum(), accepted.sum()
        trials *= decay
        successes *= decay
        accepted_by_request = decay * accepted_by_request + accepted
        for d, n in zip(drafts, accepted):
            for j in range(1, d + 1):
                if n >= j - 1:
                    trials[j - 1] += 1
                    successes[j - 1] += n >= j
        if i % read_every == 0:
            ctrl.acceptance()
    # unreached positions drift to the one before: compare where every position was reached
    a, summary = ctrl.acceptance(), ctrl.summary()
    for j in range(6):
        if trials[j] > 1e-6 and (j == 0 or trials[j - 1] > 1e-6):
            assert a[j] == pytest.approx(min(successes[j] / trials[j], 0.999), rel=1e-6, abs=1e-6)
    np.testing.assert_allclose(ctrl._counts_of(ids)[0], accepted_by_request, rtol=1e-9, atol=1e-9)
    if totals[0]:
        assert summary["acceptance_ratio"] == pytest.approx(totals[1] / totals[0])
    assert summary["emitted_tokens"] == totals[1] + 3 * len(steps)


@given(st.lists(st.tuples(st.lists(st.booleans(), min_size=6, max_size=6),
                          st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=6, max_size=6)),
                min_size=1, max_size=30), st.integers(1, 7))
def test_requests_joining_and_leaving_fold_as_if_each_step_was_folded_at_once(steps, read_every):
    """Continuous batching: each step runs some of 6 requests (a new ids object when they change, the
    same object while they do not). Folded when read (every few steps, or past the pending limit),
    each request's accepted count equals a loop that decays a request's count at each step it takes
    part in; a request that left keeps its count. Its first steps' accepted drafts and reached
    positions (the past scales of new requests) add up until it reached ``_FIRST_REACHED`` positions."""
    from scv_jax.adaptive.controller import _FIRST_REACHED

    decay = 0.9
    ctrl = AdaptiveController(k_max=6, acceptance_decay=decay, per_request=True, min_dwell_steps=2, max_dwell_steps=3)
    pool = np.arange(6) + 1000
    reference, first, ids = np.zeros(6), np.zeros((2, 6)), None
    for i, (present, pairs) in enumerate(steps):
        rows = np.flatnonzero(present)
        if ids is None or not np.array_equal(ids, pool[rows]):
            ids = pool[rows]
        drafts = np.array([pairs[r][0] for r in rows], np.int64)
        accepted = np.array([min(pairs[r]) for r in rows], np.int64)
        ctrl.update(drafts, accepted, request_ids=ids)
        reference[rows] = decay * reference[rows] + accepted
        young = rows[first[1, rows] < _FIRST_REACHED]
        first[:, young] += np.stack([accepted, np.minimum(drafts, accepted + 1)])[:, first[1, rows] < _FIRST_REACHED]
        if i % read_every == 0:
            ctrl.next_k(max(rows.size, 1), ids)
    np.testing.assert_allclose(ctrl._counts_of(pool)[0], reference, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(ctrl._request_counts[[2, 4]][:, pool % ctrl.config.max_tracked_requests], first)


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 4), st.lists(st.booleans(), min_size=4, max_size=4))
def test_nonnegative_solve_matches_scipy_nnls(seed, rank_extra, start):
    """The cost model's active-set solver gives scipy's non-negative least squares solution from any
    starting active set (the last fit's in use)."""
    from scipy.optimize import nnls
    from scv_jax.adaptive.cost_model import _nonnegative_solve

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4 + rank_extra, 4)) * rng.uniform(0.1, 10.0, 4)
    y = rng.normal(size=4 + rank_extra)
    theta, active = _nonnegative_solve(x.T @ x, x.T @ y, start)
    reference, _ = nnls(x, y)
    assert min(theta) >= 0
    np.testing.assert_allclose(np.linalg.norm(x @ theta - y), np.linalg.norm(x @ reference - y), rtol=1e-6, atol=1e-9)
    assert all(t == 0.0 for t, free in zip(theta, active) if not free)


def _train(ctrl: AdaptiveController, ids: np.ndarray, accepts: np.ndarray, remaining, steps: int = 60) -> None:
    """Steps of a batch whose requests accept every draft (``accepts``) or none, costing 1 + 0.15 k."""
    for _ in range(steps):
        k = ctrl.next_k(ids.size, ids, remaining)
        ctrl.update(np.full(ids.size, k), np.where(accepts, k, 0), 0.01 * (1 + 0.15 * k), ids.size, ids, step_k=k)


def _decision_steps(ctrl: AdaptiveController, sizes: list[int]) -> list[int]:
    """The steps at which ``ctrl`` decided k, running one step per batch size in ``sizes`` (every
    request accepting every draft, a step costing 1 + 0.05 k)."""
    decided, choose = [], ctrl._choose_goodput

    def spy(*args):
        decided.append(step)
        return choose(*args)

    ctrl._choose_goodput = spy
    for step, batch in enumerate(sizes):
        k = ctrl.next_k(batch)
        ctrl.update(np.full(batch, k), np.full(batch, k), 0.01 * (1 + 0.05 * k), batch, step_k=k)
    return decided


def test_a_clear_choice_is_decided_again_less_often():
    """A k that keeps winning by far is decided again after 8, 16, then every 32 steps
    (``max_dwell_steps``); a new batch size decides at once and starts again from 8 steps."""
    settings = dict(allowed_k=(0, 2, 4, 8), warmup_steps=0, explore_prob=0.0, draft_model=False)
    backing_off, every_8 = AdaptiveController(**settings), AdaptiveController(**settings, max_dwell_steps=8)
    sizes = [4] * 200 + [8] * 60
    decided = {ctrl: np.array(_decision_steps(ctrl, sizes)) for ctrl in (backing_off, every_8)}
    assert backing_off.next_k(8) == every_8.next_k(8) == 8
    assert np.diff(decided[every_8]).max() == 8
    before = np.diff(decided[backing_off][decided[backing_off] < 200]).tolist()
    assert 16 in before and before[-3:] == [32, 32, 32]
    assert 200 in decided[backing_off]                       # the new batch size at once
    after = np.diff(decided[backing_off][decided[backing_off] >= 200]).tolist()
    assert after[0] <= 8 and max(after) <= 32
    assert len(decided[backing_off]) < 0.5 * len(decided[every_8])


def _per_request_decisions(batch: int, steps: int, next_ids: Callable[[int, np.ndarray], np.ndarray], *,
                           dwell: int = 1000) -> list[int]:
    """Steps at which a per-request controller decided k (otherwise every ``dwell`` steps), each step's
    requests given by ``next_ids(step, last step's ids)`` (a new ids object when they change; the
    padded batch size stays ``batch``), every request accepting every draft."""
    ctrl = AdaptiveController(per_request=True, allowed_k=(0, 2, 4, 8), warmup_steps=0, explore_prob=0.0,
                              min_dwell_steps=dwell, max_dwell_steps=dwell)
    decided, choose, step = [], ctrl._choose_goodput, 0

    def spy(*args):
        decided.append(step)
        return choose(*args)

    ctrl._choose_goodput = spy
    ids = np.arange(batch)
    for step in range(steps):
        ids = next_ids(step, ids)
        k = ctrl.next_k(batch, ids)
        ctrl.update(np.full(ids.size, k), np.full(ids.size, k), 0.01 * (1 + 0.1 * k), batch, ids, step_k=k)
    return decided


def test_a_new_batch_is_decided_again_soon_also_where_a_decision_was_due():
    """New requests replace the whole batch (same size) at a step where k was due to be decided anyway:
    k is decided then and again 2 steps later, on the new requests' first counts, as for any new batch
    (not only after the held k's full dwell)."""
    def decisions(switch_at: int | None) -> list[int]:
        return _per_request_decisions(4, 60, lambda step, ids: ids + 100 if step == switch_at else ids, dwell=8)

    due = [step for step in decisions(None) if step >= 30][0]     # a regular decision, well after the probes
    assert due in decisions(due) and due + 2 in decisions(due)


def _swap_decisions(batch: int, swaps_from: int, steps: int, *, shrink: bool = False) -> list[int]:
    """Steps at which a per-request controller decided, holding k otherwise (dwell of 1000 steps), while
    from step ``swaps_from`` one request a step makes way for a new one (``shrink``: at that step one
    leaves, none joins, and the run ends)."""
    def next_ids(step: int, ids: np.ndarray) -> np.ndarray:
        if step < swaps_from:
            return ids
        return ids[1:] if shrink else np.append(ids[1:], 1000 + step)

    return _per_request_decisions(batch, swaps_from + 1 if shrink else steps, next_ids)


def test_continuous_batching_decides_again_once_a_quarter_of_the_batch_changed():
    """Requests that joined or left since the last decision trigger a decision at once when they make
    up a quarter of the batch: at batch 8 each swap (one in, one out) and at batch 4 one request
    leaving, at batch 64 every 8th swap (each swap moves the batch's expectation by 1/64), and then
    waits for the next quarter (decided again 2 steps later only where half the batch changed)."""
    def after_swaps(*args, **kwargs):       # (the first steps decide and probe each untimed k)
        return [step for step in _swap_decisions(*args, **kwargs) if step >= 10]

    assert after_swaps(8, 10, 60) == list(range(10, 60))
    assert after_swaps(4, 10, 30, shrink=True) == [10]
    at_64 = after_swaps(64, 10, 60)
    assert at_64[0] == 17 and set(np.diff(at_64).tolist()) == {8}, at_64      # every 8 swaps
    assert after_swaps(64, 1000, 60) == []                          # no change: the dwell holds


def test_a_batch_that_runs_until_its_last_request_speculates_for_that_request():
    """Half the requests accept every draft, half none (prompt lookup with and without matches): the
    batch's tokens per second peak at k = 8, but a batch that runs until its last request is done ends
    soonest without drafts: told the remaining tokens, the controller stops drafting, and a new batch of
    unknown requests starts from past requests' spread (its poorest is likely poor), not their mean."""
    settings = dict(per_request=True, allowed_k=(0, 2, 4, 8), warmup_steps=0, explore_prob=0.0, min_dwell_steps=0)
    ids, remaining = np.arange(8), np.full(8, 500)
    goodput, static = AdaptiveController(**settings), AdaptiveController(**settings)
    _train(goodput, ids, ids < 4, None)
    _train(static, ids, ids < 4, remaining)
    assert goodput.next_k(8, ids) == 8
    assert static.next_k(8, ids, remaining) == 0
    assert static.next_k(8, ids + 100, remaining) == 0          # unknown requests
    assert goodput.next_k(8, ids + 100, remaining) == 0         # the same past, asked for the last one
    alike = AdaptiveController(**settings)
    _train(alike, ids, np.ones(8, bool), remaining)              # all alike: the last one gains too
    assert alike.next_k(8, ids, remaining) == 8


def test_new_requests_are_expected_to_start_as_past_requests_started():
    """Requests whose drafts are all rejected in their first steps and all accepted later (output that
    turns repetitive): a new batch's unknown requests are expected to start as those did (none
    accepted: no drafting pays for the request that finishes last), not to be as they ended."""
    ctrl = AdaptiveController(per_request=True, allowed_k=(0, 2, 4, 8), warmup_steps=0, explore_prob=0.0)
    ids, remaining = np.arange(4), np.full(4, 500)
    for step in range(60):
        ctrl.update(np.full(4, 4), np.full(4, 0 if step < 15 else 4), 0.01 * (1 + 0.15 * 4), 4, ids, step_k=4)

    def best_k(request_ids: np.ndarray) -> int:
        ctrl._choose_goodput(4, request_ids, remaining)
        return ctrl.config.allowed[int(np.argmax(ctrl._decision_objective))]

    assert best_k(ids) == 8                 # these requests now accept every draft
    assert best_k(ids + 100) == 0


def test_a_plausible_k_never_timed_at_a_batch_size_is_tried_once():
    """A k never timed at a batch size has only an extrapolated cost there: if its objective is within
    ``_PROBE_FLOOR`` of the best it is tried (once it is timed, never again as a probe), so a k the
    extrapolation undersells is still measured; a k predicted far worse is not."""
    from scv_jax.adaptive.controller import _PROBE_FLOOR

    ctrl = AdaptiveController(allowed_k=(0, 2, 4, 8), warmup_steps=0, explore_prob=0.0)
    tried = 0
    for batch in (4, 16):
        probes = []
        for _ in range(16):
            k = ctrl.next_k(batch)
            if ctrl.state()["explored"]:
                objective = ctrl._decision_objective
                i = ctrl._allowed_list.index(k)
                probes.append(k)
                assert ctrl._table.counts(batch)[i] < 1.0 and objective[i] >= _PROBE_FLOOR * max(objective)
            ctrl.update(np.full(batch, k), np.full(batch, min(k, 1)), 0.01 * (1 + 0.1 * k), batch, step_k=k)
        assert probes and len(set(probes)) == len(probes)       # each tried once
        tried += len(probes)
    assert ctrl.summary()["explored_steps"] == tried            # no exploration but the probes


def test_shrunk_scales_keep_real_differences_and_drop_noise():
    """Per-request scales shrink toward the batch's mean by their noise: requests alike with Poisson
    noise end up nearly equal (the least is not just the unluckiest), two real groups stay apart."""
    ctrl = AdaptiveController(per_request=True)
    rng = np.random.default_rng(0)
    expected = np.full(64, 30.0)
    alike = np.stack([rng.poisson(21.0, 64).astype(float), expected])          # one true scale, 0.7
    assert ctrl._shrunk_scales(alike).std() < 0.3 * ctrl._scales(alike).std()
    groups = np.stack([np.where(np.arange(64) < 32, 3.0, 27.0), expected])     # true scales 0.1 and 0.9
    shrunk = ctrl._shrunk_scales(groups)
    assert shrunk[:32].max() < 0.3 and shrunk[32:].min() > 0.7


def test_counterfactual_counts_at_k0_steps_free_a_controller_holding_k0():
    """Regression (the k = 0 trap): after requests that accept nothing, a new batch that would accept
    every draft starts at k = 0 (its requests are unknown, past requests were poor) and, drafting
    nothing, shows otherwise only when its estimates have drifted back to the prior. Told at k = 0
    steps what unverified proposals would have had accepted (``SpeculativeDecoder`` does so for n-gram
    drafting), the controller drafts again within a few proposals, well before a controller told
    nothing. Counterfactual counts are no drafted or emitted tokens in the summary."""
    settings = dict(per_request=True, allowed_k=(0, 2, 4, 8), warmup_steps=0, explore_prob=0.0, min_dwell_steps=4,
                    draft_model=False)
    poor, good, remaining = np.arange(4), np.arange(4) + 100, np.full(4, 500)
    told, silent = AdaptiveController(**settings), AdaptiveController(**settings)
    before, accepted, chosen = {}, {told: 0, silent: 0}, {told: [], silent: []}
    for ctrl in (told, silent):
        _train(ctrl, poor, np.zeros(4, bool), remaining, steps=30)
        assert ctrl.next_k(4, poor, remaining) == 0
        before[ctrl] = ctrl.summary()
    for step in range(40):
        for ctrl in (told, silent):
            k = ctrl.next_k(4, good, remaining)
            chosen[ctrl].append(k)
            if k:       # the requests accept every draft
                ctrl.update(np.full(4, k), np.full(4, k), 0.01 * (1 + 0.15 * k), 4, good, step_k=k)
                accepted[ctrl] += 4 * k
            else:       # a proposal checked every 4 steps, each of its 8 drafts matched
                counterfactual = np.full(4, 8 if ctrl is told and step % 4 == 3 else 0)
                ctrl.update(counterfactual, counterfactual, 0.01, 4, good, step_k=0)
    first_drafting = {ctrl: next(step for step, k in enumerate(ks) if k) for ctrl, ks in chosen.items()}
    assert first_drafting[told] <= 12                          # within 3 proposals
    assert first_drafting[silent] >= first_drafting[told] + 8  # only by drifting back to the prior
    assert chosen[told][-1] == 8
    for ctrl in (told, silent):    # emitted: a token per request and step, and the drafts accepted
        summary = ctrl.summary()
        assert summary["emitted_tokens"] - before[ctrl]["emitted_tokens"] == 4 * 40 + accepted[ctrl]


@given(st.lists(st.floats(-5.0, 5.0), min_size=1, max_size=9), st.integers(0, 2 ** 32 - 1))
def test_nondecreasing_fit_matches_scipy_isotonic_regression(values, seed):
    """The cost table's monotone fit (costs never fall as k grows) is the weighted isotonic regression."""
    from scipy.optimize import isotonic_regression
    from scv_jax.adaptive.cost_model import _nondecreasing

    weights = np.random.default_rng(seed).uniform(0.1, 10.0, len(values))
    fit = _nondecreasing(values, weights.tolist())
    np.testing.assert_allclose(fit, isotonic_regression(values, weights=weights).x, rtol=1e-9, atol=1e-9)


def test_a_larger_k_timed_cheaper_is_pooled_with_its_neighbours():
    """One timing of k = 4 on a quiet machine below k = 2's (XLA:CPU's noise): the table's costs never
    fall as k grows, and a monotone row is left as measured."""
    ctrl = AdaptiveController(allowed_k=(0, 2, 4, 8), draft_model=False)
    table = ctrl._table
    for _ in range(10):
        for k, seconds in ((0, 0.010), (2, 0.013), (8, 0.020)):
            table.observe(4, k, step_features(4, 4 * k, 0), seconds)
    monotone = table.relative(4)
    table.observe(4, 4, step_features(4, 16, 0), 0.008)
    costs = table.relative(4)
    assert all(a <= b for a, b in zip(costs, costs[1:]))
    assert costs[1] == costs[2] and costs[3] == pytest.approx(monotone[3], rel=0.05)
    assert monotone[1] < monotone[2] < monotone[3]


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 40))
def test_queued_step_timings_apply_in_order_at_the_next_read(seed, steps):
    """A decoding step only queues its timing (``StepCostTable.observe``); the next read applies the queue
    in order: the same costs, counts, load and timed seconds as applying each timing when it came, with
    outliers (a step 50x slower: a compile) skipped alike."""
    rng = np.random.default_rng(seed)
    tables = [AdaptiveController(allowed_k=(0, 2, 4, 8), draft_model=False)._table for _ in range(2)]
    for _ in range(steps):
        batch, k = int(rng.choice([1, 4])), int(rng.choice([0, 2, 4, 8]))
        seconds = 0.01 * (1 + 0.1 * k) * rng.uniform(0.8, 1.2) * (50.0 if rng.random() < 0.1 else 1.0)
        for table in tables:
            table.observe(batch, k, step_features(batch, batch * k, 0), seconds)
        tables[0].flush()
    assert tables[1]._queue and not tables[0]._queue
    for batch in (1, 4):
        assert tables[0].relative(batch) == tables[1].relative(batch)
        assert tables[0].counts(batch) == tables[1].counts(batch)
    assert tables[0].load == tables[1].load and tables[0].timed_seconds == tables[1].timed_seconds > 0
    with pytest.raises(ValueError, match="step_seconds"):
        tables[0].observe(4, 2, step_features(4, 8, 0), float("nan"))
