"""The byte-level demo models: training script (``python -m scv_jax.demo.train``) and shipped weights."""
