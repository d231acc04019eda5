"""Pallas GPU kernels of scv-jax (Mosaic GPU). Public entry points live in ``scv_jax``; the
functions here take already-validated, already-normalised arrays."""
