"""``TreeConfig``: the shape of the token trees a tree decoder verifies per request per step."""

from __future__ import annotations

import dataclasses

import numpy as np


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Token trees (``DecoderConfig(tree=TreeConfig(...))``); every field is checked on construction.

    Attributes:
      max_depth: the most nodes on a root-to-leaf path (the most drafts a step accepts), >= 1.
      branching: a draft model's tree: the children each expanded node gets (the draft's top
        ``branching`` tokens) and the frontier nodes expanded per level (EAGLE-2); the n-gram trie
        ignores it. >= 1.
      max_nodes: the most nodes a tree holds (the target scores ``max_nodes + 1`` tokens per request),
        in [max_depth, 1024].
    """

    max_depth: int = 4
    branching: int = 4
    max_nodes: int = 16

    def __post_init__(self):
        for name, low, high in (("max_depth", 1, 64), ("branching", 1, 64), ("max_nodes", self.max_depth, 1024)):
            value = getattr(self, name)
            if not _is_int(value) or not low <= value <= high:
                raise ValueError(f"TreeConfig.{name} must be an int in [{low}, {high}], got {value!r}")

    @property
    def pool_size(self) -> int:
        """The candidates a draft model's expansion makes: ``branching`` children of the root, then
        ``branching ** 2`` per further level."""
        return self.branching + (self.max_depth - 1) * self.branching ** 2

    def draft_nodes(self) -> int:
        """A draft model's tree size: ``max_nodes``, or fewer when the expansion makes fewer candidates."""
        return min(self.max_nodes, self.pool_size)

    def node_buckets(self) -> tuple[int, ...]:
        """The n-gram trie's node counts steps are padded to: powers of two below ``max_nodes``, and it."""
        return tuple(sorted({1 << i for i in range(self.max_nodes.bit_length()) if 1 << i < self.max_nodes}
                            | {self.max_nodes}))
