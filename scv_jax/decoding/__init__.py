"""The decoding loop: host loop, device step, block pool and statistics."""
