"""The flash-attention kernel lowered for CUDA (Pallas -> Triton) at the supported models' shapes.

Runs on any host, CI's CPU included: `jax.export.export(..., platforms=["cuda"])` of
`flash_attention(..., interpret=False)` on abstract bf16 arguments runs the Pallas-Triton
lowering (no GPU, no compile; for an abstract NVIDIA H200, compute capability 9.0).
Per model (query / KV heads of Qwen3-0.6B, 8B, 32B and 30B-A3B, head_dim 128) and per shape
(plain causal prefill, queries after a cached prefix, lengths off the block grid, and a zigzag
rank at the smallest bucket) the test asserts one `__gpu$xla.gpu.triton` call with the GPU
tiling of `BlockSizes.get_default("gpu")`: its launch grid, warps and stages, K/V passed with
the KV head count (GQA, never repeated), and the Triton IR's two `tt.dot`s at the expected
block shapes. A lowering error is not caught: it fails the test with jax's message.

Also pinned: the default GPU tiles (128 x 64, 3 stages) and their shared-memory footprint
(Q tile + 3 stages of K and V tiles, bf16) within an H100 / H200 block's 227 KB at every model's
head_dim; and `interpret=None` resolving to the compiled kernel where the default backend is a
GPU (what a Worker or the server, both `interpret=None`, run on a GPU host).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import BlockSizes, flash_attention
from pallas_kernels.block_sizes import next_pow2
from tests.pallas_kernels.cuda_lowering import (
    MODELS,
    SMEM_PER_BLOCK,
    export_for_cuda,
    flash_dots,
    model_config,
    result_types,
    smem_bytes,
    triton_calls,
)

# (q_len, kv_len): no cached prefix; 1024 new tokens after a 7168-token prefix; lengths off the
# block grid (padding path); one zigzag rank of C=8 at the 16-token minimum bucket over one
# cached block per rank (2 queries, block_q clipped to 16).
SHAPES = {
    "causal_4k": (4096, 4096),
    "prefix_8k": (1024, 8192),
    "ragged_prefix": (1000, 3000),
    "zigzag_rank_min_bucket": (2, 8 * 16 + 16),
}


def _cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("model", MODELS)
def test_kernel_lowers_to_triton_for_cuda(model, shape):
    cfg = model_config(model)
    hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    q_len, kv_len = SHAPES[shape]
    assert cfg.dtype == "bfloat16" and d == 128
    q = jax.ShapeDtypeStruct((1, q_len, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, kv_len, hkv, d), jnp.bfloat16)
    q_pos = jax.ShapeDtypeStruct((1, q_len), jnp.int32)
    kv_pos = jax.ShapeDtypeStruct((1, kv_len), jnp.int32)
    fn = jax.jit(functools.partial(flash_attention, interpret=False))
    exported = export_for_cuda(fn, q, kv, kv, q_pos, kv_pos)
    assert exported.platforms == ("cuda",)

    [call] = triton_calls(exported)
    gpu = BlockSizes.get_default("gpu")
    block_q = min(gpu.block_q, max(16, next_pow2(q_len)))
    block_k = min(gpu.block_k, max(16, next_pow2(kv_len)))
    q_pad, kv_pad = _cdiv(q_len, block_q) * block_q, _cdiv(kv_len, block_k) * block_k
    assert call.name == "vertumnus_flash_attention_fwd"
    assert call.grid == (q_pad // block_q, 1, hq)  # (query block, batch, query head)
    # 4 warps: every tile here is at most 128 x 64 (8 warps ran such tiles 1.29x slower on
    # the H200, pallas_kernels/results/tune_h200.md).
    assert (call.num_warps, call.num_stages) == (4, gpu.num_stages)
    # Operands: schedule, q positions, kv positions, q, k, v (K/V at the KV head count).
    assert call.operand_types[3:] == (
        f"tensor<1x{q_pad}x{hq}x{d}xbf16>",
        f"tensor<1x{kv_pad}x{hkv}x{d}xbf16>",
        f"tensor<1x{kv_pad}x{hkv}x{d}xbf16>",
    )
    assert set(call.dots) == flash_dots(block_q, block_k, d), call.dots
    assert "scf.for" in call.ir  # the schedule's data-dependent key loops
    assert smem_bytes(block_q, block_k, d, call.num_stages) <= SMEM_PER_BLOCK
    # (out, lse): q's dtype and shape, f32 log-sum-exp.
    assert result_types(exported) == [f"tensor<1x{q_len}x{hq}x{d}xbf16>",
                                      f"tensor<1x{q_len}x{hq}xf32>"]


def test_default_num_warps_by_tile_area():
    # The H200 sweep's measured winners (tune_h200.md): 4 warps below 128 x 128 tiles, 8 at it;
    # 256 x 64 (unmeasured) follows the tile-area rule.
    from pallas_kernels.block_sizes import default_num_warps
    assert [default_num_warps(bq, bk) for bq, bk in ((16, 16), (64, 128), (128, 64))] == [4] * 3
    assert [default_num_warps(bq, bk) for bq, bk in ((128, 128), (256, 64))] == [8, 8]
    with pytest.raises(ValueError, match="block_q and block_k must be >= 1"):
        default_num_warps(0, -5)


def test_default_gpu_tiles_are_pinned():
    # Tile changes must be deliberate: the lowering tests derive their expectations from
    # these defaults, so a default that overflows shared memory would pass them.
    expected = BlockSizes(block_q=128, block_k=64, num_warps=None, num_stages=3)
    assert BlockSizes.get_default("gpu") == expected
    assert BlockSizes.get_default("cuda") == expected


@pytest.mark.parametrize("model", MODELS)
def test_default_gpu_tiles_fit_shared_memory(model):
    cfg = model_config(model)
    gpu = BlockSizes.get_default("gpu")
    d = next_pow2(cfg.head_dim)  # the kernel pads head_dim to a power of two
    used = smem_bytes(gpu.block_q, gpu.block_k, d, gpu.num_stages, itemsize=2)  # bf16
    assert used <= SMEM_PER_BLOCK, (
        f"{model}: Q + {gpu.num_stages} x (K, V) tiles take {used} B of shared memory, "
        f"over the {SMEM_PER_BLOCK} B an H100 / H200 block can use")


def _small_kernel_args():
    q = jax.ShapeDtypeStruct((1, 128, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    return (q, kv, kv, jax.ShapeDtypeStruct((1, 128), jnp.int32),
            jax.ShapeDtypeStruct((1, 256), jnp.int32))


def test_interpret_none_compiles_on_a_gpu_backend(monkeypatch):
    # `flash_attention` resolves `interpret=None` (the Worker's and the server's default) from
    # `jax.default_backend()` when called: on a GPU worker that is "gpu" and the kernel must
    # lower to Triton with the GPU tiles, not be interpreted. (On a CPU host None means interpret
    # mode even when lowering for CUDA, so the other tests pass interpret=False.)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    fn = jax.jit(functools.partial(flash_attention, interpret=None))
    [call] = triton_calls(export_for_cuda(fn, *_small_kernel_args()))
    gpu = BlockSizes.get_default("gpu")
    assert set(call.dots) == flash_dots(gpu.block_q, gpu.block_k, 128), call.dots



@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dots_use_ieee_input_precision(dtype):
    # On the H200 (gpu_check and the compiled FlashAttentionTest, 2026-12-04) the kernel's f32
    # outputs were off the HIGHEST-precision reference by up to 1.2e-3: Triton's dots ran at
    # `inputPrecision = tf32`, what DEFAULT precision lowers to. The kernel asks for HIGHEST,
    # which lowers to IEEE (Triton's default value, so the attribute is not printed).
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), dtype)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 64), dtype)
    pos = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    fn = jax.jit(functools.partial(flash_attention, interpret=False))
    [call] = triton_calls(export_for_cuda(fn, q, kv, kv, pos, pos))
    dot_lines = [line for line in call.ir.splitlines() if "tt.dot " in line]
    assert len(dot_lines) >= 2, call.ir
    for line in dot_lines:
        assert "tf32" not in line and "bf16x" not in line, line
