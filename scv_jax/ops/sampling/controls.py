"""Per-request logit controls as vLLM applies them before the temperature and the filters
(``filtered_probs``): an additive bias (OpenAI's ``logit_bias``, and -inf on masked tokens:
``allowed_token_ids``, ``bad_words``, stop tokens before ``min_tokens``), then the repetition,
frequency and presence penalties over a token history. Pure JAX over rows; the decode step calls it
on every position it verifies or drafts, with that position's history (``scv_jax.decoding.device_step``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def controlled_logits(logits: jax.Array, bias: jax.Array, output_counts: jax.Array, in_prompt: jax.Array,
                      presence: jax.Array, frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """float32[R, V]: ``logits`` + ``bias``, then vLLM's penalties.

    A token seen in the prompt or the output (``in_prompt`` or ``output_counts`` > 0) has its logit
    divided by ``repetition`` where positive, multiplied by it otherwise; then ``frequency`` times its
    output count and ``presence`` (if it is in the output) are subtracted. Neutral values (bias 0,
    penalties 0, 0, 1) give the logits as they are (as float32); -inf stays -inf.

    Args:
      logits: float[R, V]; bias: float32[R, V] (-inf masks a token).
      output_counts: int[R, V] each token's count in the output so far; in_prompt: bool[R, V].
      presence, frequency: float32[R] in [-2, 2]; repetition: float32[R] > 0.
    """
    x = logits.astype(jnp.float32) + bias
    counts = output_counts.astype(jnp.float32)
    seen = in_prompt | (output_counts > 0)
    divisor = jnp.where(seen, repetition[:, None], 1.0)
    x = jnp.where(x > 0, x / divisor, x * divisor)
    return x - frequency[:, None] * counts - jnp.where(output_counts > 0, presence[:, None], 0.0)
