"""``tree_lag_after_step`` where ``tree_engine`` imports it; the tree decode step is ``step_fn.make_decode_step``
with ``verifiers.TreeVerifier``."""

from scv_jax.decoding.verifiers import tree_lag_after_step

__all__ = ["tree_lag_after_step"]
