"""The byte-level demo models: training script (``python -m scv_jax.demo.train``) and shipped weights."""

# the end-to-end benchmark's workloads (``scv_jax.demo.e2e``); here, so the CLI names them without importing jax
WORKLOADS = ("stdlib", "mixed", "stream")
