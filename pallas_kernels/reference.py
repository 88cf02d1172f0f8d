"""Pure-jnp attention: the reference for the Pallas kernel, and the input checks both share.

`attention_reference` has `pallas_kernels.flash_attention.flash_attention`'s signature,
semantics and outputs (the query at position `p` sees every key at position `<= p`; negative
positions are padding; a row with no visible key gets zeros and an LSE of -inf), computed
densely in float32 for tests and small inputs. `check_attention_inputs` and `check_sm_scale`
are the validation both apply. Re-exported by `pallas_kernels.flash_attention` and
`pallas_kernels`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.block_sizes import BlockSizes


def check_attention_inputs(q, k, v, q_positions, kv_positions) -> None:
    """Checks the inputs of `flash_attention` and `attention_reference` (shapes in their
    docstrings).

    Raises ValueError when q, k, v are not 4-D `[batch, len, heads, head_dim]`, k and v differ in
    shape, a size is < 1, batch or head_dim differ from q's, num_q_heads is not a multiple of
    num_kv_heads, the dtypes differ or are not floating point, or a positions array is not a
    signed integer `[batch, len]`.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "q, k, v must be [batch, len, heads, head_dim]; got "
            f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    batch, q_len, num_q_heads, head_dim = q.shape
    sizes = (("batch", batch), ("q_len", q_len), ("kv_len", k.shape[1]),
             ("num_q_heads", num_q_heads), ("num_kv_heads", k.shape[2]), ("head_dim", head_dim))
    for name, size in sizes:
        if size < 1:
            raise ValueError(
                f"{name} must be >= 1; got {size} (q.shape={q.shape}, k.shape={k.shape}; "
                "batch, q_len, kv_len, heads and head_dim must all be >= 1)"
            )
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"k batch and head_dim must match q's ({batch}, {head_dim}); got k.shape={k.shape}"
        )
    if num_q_heads % k.shape[2] != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({k.shape[2]})"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must be floating point; got {q.dtype}")
    for name, pos, length in (("q_positions", q_positions, q_len),
                              ("kv_positions", kv_positions, k.shape[1])):
        if pos.shape != (batch, length):
            raise ValueError(f"{name} must have shape {(batch, length)}; got {pos.shape}")
        if not jnp.issubdtype(pos.dtype, jnp.signedinteger):
            # Unsigned positions would wrap to negative (padding) in the int32 cast.
            raise ValueError(f"{name} must be a signed integer array (int32); got {pos.dtype}")


def check_sm_scale(sm_scale) -> None:
    """Checks that sm_scale is None or finite (a NaN/inf scale poisons every logit); raises
    ValueError otherwise. A traced scale (only `attention_reference` accepts one) is not checked."""
    if sm_scale is None or isinstance(sm_scale, jax.core.Tracer):
        return
    if not math.isfinite(float(sm_scale)):
        raise ValueError(f"sm_scale must be a finite number; got {sm_scale!r}")


def attention_reference(
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
    """Plain-jnp attention with `flash_attention`'s signature, semantics and outputs.

    Materialises the `[batch, heads, q_len, kv_len]` logits in float32 (HIGHEST precision), so it
    is for tests and small inputs. `block_sizes` and `interpret` are accepted for drop-in use and
    ignored. Raises ValueError like `flash_attention`.
    """
    del block_sizes, interpret
    check_attention_inputs(q, k, v, q_positions, kv_positions)
    check_sm_scale(sm_scale)
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    group = q.shape[2] // k.shape[2]
    key_valid = kv_positions >= 0  # [batch, kv_len]
    k = jnp.repeat(k.astype(jnp.float32), group, axis=2)  # [batch, kv_len, num_q_heads, d]
    v = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    v = jnp.where(key_valid[:, :, None, None], v, 0.0)  # padding V is never read
    logits = jnp.einsum(
        "bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision=lax.Precision.HIGHEST
    ) * scale
    seen = key_valid[:, None, :] & (kv_positions[:, None, :] <= q_positions[:, :, None])
    seen = seen[:, None, :, :]  # [batch, 1, q_len, kv_len]
    logits = jnp.where(seen, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [batch, heads, q_len]; -inf for empty rows
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    probs = jnp.where(seen, jnp.exp(logits - lse_safe[..., None]), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype), jnp.transpose(lse, (0, 2, 1))
