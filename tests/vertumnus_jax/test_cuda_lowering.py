"""The zigzag CP prefill step and the KV moves lowered for CUDA, on any host (CI's CPU).

What lowers: the jitted, `shard_map`'d prefill step a worker compiles per (C, N, J) bucket
(`vertumnus_jax.prefill._step`, what `prefill` calls), for C = 1, 2, 4 and 8, with the real
head shapes (and hidden sizes) of the supported models at 2 layers and a 1024-token vocabulary,
bf16; and the jitted KV block gather / scatter of re-carving (`kv_move`) and the pool's sharded
block write (`kv_pool`). Nothing is compiled and no parameter is allocated: the model is
`nnx.eval_shape`d and every argument is a `jax.ShapeDtypeStruct`.

Two ways to lower a sharded step for CUDA without a GPU both work with jax 0.10.2, and both
are tested:
  * `jax.export.export(step, platforms=["cuda"])` on a `jax.sharding.AbstractMesh((C,), ("cp",))`
    of abstract NVIDIA H200s (`cuda_mesh`, no devices at all; jax >= 0.11 needs the abstract
    GPU to lower Triton without one): Qwen3-8B at every C, Qwen3-0.6B and Qwen3-32B;
  * `step.trace(...).lower(lowering_platforms=("cuda",))` on a `Mesh` of C of the 8 host CPU
    devices `tests/conftest.py` sets up, at the aligned offsets a re-carved worker uses:
    Qwen3-8B at every C and the MoE Qwen3-30B-A3B (export would legalize its `chlo.ragged_dot`
    into one dense dot per expert, which a jitted step does not do).
The step is built for a stand-in worker with `interpret=False`: a real `Worker` on a CPU host
has `interpret=None`, which picks Pallas interpret mode from the default backend at trace time
and so would lower the interpreted kernel (no Triton call) even for CUDA. One test builds the
step from a real `Worker`'s defaults with the default backend reported as "gpu" (a GPU host).

Each lowering must hold exactly one flash-attention Triton call per layer at the rank's shapes
(2S = N / C queries over C * J cached blocks plus the N new keys), the all-gathers and the psum
of the zigzag step, and the donated KV pool, returned in its own dtype (bf16) and shape. A
lowering error is not caught: it fails the test.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh import worker_mesh
from pallas_kernels import BlockSizes
from pallas_kernels.block_sizes import next_pow2
from tests.pallas_kernels.cuda_lowering import (
    as_module,
    cuda_mesh,
    donated_arg_types,
    export_for_cuda,
    flash_dots,
    model_config,
    op_counts,
    result_types,
    triton_calls,
    triton_launches,
)
from vertumnus_jax import kv_move, kv_pool
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import Qwen3, init_model
from vertumnus_jax.prefill import _step
from vertumnus_jax.worker import Worker

BS, NUM_BLOCKS, LAYERS, VOCAB = 16, 64, 2, 1024  # block size, KV blocks per device


def _lowered_step(model, mesh, bucket, prefix_slots, lower, cfg=None, interpret=False):
    """The prefill step of `model` (2 layers, small vocabulary; or of `cfg`) for `mesh`, lowered
    by `lower` (export or trace-and-lower) on abstract arguments; returns (lowered, config)."""
    cfg = cfg or model_config(model, num_layers=LAYERS, vocab_size=VOCAB)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    c = int(mesh.shape["cp"])
    worker = types.SimpleNamespace(  # the fields `_step` reads from a Worker
        config=cfg, cp_degree=c, axis="cp", block_size=BS, graphdef=graphdef,
        block_sizes=None, interpret=interpret, mesh=mesh)
    step, new_slots = _step(worker, bucket, prefix_slots)
    rep, sh = NamedSharding(mesh, P()), NamedSharding(mesh, P("cp"))

    def arg(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    params = jax.tree.map(lambda x: arg(x.shape, x.dtype, rep), state)
    pool = arg((c * LAYERS, NUM_BLOCKS, BS, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16, sh)
    args = (params, pool, pool, arg((c, bucket // c), jnp.int32, sh),  # zigzag tokens
            arg((c, prefix_slots), jnp.int32, sh), arg((c, new_slots), jnp.int32, sh),
            arg((), jnp.int32, rep), arg((), jnp.int32, rep))  # n_cached_blocks, n_new
    return lower(step, args), cfg


def _export(step, args):
    exported = export_for_cuda(step, *args, mesh=args[1].sharding.mesh)
    assert exported.platforms == ("cuda",)
    return exported


def _trace_lower(step, args):
    return step.trace(*args).lower(lowering_platforms=("cuda",))


def _check_step(lowered, cfg, c, bucket, prefix_slots):
    module = as_module(lowered)
    q_len, kv_len = bucket // c, c * prefix_slots * BS + bucket
    gpu = BlockSizes.get_default("gpu")
    block_q = min(gpu.block_q, max(16, next_pow2(q_len)))
    block_k = min(gpu.block_k, max(16, next_pow2(kv_len)))
    kv_pad = -(-kv_len // block_k) * block_k
    dt = {"bfloat16": "bf16", "float32": "f32"}[cfg.dtype]
    calls = triton_calls(module)
    assert calls, "no Triton call: the kernel did not lower for the GPU"
    launches = triton_launches(module)
    assert launches == cfg.num_layers, (
        f"{launches} Triton launches for {cfg.num_layers} layers: every layer's attention must "
        "be the Pallas kernel lowered for the GPU (not interpreted, not dense)")
    for call in calls:
        assert call.grid == (-(-q_len // block_q), 1, cfg.num_q_heads)
        assert call.operand_types[4] == (
            f"tensor<1x{kv_pad}x{cfg.num_kv_heads}x{cfg.head_dim}x{dt}>")
        assert set(call.dots) == flash_dots(block_q, block_k, cfg.head_dim, dt), call.dots
    ops = op_counts(module)
    assert ops["stablehlo.all_gather"], "no K/V all-gather"
    assert ops["stablehlo.all_reduce"], "no psum of the last hidden row"
    pool = (f"tensor<{c * cfg.num_layers}x{NUM_BLOCKS}x{BS}x{cfg.num_kv_heads}x"
            f"{cfg.head_dim}x{dt}>")
    # The KV pool is donated and returned in its own dtype and shape (updated in place).
    assert donated_arg_types(module) == [pool, pool], "the K/V pool is not donated"
    assert result_types(module) == [f"tensor<{cfg.vocab_size}xf32>", "tensor<i32>", pool, pool]


# (model, C, bucket N, prefix-block bucket J): every degree at N = 2048 over 4 cached blocks per
# rank; the smallest bucket at C = 8 (2 queries per rank); the 0.6B (tied LM head) and 32B head
# shapes. The MoE model is lowered on host devices below: export legalizes its `chlo.ragged_dot`
# into one dense dot per expert (a 1.4 MB module), which is not what a jitted step runs.
STEP_CASES = [
    ("qwen3-8b", 1, 2048, 4),
    ("qwen3-8b", 2, 2048, 4),
    ("qwen3-8b", 4, 2048, 4),
    ("qwen3-8b", 8, 2048, 4),
    ("qwen3-8b", 8, 16, 1),
    ("qwen3-0.6b", 2, 512, 2),
    ("qwen3-32b", 4, 1024, 2),
]


@pytest.mark.parametrize("model,c,bucket,prefix_slots", STEP_CASES)
def test_prefill_step_exports_for_cuda_on_abstract_mesh(model, c, bucket, prefix_slots):
    mesh = cuda_mesh(c)
    exported, cfg = _lowered_step(model, mesh, bucket, prefix_slots, _export)
    assert exported.nr_devices == c
    _check_step(exported, cfg, c, bucket, prefix_slots)


# Workers at the aligned device offsets of a re-carved pool (as in test_prefill.py), and the
# MoE model (Qwen3-30B-A3B: 32 / 4 heads, top-8 of 128 experts) on all 8.
@pytest.mark.parametrize("model,first,c", [
    ("qwen3-8b", 5, 1), ("qwen3-8b", 2, 2), ("qwen3-8b", 4, 4), ("qwen3-8b", 0, 8),
    ("qwen3-30b-a3b", 0, 8),
])
def test_prefill_step_lowers_for_cuda_on_host_devices(model, first, c):
    assert len(jax.devices()) >= 8, "needs the 8 host devices tests/conftest.py sets up"
    mesh = worker_mesh(jax.devices(), first, c)
    lowered, cfg = _lowered_step(model, mesh, 1024, 2, _trace_lower)
    _check_step(lowered, cfg, c, 1024, 2)


def test_prefill_step_of_a_default_worker_compiles_on_a_gpu_backend(monkeypatch):
    # A Worker built with its defaults (interpret=None, as the server builds them) on a GPU host
    # must run the compiled kernel: `flash_attention` resolves None from jax.default_backend()
    # when the step is traced, so report "gpu" and lower the step made from the real Worker's
    # settings (on an abstract H200 mesh) for CUDA.
    cfg = ModelConfig.tiny()
    worker = Worker(worker_mesh(jax.devices(), 0, 1), init_model(cfg), num_blocks=NUM_BLOCKS,
                    block_size=BS)
    assert worker.interpret is None and worker.block_sizes is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mesh = cuda_mesh(2)
    stand_in = types.SimpleNamespace(**{k: getattr(worker, k) for k in (
        "config", "axis", "block_size", "graphdef", "block_sizes", "interpret")},
        cp_degree=2, mesh=mesh)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    step, new_slots = _step(stand_in, 64, 1)
    rep, sh = NamedSharding(mesh, P()), NamedSharding(mesh, P("cp"))
    pool = jax.ShapeDtypeStruct((2 * cfg.num_layers, NUM_BLOCKS, BS, cfg.num_kv_heads,
                                 cfg.head_dim), jnp.float32, sharding=sh)
    args = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state),
            pool, pool, *(jax.ShapeDtypeStruct(s, jnp.int32, sharding=sh)
                          for s in ((2, 32), (2, 1), (2, new_slots))),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))
    _check_step(_export(step, args), cfg, 2, 64, 1)


def _pool_shape(c):
    cfg = model_config("qwen3-8b", num_layers=LAYERS)
    return (c * LAYERS, NUM_BLOCKS, BS, cfg.num_kv_heads, cfg.head_dim)


def test_kv_block_moves_export_for_cuda():
    # Re-carving's per-device block gather (source) and donated scatter (destination); the
    # device-to-device copy between them is a `jax.device_put`, a transfer, not a computation.
    pool = jax.ShapeDtypeStruct(_pool_shape(1), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    blocks = jax.ShapeDtypeStruct((LAYERS, 8) + _pool_shape(1)[2:], jnp.bfloat16)
    gather = export_for_cuda(kv_move._gather(), pool, pool, ids)
    assert op_counts(gather)["stablehlo.gather"] >= 2
    assert [(a.shape, a.dtype) for a in gather.out_avals] == [(blocks.shape, blocks.dtype)] * 2
    scatter = export_for_cuda(kv_move._scatter(), pool, pool, ids, blocks, blocks)
    assert op_counts(scatter)["stablehlo.scatter"] >= 2
    pool_type = "tensor<{}xbf16>".format("x".join(map(str, _pool_shape(1))))
    assert donated_arg_types(scatter) == [pool_type, pool_type], "the K/V pool is not donated"
    assert result_types(scatter) == [pool_type, pool_type]  # written in place, still bf16


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_pool_block_write_exports_for_cuda(c):
    # The sharded, donated block write of `KVPool.write_sequence` on a C-rank mesh.
    mesh = cuda_mesh(c)
    sh = NamedSharding(mesh, P("cp"))
    pool = jax.ShapeDtypeStruct(_pool_shape(c), jnp.bfloat16, sharding=sh)
    dst = jax.ShapeDtypeStruct((c, 4), jnp.int32, sharding=sh)
    new = jax.ShapeDtypeStruct((c, LAYERS, 4) + _pool_shape(c)[2:], jnp.bfloat16, sharding=sh)
    exported = export_for_cuda(kv_pool._write_fn(mesh, "cp"), pool, pool, dst, new, new,
                               mesh=mesh)
    assert exported.nr_devices == c
    assert op_counts(exported)["stablehlo.scatter"] >= 2
    pool_type = "tensor<{}xbf16>".format("x".join(map(str, _pool_shape(c))))
    assert donated_arg_types(exported) == [pool_type, pool_type], "the K/V pool is not donated"
    assert result_types(exported) == [pool_type, pool_type]  # written in place, still bf16
