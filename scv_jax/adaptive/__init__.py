"""Choosing the speculation length k: the adaptive controller and its online step-cost model."""
