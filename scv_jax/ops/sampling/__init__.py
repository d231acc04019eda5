"""Sampling: a request's target distribution after temperature, top-k, top-p and min-p (one-hot of
the argmax for greedy rows), and the log-probabilities of emitted tokens."""
