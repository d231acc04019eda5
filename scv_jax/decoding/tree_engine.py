"""The host side of a tree decoder's step (``DecoderConfig.tree``), ``Engine._decode``'s tree form: each
request's depth cap (its budget), the n-gram tries or the draft model's tree (inside the step), one call of
the tree step executable (``tree_step``), one fetch of its summary, then the tokens appended as for chains."""

from __future__ import annotations

import time

import numpy as np

from scv_jax.decoding.device_step import SamplingColumn
from scv_jax.decoding.ngram_trie import propose_tries, trie_grid
from scv_jax.decoding.step_inputs import decode_inputs
from scv_jax.decoding.tree_step import tree_lag_after_step


def decode_tree_step(engine) -> list:
    """One tree decode step of ``engine``'s running batch; returns its ``RequestOutput``s."""
    step_start = time.perf_counter()
    d, state, stats, tree = engine.decoder, engine._batch, engine.stats, engine.config.tree
    rows = state.active
    requests = [engine._running[row] for row in rows.tolist()]
    layout = d.placement.rows(state.shards[rows], d._decode)
    greedy = not state.sampling[rows, SamplingColumn.TEMPERATURE].any()
    caps = np.minimum(state.budget[rows] - 1, tree.max_depth)      # never accept past a request's budget
    tries = None
    if d.drafter is not None:
        tries = propose_tries([r.ngram for r in requests], tree.max_nodes, caps)
        num_drafts = np.array([t.depth for t in tries], np.int64)          # the depth each request offers
        step_k = d._step_k(max(len(t.tokens) for t in tries))
    else:
        num_drafts = caps
        step_k = d._step_ks[-1] if caps.max(initial=0) > 0 else 0
    if d._draft is not None and step_k and state.may_lag:
        engine._catch_up(rows)
    state.ensure(rows, state.length[rows] + caps)
    width = int(state.num_blocks[rows].max())
    planning = time.perf_counter()
    plan = d._decode_plan(layout.size, width, step_k, greedy, layout.scattered)
    size = plan.padded["batch"] or layout.size
    step_start += time.perf_counter() - planning     # a shape's one-off planning is no step cost
    inputs = decode_inputs(state, rows, layout.rows, size, plan.padded["blocks"] or width, caps)
    if tries is not None:
        inputs["drafts"] = trie_grid(tries, layout.rows, size, step_k)
    dispatch = time.perf_counter()
    (summary,) = d._run(d._decode, stats, use_draft=d._draft is not None and step_k > 0, plan=plan, **inputs)
    host, _ = layout.fetch(summary)                   # the step's one device-to-host transfer
    cold = d._decode.last_call_first_run
    fetched = time.perf_counter()
    appended, done, stopped = state.advance(rows, host.output_token_ids, host.num_emitted, host.num_accepted, step_k)
    if d._draft is not None and step_k:
        state.lag[rows] = tree_lag_after_step(host.num_accepted)
    outputs = engine._outputs(requests, appended, done, stopped, np.minimum(num_drafts, caps), host.num_accepted,
                              None)
    engine.tally.add(np.minimum(num_drafts, caps), host.num_accepted, host.num_emitted)
    stats.add_step(layout.computed, step_k, None if cold else fetched - step_start + time.perf_counter() - fetched,
                   dispatch - step_start + time.perf_counter() - fetched)
    if done.any():
        engine._end(rows[done].tolist())
    return outputs
