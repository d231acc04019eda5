"""The ops: each folder holds one op's public API (with dispatch), its pure-JAX reference and the arithmetic
it shares with its Pallas kernels; ``registry`` is the one table of implementations."""
