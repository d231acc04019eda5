"""Paged attention for speculative verification: queries attend to the paged KV cache (through block
tables), the staging buffer of in-flight tokens and the new tokens themselves (causally)."""
