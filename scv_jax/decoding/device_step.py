"""Device side of the decoding loop: the prefill and decode-step functions (traced by graph mode).

Per request, between steps: the target cache holds positions [0, n - 1) of its n tokens (the last
token is *pending*), the draft cache holds [0, n - catch_up) with catch_up in {1, 2} (2 after a step
that accepted every draft: the draft never ran its last draft token). A step with k drafts:

1. draft: one forward over the catch-up tokens (right-padded to 2), then k - 1 one-token forwards,
   each reading the draft's committed cache plus a staging buffer of the step's earlier tokens;
2. target: one forward over [pending, d_1 .. d_k], reading its cache plus the tokens themselves;
3. acceptance + commit of the target's accepted K/V (``verify_step``, query layout), and commit of the
   draft's staged K/V up to the last accepted token: no write on reject, in both caches.

With k = 0 the draft still runs its catch-up forward (so its cache never goes stale) and the target
decodes one token. Without a draft model the step is plain autoregressive decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scv_jax.ops.commit.api import commit_draft_kv, slots_from_block_table
from scv_jax.models.protocol import StagedKV
from scv_jax.verify.step import verify_step
from scv_jax.verify.summary import StepSummary

# fold_in tags of a request's per-step key
_ACCEPT, _BONUS, _DRAFT = 0, 1, 2


def request_keys(base_key: jax.Array, request_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """[B] typed keys: ``fold_in(fold_in(key, request id), position)``; independent of the batch."""
    base = jax.random.wrap_key_data(base_key)
    return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(base, r), p))(
        request_ids.astype(jnp.uint32), positions.astype(jnp.uint32))


def _tagged(keys: jax.Array, tag: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, tag))(keys)


def choose_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, greedy: bool):
    """Next tokens from float[B, V] logits: argmax (probs None) or a sample with its probs [B, V]."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    scaled = logits / temperature
    tokens = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return tokens, jax.nn.softmax(scaled, axis=-1)


def _flatten_rows(x: jax.Array) -> jax.Array:
    """[layers, B, T, ...] -> [layers, B * T, ...]."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _commit_rows(cache, keys, values, block_tables, first_position, num_rows, block_size, backend, *,
                 after: jax.Array):
    """Commits rows t < num_rows[b] of [layers, B, T, ...] K/V at positions first_position[b] + t.

    ``after`` (e.g. the logits) orders the write after every read of the cache: without that data
    dependence XLA copies the donated cache instead of updating it in place.
    """
    num_rows, _ = jax.lax.optimization_barrier((num_rows, after))
    num_tokens = keys.shape[2]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    slots = slots_from_block_table(block_tables, first_position[:, None] + t, block_size).reshape(-1)
    mask = (t[None, :] < num_rows[:, None]).reshape(-1)
    keys, values = _flatten_rows(keys), _flatten_rows(values)
    if slots.shape[0] == 1:
        # XLA:CPU rewrites a one-row scatter into a dynamic-update-slice that copies the whole
        # (donated) cache twice; a second, skipped row keeps it an in-place scatter.
        slots, mask = jnp.pad(slots, (0, 1), constant_values=-1), jnp.pad(mask, (0, 1))
        keys, values = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (keys, values))
    return commit_draft_kv(cache, keys, values, slots, mask, backend=backend)


def make_prefill_step(target_graphdef, draft_graphdef, block_size: int):
    """``prefill_step(...)``: runs a chunk of prompt tokens through both models and commits it."""

    def prefill_step(target_state, draft_state, target_cache, draft_cache, block_tables, tokens, start,
                     count, request_mask=None, *, backend: str = "auto"):
        """tokens int32[B, C] at positions start[b] + t; rows t < count[b] of masked-in requests commit."""
        if request_mask is not None:
            count = jnp.where(request_mask, count, 0)
        models = [(target_graphdef, target_state, target_cache)]
        if draft_state is not None:
            models.append((draft_graphdef, draft_state, draft_cache))
        caches = []
        for graphdef, state, cache in models:
            out = nnx.merge(graphdef, state).forward_paged(tokens, cache, block_tables, start)
            caches.append(_commit_rows(cache, out.keys, out.values, block_tables, start, count,
                                       block_size, backend, after=out.logits))
        return caches[0], (caches[1] if draft_state is not None else draft_cache)

    return prefill_step


def _draft_propose(model, cache, block_tables, last_tokens, catch_up, context_lens, keys, temperature, *,
                   k: int, greedy: bool):
    """Catch-up forward then k - 1 draft forwards (a scan).

    Returns drafts int32[B, k], their probs [B, k, V] (None when greedy) and the staging buffer
    (keys, values [layers, B, max(k + 1, 2), kv_heads, head_dim]; entry s is position context_lens + s).
    """
    out = model.forward_paged(last_tokens, cache, block_tables, context_lens)
    num_layers, batch = out.keys.shape[:2]
    stage_shape = (num_layers, batch, max(k + 1, 2), *out.keys.shape[3:])
    stage_k = jnp.zeros(stage_shape, out.keys.dtype).at[:, :, :2].set(out.keys)
    stage_v = jnp.zeros(stage_shape, out.values.dtype).at[:, :, :2].set(out.values)
    if k == 0:
        return None, None, stage_k, stage_v
    logits = jnp.take_along_axis(out.logits, (catch_up - 1)[:, None, None], axis=1)[:, 0]
    first, first_probs = choose_tokens(logits, _tagged(keys, _DRAFT), temperature, greedy)
    rows = jnp.arange(batch)

    def one_draft(carry, j):
        stage_k, stage_v, lengths, token = carry
        o = model.forward_paged(token[:, None], cache, block_tables, context_lens,
                                StagedKV(stage_k, stage_v, lengths))
        stage_k = stage_k.at[:, rows, lengths].set(o.keys[:, :, 0])
        stage_v = stage_v.at[:, rows, lengths].set(o.values[:, :, 0])
        nxt, probs = choose_tokens(o.logits[:, 0], _tagged(keys, _DRAFT + j), temperature, greedy)
        return (stage_k, stage_v, lengths + 1, nxt), (nxt, probs)

    (stage_k, stage_v, _, _), (rest, rest_probs) = jax.lax.scan(
        one_draft, (stage_k, stage_v, catch_up, first), jnp.arange(1, k))
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
    probs = None if greedy else jnp.concatenate([first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)],
                                                axis=1)
    return drafts, probs, stage_k, stage_v


def make_decode_step(target_graphdef, draft_graphdef, block_size: int):
    """``decode_step(...)``: one speculative step (or one autoregressive step without a draft)."""

    def decode_step(target_state, draft_state, target_cache, draft_cache, block_tables, last_tokens,
                    catch_up, target_lens, request_ids, base_key, temperature, request_mask=None, *,
                    k: int, greedy: bool, backend: str = "auto"):
        """One decoding step of B requests.

        Args:
          block_tables: int32[B, max_blocks] (-1 = none); shared by both caches.
          last_tokens: int32[B, 2] the tokens the draft has not run (catch_up of them, left-aligned);
            the pending token is last_tokens[b, catch_up[b] - 1].
          catch_up: int32[B] in {1, 2}; target_lens: int32[B] tokens in the target cache (= n - 1).
          request_ids: int32[B] ids seeding each request's random stream; base_key: uint32[2] key data.
          temperature: float32 scalar (unused when greedy); request_mask: bool[B], False = padding.
          k: drafts per request (static); greedy: argmax decoding (static).
        Returns:
          (target_cache, draft_cache, summary int32[B, k + 2]): emitted tokens (-1 after the last)
          and, in the last column, the number of accepted drafts.
        """
        batch = last_tokens.shape[0]
        if request_mask is None:
            request_mask = jnp.ones((batch,), jnp.bool_)
        keys = request_keys(base_key, request_ids, target_lens)
        pending = jnp.take_along_axis(last_tokens, (catch_up - 1)[:, None], axis=1)[:, 0]
        draft_lens = target_lens + 1 - catch_up
        drafts = draft_probs = None
        if draft_state is not None:
            drafts, draft_probs, stage_k, stage_v = _draft_propose(
                nnx.merge(draft_graphdef, draft_state), draft_cache, block_tables, last_tokens, catch_up,
                draft_lens, keys, temperature, k=k, greedy=greedy)
        elif k:
            raise ValueError("decode_step: k > 0 needs a draft model")
        tokens = pending[:, None] if k == 0 else jnp.concatenate([pending[:, None], drafts], axis=1)
        out = nnx.merge(target_graphdef, target_state).forward_paged(tokens, target_cache, block_tables,
                                                                     target_lens)
        if k == 0:
            token, _ = choose_tokens(out.logits[:, 0], _tagged(keys, _BONUS), temperature, greedy)
            target_cache = _commit_rows(target_cache, out.keys, out.values, block_tables, target_lens,
                                        request_mask.astype(jnp.int32), block_size, backend, after=token)
            num_accepted = jnp.zeros((batch,), jnp.int32)
            summary = StepSummary.pack(jnp.where(request_mask, token, -1)[:, None], num_accepted)
        else:
            positions = target_lens[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
            slots = slots_from_block_table(block_tables, positions, block_size).reshape(-1)
            cu = jnp.arange(batch + 1, dtype=jnp.int32) * k
            bonus_logits = out.logits[:, k]
            if greedy:
                target_ids = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
                sampling = dict(target_token_ids=target_ids[:, :k].reshape(-1))
                bonus = target_ids[:, k]
            else:
                bonus, _ = choose_tokens(bonus_logits, _tagged(keys, _BONUS), temperature, greedy)
                target_probs = jax.nn.softmax(out.logits[:, :k] / temperature, axis=-1)
                sampling = dict(target_probs=target_probs.reshape(batch * k, -1),
                                draft_probs=draft_probs.reshape(batch * k, -1), key=_tagged(keys, _ACCEPT))
            target_cache, result = verify_step(
                target_cache, _flatten_rows(out.keys), _flatten_rows(out.values), slots, drafts.reshape(-1),
                cu, bonus, request_mask=request_mask, max_spec_len=k, kv_layout="query", backend=backend,
                **sampling)
            num_accepted, summary = result.num_accepted, result.summary
        if draft_state is not None:
            committed = catch_up + (jnp.minimum(num_accepted, k - 1) if k else 0)
            draft_cache = _commit_rows(draft_cache, stage_k, stage_v, block_tables, draft_lens,
                                       jnp.where(request_mask, committed, 0), block_size, backend,
                                       after=summary.packed)
        return target_cache, draft_cache, summary

    return decode_step
