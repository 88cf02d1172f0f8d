"""Forward flash attention with global token positions, for zigzag CP prefill over cached prefixes.

One rule decides what a query sees: the query at position `p` attends to every key at position
`<= p`. A negative position marks padding: a padding key is never seen (its K/V values are never
read into a result), a padding query sees nothing. That one rule covers plain causal prefill,
queries that start after a cached prefix of `h` tokens, the two position ranges a zigzag rank
holds, and ragged lengths.

The kernel is FlashAttention-2's forward pass (Dao, 2023, arXiv 2307.08691, Algorithm 1: online
softmax over key blocks, the grid over query blocks) written in Pallas for the Triton backend, in
the style of `jax.experimental.pallas.ops.gpu.attention`. Before the call a small jnp pass builds
a per-query-block schedule of key blocks from the positions' min/max: blocks invisible to the
whole query block are dropped (the causal saving), blocks visible to every query run without a
mask, the rest run masked. On CPU the same kernel runs in Pallas interpret mode.

Outputs are the attention output and the natural-log log-sum-exp (LSE) of each query row's
scaled logits. A row with no visible key gets a zero output and an LSE of -inf, never NaN, so
partial results over disjoint key sets combine exactly with `merge_attention_states`. The
pure-jnp reference, `attention_reference`, is in `pallas_kernels.reference` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.block_sizes import BlockSizes, default_num_warps, next_pow2
from pallas_kernels.reference import attention_reference, check_attention_inputs, check_sm_scale

__all__ = ["BlockSizes", "attention_reference", "flash_attention", "merge_attention_states"]

try:  # The Triton backend's compiler parameters (jax 0.10 and 0.11); absent on odd builds.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - only on jax builds without the Triton module.
    plgpu = None

_LOG2_E = math.log2(math.e)
# Both dots at HIGHEST: float32 inputs get full float32 products (Triton's IEEE input precision;
# DEFAULT would be TF32 on a GPU, ~1e-3 relative, seen on an H200); bf16 / f16 inputs are
# unchanged (their products are exact in the f32 accumulator).
_PRECISION = lax.Precision.HIGHEST
_LN_2 = math.log(2.0)
_NO_KEY = np.iinfo(np.int32).max  # key-block min/max sentinel: "no valid key" / "has padding"


def _block_schedule(q_positions, kv_positions, block_q: int, block_k: int) -> jax.Array:
    """Per query block, the key blocks to visit: `[batch, num_q_blocks, 2 + num_k_blocks]` int32.

    Row layout: `[n_full, n_visible, key-block ids...]` with the `n_full` blocks every query of
    the block sees first, then the `n_visible - n_full` partly visible ones; the remaining ids
    are never read. Visibility uses min/max only: a key block is visible when its smallest valid
    position is <= the query block's largest position, and fully visible when it has no padding
    and its largest position is <= the query block's smallest position (padding queries, at -1,
    force the masked path).
    """
    batch, q_len = q_positions.shape
    kv_len = kv_positions.shape[1]
    q_blocks = q_positions.reshape(batch, q_len // block_q, block_q)
    q_max = q_blocks.max(axis=-1)  # [batch, nq]
    q_min = q_blocks.min(axis=-1)  # [batch, nq]
    k_blocks = kv_positions.reshape(batch, kv_len // block_k, block_k)
    k_valid = jnp.where(k_blocks >= 0, k_blocks, _NO_KEY)
    k_min = k_valid.min(axis=-1)  # [batch, nk]; _NO_KEY when the block is all padding
    k_max = k_valid.max(axis=-1)  # [batch, nk]; _NO_KEY when the block has any padding
    visible = k_min[:, None, :] <= q_max[:, :, None]  # [batch, nq, nk]
    full = k_max[:, None, :] <= q_min[:, :, None]  # implies visible
    kind = jnp.where(full, 0, jnp.where(visible, 1, 2))
    order = jnp.argsort(kind, axis=-1, stable=True).astype(jnp.int32)
    counts = jnp.stack([full.sum(-1), visible.sum(-1)], axis=-1).astype(jnp.int32)
    return jnp.concatenate([counts, order], axis=-1)


def _flash_attention_kernel(
    sched_ref,  # [2 + num_k_blocks] int32: n_full, n_visible, key-block ids (full ones first)
    q_pos_ref,  # [block_q] int32
    kv_pos_ref,  # [kv_len] int32
    q_ref,  # [block_q, head_dim]
    k_ref,  # [kv_len, head_dim]  (this query head's KV head; GQA shares it, never repeated)
    v_ref,  # [kv_len, head_dim]
    *refs,  # optional aliased (o_init_ref, lse_init_ref), never read; then o_ref, lse_ref
    sm_scale: float,
    block_k: int,
):
    o_ref = refs[-2]  # [block_q, head_dim]
    lse_ref = refs[-1]  # [block_q] float32
    block_q, head_dim = q_ref.shape
    q = q_ref[...]  # [block_q, head_dim]
    q_pos = q_pos_ref[...]  # [block_q]
    qk_scale = sm_scale * _LOG2_E  # logits in base 2: exp(x) == exp2(x * log2(e))

    def step(t, carry, *, masked: bool):
        acc, m_prev, l_prev = carry  # [block_q, head_dim], [block_q], [block_q] float32
        start = pl.multiple_of(sched_ref[2 + t] * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]  # [block_k, head_dim]
        v = v_ref[pl.ds(start, block_k), :]  # [block_k, head_dim]
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=_PRECISION,
            preferred_element_type=jnp.float32,
        )  # [block_q, block_k]
        s = s * qk_scale
        if masked:
            kv_pos = kv_pos_ref[pl.ds(start, block_k)]  # [block_k]
            key_valid = kv_pos >= 0
            seen = key_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
            s = jnp.where(seen, s, -jnp.inf)
            v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))  # padding V may be garbage
        m_next = jnp.maximum(m_prev, s.max(axis=-1))  # [block_q]
        if masked:  # a row that has seen nothing keeps m == -inf; shift by 0 to avoid inf - inf
            m_next_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        else:
            m_next_safe = m_next
        alpha = jnp.exp2(m_prev - m_next_safe)  # [block_q]
        p = jnp.exp2(s - m_next_safe[:, None])  # [block_q, block_k]
        l_next = alpha * l_prev + p.sum(axis=-1)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_PRECISION,
            preferred_element_type=jnp.float32,
        )  # [block_q, head_dim]
        return alpha[:, None] * acc + pv, m_next, l_next

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    n_full = sched_ref[0]
    n_visible = sched_ref[1]
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(n_full, n_visible, functools.partial(step, masked=True), carry)
    acc, m_i, l_i = carry
    empty = l_i == 0.0  # no visible key: l == 0 exactly (a seen key adds exp2(0) = 1)
    l_safe = jnp.where(empty, 1.0, l_i)
    o_ref[...] = (acc * (1.0 / l_safe)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * _LN_2)


def _flash_attention_call(
    q, k, v, q_positions, kv_positions, schedule, *, sm_scale: float,
    block_sizes: BlockSizes, interpret: bool, out_init=None,
):
    """The pallas_call on block-aligned inputs (lengths multiples of the block sizes, head_dim a
    power of two). `out_init=(o, lse)`, when given, is aliased to the outputs (tests poison it).
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    block_q, block_k = block_sizes.block_q, block_sizes.block_k
    group = num_q_heads // num_kv_heads
    num_q_blocks = q_len // block_q
    sched_len = schedule.shape[-1]

    # Grid (q block, batch, q head); heaviest causal q blocks (the last ones) are launched first.
    def qi(i):
        return num_q_blocks - 1 - i

    o_spec = pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, qi(i), h, 0))
    lse_spec = pl.BlockSpec((None, block_q, None), lambda i, b, h: (b, qi(i), h))
    kv_spec = pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    in_specs = [
        pl.BlockSpec((None, None, sched_len), lambda i, b, h: (b, qi(i), 0)),
        pl.BlockSpec((None, block_q), lambda i, b, h: (b, qi(i))),
        pl.BlockSpec((None, kv_len), lambda i, b, h: (b, 0)),
        o_spec,  # q has the output's layout
        kv_spec,
        kv_spec,
    ]
    args = [schedule, q_positions, kv_positions, q, k, v]
    aliases = {}
    if out_init is not None:
        in_specs += [o_spec, lse_spec]
        args += list(out_init)
        aliases = {len(args) - 2: 0, len(args) - 1: 1}
    compiler_params = None
    if not interpret and plgpu is not None:
        num_warps = block_sizes.num_warps or default_num_warps(block_q, block_k)
        compiler_params = plgpu.CompilerParams(
            num_warps=num_warps, num_stages=block_sizes.num_stages
        )
    kernel = functools.partial(_flash_attention_kernel, sm_scale=sm_scale, block_k=block_k)
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, num_q_heads),
        in_specs=in_specs,
        out_specs=[o_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, q_len, num_q_heads), jnp.float32),
        ],
        input_output_aliases=aliases,
        compiler_params=compiler_params,
        interpret=interpret,
        name="vertumnus_flash_attention_fwd",
    )(*args)


def _pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def _flash_attention_jit(q, k, v, q_positions, kv_positions, *, sm_scale, block_sizes, interpret):
    _, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    block_q = min(block_sizes.block_q, max(16, next_pow2(q_len)))
    block_k = min(block_sizes.block_k, max(16, next_pow2(kv_len)))
    blocks = dataclasses.replace(block_sizes, block_q=block_q, block_k=block_k)
    q_pad = pl.cdiv(q_len, block_q) * block_q
    kv_pad = pl.cdiv(kv_len, block_k) * block_k
    d_pad = max(16, next_pow2(head_dim))  # Triton tensors need power-of-two shapes
    q = _pad_axis(_pad_axis(q, 1, q_pad), 3, d_pad)
    k = _pad_axis(_pad_axis(k, 1, kv_pad), 3, d_pad)
    v = _pad_axis(_pad_axis(v, 1, kv_pad), 3, d_pad)
    q_positions = _pad_axis(q_positions.astype(jnp.int32), 1, q_pad, -1)
    kv_positions = _pad_axis(kv_positions.astype(jnp.int32), 1, kv_pad, -1)
    schedule = _block_schedule(q_positions, kv_positions, block_q, block_k)
    out, lse = _flash_attention_call(
        q, k, v, q_positions, kv_positions, schedule,
        sm_scale=sm_scale, block_sizes=blocks, interpret=interpret,
    )
    return out[:, :q_len, :, :head_dim], lse[:, :q_len, :]


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    *,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal-by-position attention (forward) with a Pallas flash-attention kernel.

    Args:
      q: `[batch, q_len, num_q_heads, head_dim]` float (bf16, f16 or f32).
      k, v: `[batch, kv_len, num_kv_heads, head_dim]`, q's dtype; `num_q_heads` a multiple of
        `num_kv_heads` (grouped-query attention; K/V are shared, never repeated in memory).
      q_positions: `[batch, q_len]` int32 global token positions of the queries (any signed
        integer dtype, cast to int32; unsigned dtypes are rejected).
      kv_positions: `[batch, kv_len]` int32 global token positions of the keys, any order
        (e.g. cached prefix then all-gathered zigzag chunks). Query at `p` sees keys at `<= p`.
        Negative positions mark padding on either side (values 0 .. 2**31 - 2 are positions).
      sm_scale: logit scale, a finite number; default `1 / sqrt(head_dim)`.
      block_sizes: tiling; default `BlockSizes.get_default(backend)`.
      interpret: run in Pallas interpret mode; default True exactly when jax's default backend
        is CPU.

    Returns:
      `(out, lse)`: `out [batch, q_len, num_q_heads, head_dim]` in q's dtype and
      `lse [batch, q_len, num_q_heads]` float32, the natural-log log-sum-exp of the row's scaled
      logits. A row with no visible key (a padding query, or no key at `<= p`) gets zeros and
      `lse = -inf`.

    Raises:
      ValueError: on shapes, dtypes or head counts outside the ranges above (every size >= 1,
        num_kv_heads and num_q_heads included; positions of a signed integer dtype), or a
        non-finite sm_scale.

    Source: FlashAttention-2 forward (arXiv 2307.08691, Alg. 1); tiling after
    `jax.experimental.pallas.ops.gpu.attention`.
    """
    check_attention_inputs(q, k, v, q_positions, kv_positions)
    check_sm_scale(sm_scale)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if block_sizes is None:
        block_sizes = BlockSizes.get_default("cpu" if interpret else "gpu")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return _flash_attention_jit(
        q, k, v, q_positions, kv_positions,
        sm_scale=float(sm_scale), block_sizes=block_sizes, interpret=bool(interpret),
    )


def merge_attention_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Exact merge of attention over two disjoint key sets A and B.

    Args:
      out_a, out_b: `[..., head_dim]` outputs (softmax-normalised over their own key set).
      lse_a, lse_b: `[...]` natural-log LSEs (`out.shape[:-1]`); -inf for a row with no key.

    Returns:
      `(out, lse)`: `lse = logaddexp(lse_a, lse_b)` (float32) and
      `out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b` in out_a's dtype. A side at
      -inf contributes nothing (its out is not read); both at -inf gives zeros and -inf.

    Raises:
      ValueError: when the shapes do not match as above.

    Source: the LSE-weighted combine of blockwise/ring attention (Milakov & Gimelshein 2018,
    arXiv 1805.02867; Liu et al. 2023, Ring Attention, arXiv 2310.01889).
    """
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b shapes differ: {out_a.shape} vs {out_b.shape}")
    if lse_a.shape != out_a.shape[:-1] or lse_b.shape != out_a.shape[:-1]:
        raise ValueError(
            f"lse_a and lse_b must have shape out.shape[:-1] = {out_a.shape[:-1]}; "
            f"got {lse_a.shape} and {lse_b.shape}"
        )
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    lse = jnp.logaddexp(lse_a, lse_b)
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w_a = jnp.exp(lse_a - lse_safe)[..., None]  # 0 where lse_a == -inf
    w_b = jnp.exp(lse_b - lse_safe)[..., None]
    part_a = jnp.where(w_a > 0, w_a * out_a.astype(jnp.float32), 0.0)
    part_b = jnp.where(w_b > 0, w_b * out_b.astype(jnp.float32), 0.0)
    return (part_a + part_b).astype(out_a.dtype), lse
