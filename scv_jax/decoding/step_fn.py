"""The decode step: one straight sequence of stages inside one executable, the same for every k and
every verifier (``chain_verifier.ChainVerifier``: chains of drafts; ``tree_verifier.TreeVerifier``: token
trees):

0. ``step_inputs``: the per-request row int32[B, StepRow.WIDTH] unpacked once (``StepInputs``: lag,
   context lengths, num_drafts / depth caps, the last MAX_CATCH_UP tokens, the draft's lag tokens and
   length, the random keys [B], stop ids [B, MAX_STOP_IDS], the request mask, and with a control state
   the requests' ``LogitControls``: penalties, biases, masks, min_tokens, applied to the draft's and
   the target's logits at each position with the drafts before it in the history).
1. ``propose``: the drafts, from host ``drafts`` (chain int32[B, k], tree int32[B, 2, k]) or from the draft
   model (a chain of k, or a tree of k nodes); with k = 0 nothing runs.
2. ``score``: the target's forward over the pending token and the proposal, over its cache.
3. ``accept``: the acceptance (greedy, or lossless rejection sampling on each request's filtered target
   distribution) and the commit of the target's K/V for the pending token and the accepted tokens.
4. ``commit_draft``: the draft's K/V of its lag tokens and the accepted drafts it ran.
5. with a control state: the emitted tokens counted in the controlled requests' histories (and their
   last tokens, for the bad words, moved along).
6. with a carry (one step in flight, ``decoding.carry``): the rows the host marked ``StepRow.CARRIED``
   are moved on by the step before (before stage 0), and what this step did is written for the next.

A step may be split in two calls (structured output with chains drafted on the device: ``draft_only``, the
proposal, then the rest of the step given that ``proposal``), the host masking the drafts in between.
A k = 0 step (plain autoregressive decoding: the pending token scored, the next one chosen) is the chain
verifier's for every verifier. No cache receives a rejected token's K/V. The host then fetches the step's
``StepSummary`` and adapts k. Positions: ``scv_jax.decoding.positions``.
"""

from __future__ import annotations

import jax.numpy as jnp

from scv_jax.decoding.carry import LagRule, carried_inputs, carry_after_step
from scv_jax.decoding.device_step import ControlState, DraftAutomaton, SplitModel, step_inputs
from scv_jax.decoding.plan import MAX_CATCH_UP
from scv_jax.decoding.positions import lag_after_step
from scv_jax.decoding.verifiers import Verifier
from scv_jax.ops.sampling.api import token_logprobs
from scv_jax.sampling_params import MAX_LOGPROBS



def _check(verifier: Verifier, drafts, draft_params, controls, grammar, *, k: int, logprobs: bool,
           packed_k: int) -> None:
    """The step's arguments, checked while tracing (one-line ValueErrors naming the argument)."""
    verifier.check(k=k, logprobs=logprobs, packed_k=packed_k)
    if grammar is not None:
        words = None if controls is None else (controls.bias.shape[1] + 31) // 32
        if controls is None or grammar.dtype != jnp.int32 or grammar.shape[1:] != (k + 1, words):
            raise ValueError(f"decode_step: grammar must be int32[B, k + 1, ceil(V / 32)] with controls given "
                             f"(k={k}, words={words}), got {grammar.dtype}{list(grammar.shape)}")
    if k and drafts is None and draft_params is None:
        raise ValueError("decode_step: k > 0 needs draft_params (a draft model) or drafts")
    if drafts is not None and draft_params is not None:
        raise ValueError("decode_step: give either draft_params (a draft model) or drafts (host drafts), not both")
    if drafts is not None and tuple(drafts.shape[1:]) != verifier.drafts_shape(k):
        shape = ", ".join(map(str, verifier.drafts_shape(k)))
        raise ValueError(f"{verifier.name} decode_step: drafts must be int32[B, {shape}] (k={k}), "
                         f"got shape {drafts.shape}")


def _check_split(verifier: Verifier, draft_params, controls, proposal, draft_tables, draft_states, *, k: int,
                 draft_only: bool) -> None:
    """A split step's arguments (``draft_only``, ``proposal``), checked while tracing."""
    if (draft_only or proposal is not None) and not (k and draft_params is not None and verifier.name == "chain"):
        raise ValueError(f"decode_step: draft_only and proposal need a drafter's chain step at k > 0 "
                         f"(verifier {verifier.name!r}, k={k}, draft_params given: {draft_params is not None})")
    if draft_only and proposal is not None:
        raise ValueError("decode_step: a draft_only step makes the proposal; give proposal to the step after it")
    if draft_tables is not None and (controls is None or draft_states is None or proposal is not None
                                     or not (k and draft_params is not None and verifier.name in ("chain", "tree"))
                                     or draft_only and verifier.name != "chain"):
        raise ValueError("decode_step: draft_tables need controls, draft_states and a drafter's chain or tree "
                         "step at k > 0 that makes its proposal (draft_only: a chain)")


def make_decode_step(target: SplitModel, draft: SplitModel | None, block_size: int, verifier: Verifier,
                     lag_rule: LagRule | None = None, max_lag: int = MAX_CATCH_UP):
    """``decode_step(...)``: one speculative step verified by ``verifier`` (plain autoregressive decoding at
    k = 0); ``lag_rule``, ``max_lag``: the proposer's ``lag_after_step`` and ``max_lag``, what a step
    given a ``carry`` writes as each request's lag (None: the chain rule, ``positions.lag_after_step``)."""
    lag_rule = lag_rule or lag_after_step

    def decode_step(target_params, draft_params, target_cache, draft_cache, block_tables, rows, sampling,
                    drafts=None, request_mask=None, controls: ControlState | None = None, grammar=None,
                    carry=None, proposal=None, draft_tables=None, draft_states=None, *, k: int,
                    greedy: bool,
                    logprobs: bool = False, backend: str = "auto", packed_k: int = 0, draft_only: bool = False):
        """One decoding step of B requests (see ``scv_jax.decoding.positions``).

        Args:
          target_params, draft_params: the models' parameter leaves (``SplitModel.split``);
            draft_params None: no draft model runs (k = 0, or given ``drafts``).
          block_tables: int32[B, max_blocks] (-1 = none); shared by both caches.
          rows: int32[B, StepRow.WIDTH] per request: its draft lag, target context length, number of
            drafts to verify (chain: the first ones, in [0, k], cut after a draft that is a stop id;
            tree: its depth cap), random stream, stop ids and last MAX_CATCH_UP tokens (``StepRow``).
          sampling: float32[B, SamplingColumn.WIDTH] each request's temperature (0 = greedy), top-k,
            top-p and min-p (unused when ``greedy``), penalties, tokens before a stop may come
            (``min_tokens``) and whether its row of ``controls`` counts.
          drafts: drafts proposed on the host (chain: int32[B, k] n-gram drafts; tree: int32[B, 2, k]
            node tokens then parents), or None (the draft model's; ignored at k = 0).
          request_mask: bool[B], False = padding.
          controls: the decoder's ``ControlState`` (donated; request b's row ``StepRow.SLOT``), or None:
            no logit controls (penalties, biases, masks, min_tokens).
          grammar: int32[B, k + 1, ceil(V / 32)] structured output's token masks at each position
            (``LogitControls.grammar``; needs ``controls``), or None.
          carry: int32[slots, CarryColumn.WIDTH] (donated; ``decoding.carry``): the rows marked
            ``StepRow.CARRIED`` are moved on by it first, and the step's own effect is written back; or None.
          k: drafts computed per request (static; a tree's node count); greedy: every request greedy
            (static: the argmax fused into the acceptance; False verifies each request against its
            filtered distribution).
          logprobs: also return the log-probabilities of the emitted tokens and the top MAX_LOGPROBS
            (at most V; static; dense chain steps only).
          packed_k: 0 (a dense [B, k + 1] target forward) or in [1, k): the target scores B *
            (packed_k + 1) tokens packed (``chain_verifier.score_packed``), at most B * packed_k drafts in
            all (static; chain steps only; the last requests' ``num_drafts`` are cut to fit).
          draft_only: only draft (stage 1; static): return the caches as they are and the proposal
            (the verifier's, ``Verifier.passed``) in the summary's place: a step split in
            two so that the host masks the drafts with the grammar before they are verified; the second
            call takes it as ``proposal`` and verifies it at the ``num_drafts`` the host kept.
          draft_tables, draft_states: the drafting automata of constrained requests
            (``grammar_automaton.DraftTables.arrays``: int32[S, C] next states, int32[G, V] token
            classes; int32[B, 2] each request's automaton and state, -1: none), or None: their drafts
            (a chain's or a tree's) follow them, and unless ``draft_only`` the target's logits at each
            position (node) take their masks too (the host then checks those masks against the
            grammar's: ``Scheduler.update``).
        Returns:
          (target_cache, draft_cache, ``StepSummary``), with ``logprobs`` then ``TokenLogprobs`` of the
          [B, k + 1] emitted tokens (-inf past each request's last; of the target's raw logits, as
          vLLM's), with ``controls`` then the ``ControlState`` with the emitted tokens recorded, with
          ``carry`` then the carry with this step's requests written.
        """
        _check(verifier, drafts, draft_params, controls, grammar, k=k, logprobs=logprobs, packed_k=packed_k)
        _check_split(verifier, draft_params, controls, proposal, draft_tables, draft_states, k=k,
                     draft_only=draft_only)
        if carry is not None:
            rows, sampling, block_tables = carried_inputs(carry, rows, sampling, block_tables)
        stages = verifier.stages(k)
        automaton = None if draft_tables is None else DraftAutomaton(*draft_tables, draft_states[:, 0],
                                                                     draft_states[:, 1])
        inputs = step_inputs(rows, request_mask, sampling, controls, grammar, automaton)
        draft_model = None if draft_params is None or not (k or stages.every_step) else draft.merge(draft_params)
        if proposal is None:
            proposal = stages.propose(draft_model, drafts if k else None, draft_cache, block_tables, inputs,
                                      sampling, k=k, greedy=greedy, backend=backend)
        else:
            proposal = stages.received(proposal, draft_model)
        if draft_only:
            return (target_cache, draft_cache, stages.passed(proposal)) + \
                ((controls,) if controls is not None else ()) + ((carry,) if carry is not None else ())
        if automaton is not None:       # verified with the automata's masks (the host checks them after)
            along = automaton.along_tree(proposal.tokens, proposal.parents) if verifier.name == "tree" \
                else automaton.along_drafts(proposal.tokens)
            inputs = inputs._replace(controls=inputs.controls._replace(automaton=along))
        scored = stages.score(target.merge(target_params), target_cache, block_tables, inputs, proposal, k=k,
                              packed_k=packed_k, backend=backend)
        target_cache, summary, result = stages.accept(target_cache, scored, proposal, inputs, sampling, block_tables,
                                                      block_size=block_size, greedy=greedy, backend=backend)
        draft_cache = stages.commit_draft(draft_cache, proposal, scored, result, block_tables, inputs,
                                          block_size=block_size, backend=backend)
        outputs = [target_cache, draft_cache, summary]
        if logprobs:        # a dense chain step's [B, k + 1] logits (the verifier refuses the others)
            num_top = min(MAX_LOGPROBS, scored.output.logits.shape[-1])
            outputs.append(token_logprobs(scored.output.logits, summary.packed[:, :k + 1], num_top))
        if controls is not None:
            outputs.append(controls.record(inputs.controls, inputs.slots, summary.packed[:, :-3]))
        if carry is not None:
            outputs.append(carry_after_step(carry, rows, summary.packed, inputs.request_mask, lag_rule, k, max_lag))
        return tuple(outputs)

    return decode_step
