"""Acceptance: greedy exact match and lossless rejection sampling over a ragged draft batch."""
