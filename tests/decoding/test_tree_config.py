"""``TreeConfig`` and ``DecoderConfig(tree=...)``: one-line errors naming the field; what a tree cannot be
combined with."""

from __future__ import annotations

import pytest

from scv_jax import DecoderConfig, TreeConfig


@pytest.mark.parametrize("fields, match", [
    (dict(max_depth=0), r"TreeConfig.max_depth must be an int in \[1, 64\], got 0"),
    (dict(max_depth=2.0), r"TreeConfig.max_depth must be an int .* got 2.0"),
    (dict(branching=0), r"TreeConfig.branching must be an int in \[1, 64\], got 0"),
    (dict(branching=True), r"TreeConfig.branching must be an int .* got True"),
    (dict(max_depth=5, max_nodes=4), r"TreeConfig.max_nodes must be an int in \[5, 1024\], got 4"),
    (dict(max_nodes=2000), r"TreeConfig.max_nodes must be an int in \[4, 1024\], got 2000"),
])
def test_bad_tree_config(fields, match):
    with pytest.raises(ValueError, match=match):
        TreeConfig(**fields)


@pytest.mark.parametrize("fields, match", [
    (dict(tree=(4, 4, 16)), r"DecoderConfig.tree must be a TreeConfig or None, got \(4, 4, 16\)"),
    (dict(tree=TreeConfig(), adaptive=True), "DecoderConfig.tree cannot be combined with adaptive or packed_verify"),
    (dict(tree=TreeConfig(), packed_verify=True), "cannot be combined with adaptive or packed_verify"),
])
def test_bad_decoder_tree(fields, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**fields)


def test_sizes():
    tree = TreeConfig(max_depth=3, branching=2, max_nodes=16)
    assert tree.pool_size == 2 + 2 * 4 and tree.draft_nodes() == 10
    assert TreeConfig(max_nodes=16).node_buckets() == (1, 2, 4, 8, 16)
    assert TreeConfig(max_depth=2, max_nodes=6).node_buckets() == (1, 2, 4, 6)
