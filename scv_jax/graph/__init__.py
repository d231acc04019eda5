"""Graph mode: shape buckets and a cache of ahead-of-time compiled executables."""
