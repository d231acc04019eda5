"""Running the decoder on a ``jax.sharding.Mesh`` with axes ("data", "model"): the mesh and its
per-shard seams (``mesh``) and Megatron-style tensor parallelism of ``scv_jax.models.Transformer``
(``params``)."""
