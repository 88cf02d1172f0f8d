"""KV pool: per-device layout, striped write/read round trip, in-place (donated) updates."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mesh import worker_mesh
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.kv_pool import KVPool

CFG = ModelConfig.tiny()


def _pointers(arr):
    return sorted(s.data.unsafe_buffer_pointer() for s in arr.addressable_shards)


def test_layout_striped_round_trip_and_in_place_update():
    pool = KVPool(worker_mesh(jax.devices(), 4, 4), CFG, num_blocks=6, block_size=8)
    assert pool.device_shape == (2, 6, 8, 2, 16)
    assert pool.k.shape == (4 * 2, 6, 8, 2, 16)
    assert pool.bytes_per_device == 2 * 2 * 6 * 8 * 2 * 16 * 4
    rng = np.random.default_rng(0)
    ids = [5, 0, 3, 1, 2]  # sequence indices 3..7 -> ranks 3, 0, 1, 2, 3
    k = rng.standard_normal((2, 5 * 8, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 5 * 8, 2, 16)).astype(np.float32)
    ptr_k, ptr_v = _pointers(pool.k), _pointers(pool.v)
    pool.write_sequence(ids, k, v, first_index=3)
    assert _pointers(pool.k) == ptr_k and _pointers(pool.v) == ptr_v  # same device buffers
    rk, rv = pool.read_sequence(ids, first_index=3)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)
    # Block at sequence index 4 (ids[1] = 0) sits on rank 4 % 4 = 0, nowhere else.
    on_rank0 = np.asarray(pool.rank_arrays(0)[0])[:, 0]
    np.testing.assert_array_equal(on_rank0, k[:, 8:16])
    untouched = np.asarray(pool.rank_arrays(1)[0])[:, 0]
    assert not np.any(untouched)


def test_bad_arguments():
    mesh = worker_mesh(jax.devices(), 0, 1)
    with pytest.raises(ValueError, match="block_size"):
        KVPool(mesh, CFG, num_blocks=4, block_size=12)
    with pytest.raises(ValueError, match="num_blocks"):
        KVPool(mesh, CFG, num_blocks=0, block_size=8)
    pool = KVPool(mesh, CFG, num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\)"):
        pool.read_sequence([4])
    with pytest.raises(ValueError, match="must have shape"):
        pool.write_sequence([0], np.ones((2, 7, 2, 16)), np.ones((2, 7, 2, 16)))
