"""ParamReplicas: one device_put per device per leaf; assembling a worker's replicated tree
re-wraps those buffers (same pointers, same values) on any submesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh import ParamReplicas, buffer_pointers, worker_mesh
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import init_model
from vertumnus_jax.worker import Worker


@pytest.fixture(scope="module")
def model():
    return init_model(ModelConfig.tiny(), seed=3)


def test_one_copy_per_device_and_zero_copy_assembly(model, monkeypatch):
    _, state = nnx.split(model)
    leaves = jax.tree_util.tree_leaves(state)
    calls = []
    put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, d: calls.append(d) or put(x, d))
    devices = jax.devices()[:4]
    replicas = ParamReplicas(state, devices)
    monkeypatch.undo()
    assert len(calls) == len(leaves) * len(devices)
    assert replicas.nbytes_per_device == sum(int(x.nbytes) for x in leaves)
    ptrs = {d.id: replicas.buffer_pointers(d) for d in devices}
    for i in range(len(leaves)):  # a separate buffer on every device
        assert len({p[i] for p in ptrs.values()}) == len(devices)

    mesh = worker_mesh(jax.devices(), 2, 2)
    tree = replicas.assemble(mesh)
    assert buffer_pointers(tree) == {2: ptrs[2], 3: ptrs[3]}  # zero bytes moved
    for got, want in zip(jax.tree_util.tree_leaves(tree), leaves):
        assert got.sharding == NamedSharding(mesh, P()) and got.sharding.is_fully_replicated
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want))
    with pytest.raises(ValueError, match=r"devices \[4\] hold no replica"):
        replicas.assemble(worker_mesh(jax.devices(), 4, 1))


def test_from_replicated_rewraps_two_workers_params(model):
    _, state = nnx.split(model)
    replicas = ParamReplicas(state, jax.devices())
    lo = replicas.assemble(worker_mesh(jax.devices(), 4, 2))
    hi = replicas.assemble(worker_mesh(jax.devices(), 6, 2))
    merged = ParamReplicas.from_replicated(lo, hi).assemble(worker_mesh(jax.devices(), 4, 4))
    assert buffer_pointers(merged) == {d: replicas.buffer_pointers(jax.devices()[d])
                                       for d in (4, 5, 6, 7)}
    half = ParamReplicas.from_replicated(merged).assemble(worker_mesh(jax.devices(), 6, 2))
    assert buffer_pointers(half) == buffer_pointers(hi)

    sharded = jax.device_put(np.arange(8.0), NamedSharding(worker_mesh(jax.devices(), 0, 2),
                                                           P("cp")))
    with pytest.raises(ValueError, match="fully replicated"):
        ParamReplicas.from_replicated({"w": sharded})
    with pytest.raises(ValueError, match="same structure"):
        ParamReplicas.from_replicated(lo, {"w": sharded})
    with pytest.raises(ValueError, match="different device sets"):
        ParamReplicas.from_replicated({"a": jax.device_put(1.0, jax.devices()[0]),
                                       "b": jax.device_put(1.0, jax.devices()[1])})


def test_worker_from_replicas_copies_no_weights(model):
    graphdef, state = nnx.split(model)
    replicas = ParamReplicas(state, jax.devices())
    mesh = worker_mesh(jax.devices(), 0, 4)
    worker = Worker.from_replicas(mesh, graphdef, replicas, num_blocks=2, block_size=16)
    assert buffer_pointers(worker.params) == {d: replicas.buffer_pointers(jax.devices()[d])
                                              for d in range(4)}
    assert worker.config == model.config and worker.cached_hashes() == ()
    with pytest.raises(ValueError, match="unless params are given"):
        Worker(mesh, graphdef, num_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="replicated on exactly the mesh's devices"):
        Worker(worker_mesh(jax.devices(), 4, 4), graphdef, num_blocks=2, block_size=16,
               params=worker.params)
