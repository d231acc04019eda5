"""Host side of the decoder on a mesh: data-shard block pools, the shard-major batch layout,
``ShardingConfig`` and the decoder's mesh errors (one device; tests/decoding/test_mesh.py runs meshes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from scv_jax import DecoderConfig, ShardingConfig, SpeculativeDecoder
from scv_jax.decoding.placement import BatchRows, ShardedBlockPool, shard_major_rows
from scv_jax.graph.buckets import Buckets, Pad
from scv_jax.verify.summary import StepSummary
from tests.models.fixtures import TINY, tiny_model


def test_a_new_request_goes_to_the_least_loaded_shard_that_can_take_it():
    """Each data shard runs at most its share of the largest bucket: a new request goes to the least
    loaded shard with a free slot and its blocks free beside its running requests' next growth (then the
    one with most room), or waits."""
    pool = ShardedBlockPool(16, 2)                        # 8 blocks a shard
    assert pool.num_blocks == 16 and pool.num_free == 16 and all(p.num_blocks == 8 for p in pool.shards)
    assert pool.pick([3] * 2, [2, 1], [0, 0], per_shard=2) == 1     # shard 0 is full
    assert pool.pick([3] * 2, [1, 1], [0, 0], per_shard=2) == 0     # a tie in load and blocks: the first
    held = pool.shards[0].allocate(5)
    assert pool.pick([2] * 2, [1, 1], [0, 0], per_shard=2) == 1     # the same load: the most room
    assert pool.pick([3] * 2, [0, 1], [0, 0], per_shard=2) == 0     # the fewest requests first
    assert pool.pick([3] * 2, [0, 1], [1, 0], per_shard=2) == 1     # shard 0's requests grow by a block: 2 left
    assert pool.pick([3] * 2, [0, 2], [1, 0], per_shard=2) is None  # nowhere now: the request waits
    assert pool.num_free == 11
    pool.shards[0].free(held)
    assert pool.num_free == 16


def test_shard_major_rows_and_their_padding():
    buckets = Buckets((2, 4, 8))
    layout = shard_major_rows([1, 0, 1, 1], 2, buckets.bucket)       # shard 1 needs 3 rows: 2 x 4
    assert layout.rows.tolist() == [4, 0, 5, 6] and layout.size == 8 and layout.scattered

    class Executable:
        pads = {"lag": (Pad("batch", fill=1),), "tables": (Pad("batch", fill=-1), Pad("blocks", axis=1))}

    arranged = layout.arrange(Executable, lag=np.array([2, 3, 4, 5], np.int32),
                              tables=np.arange(8, dtype=np.int32).reshape(4, 2))
    assert arranged["lag"].tolist() == [3, 1, 1, 1, 2, 4, 5, 1]
    assert arranged["tables"][[1, 2, 3, 7]].tolist() == [[-1, -1]] * 4 and arranged["tables"][4].tolist() == [0, 1]
    assert arranged["request_mask"].tolist() == [True, False, False, False, True, True, True, False]
    packed = np.full((8, 5), -1, np.int32)       # one token, then the accepted, emitted and verified counts
    packed[layout.rows, 0], packed[layout.rows, 2], packed[layout.rows, 3] = [10, 11, 12, 13], [0, 1, 0, 0], 1
    packed[layout.rows, 4] = [1, 2, 0, 3]
    host, logprobs = layout.fetch(StepSummary(jnp.asarray(packed)))
    assert host.token_lists() == [[10], [11], [12], [13]] and host.num_accepted.tolist() == [0, 1, 0, 0]
    assert host.num_verified.tolist() == [1, 2, 0, 3] and logprobs is None
    assert shard_major_rows([0, 0, 0], 2, buckets.bucket).size == 8
    assert shard_major_rows([0] * 5, 2, buckets.bucket).size == 10    # beyond the buckets: unpadded


def test_single_device_rows_are_the_requests_in_order():
    layout = BatchRows(np.arange(3), 3, 4, False)
    assert layout.arrange(None, lag=np.ones(3)).keys() == {"lag"}


@pytest.mark.parametrize("fields, match", [(dict(draft="tensor"), "ShardingConfig.draft must be one of"),
                                           (dict(vocab_parallel=1), "ShardingConfig.vocab_parallel must be a bool")])
def test_sharding_config_checks_its_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        ShardingConfig(**fields)


def test_decoder_mesh_errors():
    target = tiny_model(TINY, seed=0)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="SpeculativeDecoder: sharding is for a mesh; pass mesh= too"):
        SpeculativeDecoder(target, sharding=ShardingConfig())
    with pytest.raises(ValueError, match=r"mesh must have the axes \('data', 'model'\)"):
        SpeculativeDecoder(target, mesh=Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "tp")))

    class Wrapped:   # a PagedModel that is not a Transformer: its attention would not run per shard
        config, forward_paged = target.config, target.forward_paged

    with pytest.raises(TypeError, match="on a mesh the target must be a scv_jax.models.Transformer"):
        SpeculativeDecoder(Wrapped(), mesh=mesh, config=DecoderConfig(num_blocks=8))
