"""Token trees: greedy and lossless-sampling acceptance of a draft tree, and the commit slots of its accepted path."""
