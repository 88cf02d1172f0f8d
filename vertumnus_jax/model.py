"""A Qwen3-style decoder in Flax NNX: dense (Qwen3) and mixture-of-experts (Qwen3-MoE).

Per layer (pre-norm): `x += o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))` over
`input_layernorm(x)`, then `x += mlp(post_attention_layernorm(x))` where the MLP is SwiGLU
(`down(silu(gate(x)) * up(x))`) or a top-k MoE of SwiGLU experts. A final RMSNorm and the LM head
(tied to the embedding or not) give the logits.

The attention itself is injected: a layer computes q, k, v (RoPE at the *global* positions it
is given) and calls `attend(layer, q, k, v) -> out`. A plain causal prefill passes
`causal_attention(positions)`; the zigzag CP prefill (`vertumnus_jax.prefill`) passes a function
that all-gathers K/V over the `cp` axis, adds the cached prefix from the KV pool and calls the
Pallas kernel with global positions.

Parameter names and semantics follow Hugging Face transformers' `modeling_qwen3.py` and
`modeling_qwen3_moe.py` (v5): RMSNorm in float32 then `weight * x.to(dtype)`; default RoPE with
`rotate_half`; router softmax in float32, top-k, renormalised when `norm_topk_prob`. Linear
weights are stored `[in, out]` (HF stores `[out, in]`; `checkpoint.py` transposes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from pallas_kernels import attention_reference
from vertumnus_jax.config import ModelConfig

# attend(layer, q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d]) -> out [T, Hq, d]
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis: `weight * (x / sqrt(mean(x^2) + eps))`, statistics in f32."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (default RoPE, `rotate_half` layout) at global positions.

    Args:
      x: `[T, heads, head_dim]`.
      positions: `[T]` int32 global positions (any value for padding rows).
      theta: rotary base.
    Returns `x`'s shape and dtype. Source: Su et al. 2021 (arXiv 2104.09864); HF
    `apply_rotary_pos_emb` with `inv_freq = theta ** -(arange(0, d, 2) / d)`.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [d/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = jnp.cos(angles).astype(x.dtype)[:, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    """Grouped-query attention projections with Qwen3's per-head Q/K RMSNorm."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, std = jnp.dtype(cfg.dtype), cfg.init_std
        d, hq, hkv = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
        self.q_proj = _normal(rngs, (cfg.hidden_size, hq * d), std, dt)
        self.k_proj = _normal(rngs, (cfg.hidden_size, hkv * d), std, dt)
        self.v_proj = _normal(rngs, (cfg.hidden_size, hkv * d), std, dt)
        self.o_proj = _normal(rngs, (hq * d, cfg.hidden_size), std, dt)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        self.head_dim, self.theta = d, cfg.rope_theta

    def qkv(self, x: jax.Array, positions: jax.Array):
        """`x [T, D]`, `positions [T]` -> q `[T, Hq, d]`, k, v `[T, Hkv, d]` (q, k after RoPE)."""
        t, d = x.shape[0], self.head_dim
        q = self.q_norm((x @ self.q_proj[...]).reshape(t, -1, d))
        k = self.k_norm((x @ self.k_proj[...]).reshape(t, -1, d))
        v = (x @ self.v_proj[...]).reshape(t, -1, d)
        return apply_rope(q, positions, self.theta), apply_rope(k, positions, self.theta), v

    def out(self, attn: jax.Array) -> jax.Array:
        """`attn [T, Hq, d]` -> `[T, D]`."""
        return attn.reshape(attn.shape[0], -1) @ self.o_proj[...]


class MLP(nnx.Module):
    """SwiGLU MLP: `down(silu(x @ gate) * (x @ up))`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, std, inter = jnp.dtype(cfg.dtype), cfg.init_std, cfg.intermediate_size
        self.gate_proj = _normal(rngs, (cfg.hidden_size, inter), std, dt)
        self.up_proj = _normal(rngs, (cfg.hidden_size, inter), std, dt)
        self.down_proj = _normal(rngs, (inter, cfg.hidden_size), std, dt)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = jax.nn.silu(x @ self.gate_proj[...]) * (x @ self.up_proj[...])
        return hidden @ self.down_proj[...]


class MoE(nnx.Module):
    """Top-k mixture of SwiGLU experts (Qwen3-MoE's sparse block), grouped by expert.

    Router: `softmax(x @ router)` in float32, top-k, renormalised when `norm_topk_prob`. The
    `T * k` (token, expert) pairs are sorted by expert and run as grouped matmuls
    (`lax.ragged_dot`), so compute is proportional to k, not to the number of experts; no token
    is dropped. Weights: router `[D, E]`, gate/up `[E, D, I]`, down `[E, I, D]`.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, std = jnp.dtype(cfg.dtype), cfg.init_std
        e, dim, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = _normal(rngs, (dim, e), std, dt)
        self.gate_proj = _normal(rngs, (e, dim, inter), std, dt)
        self.up_proj = _normal(rngs, (e, dim, inter), std, dt)
        self.down_proj = _normal(rngs, (e, inter, dim), std, dt)
        self.top_k, self.norm_topk_prob, self.num_experts = (
            cfg.num_experts_per_tok, cfg.norm_topk_prob, e)

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.top_k
        probs = jax.nn.softmax((x @ self.router[...]).astype(jnp.float32), axis=-1)  # [T, E]
        weights, experts = lax.top_k(probs, k)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        flat = experts.reshape(-1)  # [T*k]
        order = jnp.argsort(flat, stable=True)
        token = order // k  # the token of each sorted (token, expert) pair
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        xs = x[token]  # [T*k, D]
        hidden = jax.nn.silu(lax.ragged_dot(xs, self.gate_proj[...], sizes)) * lax.ragged_dot(
            xs, self.up_proj[...], sizes)
        ys = lax.ragged_dot(hidden, self.down_proj[...], sizes)  # [T*k, D]
        ys = ys * weights.reshape(-1)[order].astype(x.dtype)[:, None]
        return jnp.zeros_like(x).at[token].add(ys)


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer: attention then MLP (dense or MoE), each with a residual."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.mlp = MoE(cfg, rngs) if cfg.is_moe_layer(layer) else MLP(cfg, rngs)
        self.layer = layer

    def __call__(self, x: jax.Array, positions: jax.Array, attend: AttentionFn) -> jax.Array:
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions)
        x = x + self.self_attn.out(attend(self.layer, q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nnx.Module):
    """The decoder: embedding, `num_layers` decoder layers, final RMSNorm, LM head.

    Construct with seeded random weights: `Qwen3(config, rngs=nnx.Rngs(seed))` (matrices
    `normal(0, init_std)`, norm weights one); load real weights with `checkpoint.py`.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.config = config
        self.embed_tokens = _normal(rngs, (config.vocab_size, config.hidden_size),
                                    config.init_std, dt)
        self.layers = nnx.List([DecoderLayer(config, i, rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        if not config.tie_word_embeddings:
            self.lm_head = _normal(rngs, (config.hidden_size, config.vocab_size),
                                   config.init_std, dt)

    def hidden_states(self, token_ids: jax.Array, positions: jax.Array,
                      attend: AttentionFn) -> jax.Array:
        """`token_ids [T]` int32, `positions [T]` int32 -> final-normed hidden `[T, D]`."""
        x = self.embed_tokens[...][token_ids]
        for layer in self.layers:
            x = layer(x, positions, attend)
        return self.norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """`hidden [..., D]` -> float32 logits `[..., V]` (tied head = embedding transposed)."""
        if self.config.tie_word_embeddings:
            return (hidden @ self.embed_tokens[...].T).astype(jnp.float32)
        return (hidden @ self.lm_head[...]).astype(jnp.float32)


def init_model(config: ModelConfig, seed: int = 0) -> Qwen3:
    """The model with seeded random weights (`jax.random` key `seed`)."""
    return Qwen3(config, rngs=nnx.Rngs(seed))


def causal_attention(positions: jax.Array, kernel=attention_reference, **kernel_kwargs
                     ) -> AttentionFn:
    """Single-sequence causal-by-position attention over the layer's own tokens.

    `positions [T]` int32 (negative = padding). `kernel` is `attention_reference` (default,
    dense jnp) or `pallas_kernels.flash_attention`; `kernel_kwargs` go to it.
    """
    pos = positions[None].astype(jnp.int32)

    def attend(layer, q, k, v):
        del layer
        out, _ = kernel(q[None], k[None], v[None], pos, pos, **kernel_kwargs)
        return out[0]

    return attend


@functools.partial(jax.jit, static_argnames=("graphdef", "use_pallas"))
def _full_prefill(graphdef, state, token_ids, *, use_pallas: bool):
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    keys, values = [], []
    if use_pallas:
        from pallas_kernels import flash_attention as kernel
    else:
        kernel = attention_reference
    inner = causal_attention(positions, kernel)

    def attend(layer, q, k, v):
        keys.append(k)
        values.append(v)
        return inner(layer, q, k, v)

    hidden = model.hidden_states(token_ids, positions, attend)
    return model.logits(hidden), jnp.stack(keys), jnp.stack(values)


def full_prefill(model: Qwen3, token_ids, *, use_pallas: bool = False):
    """Plain single-device prefill of a whole prompt (the reference for CP prefill).

    Args:
      model: the model.
      token_ids: `[T]` ints in `[0, vocab_size)`, T >= 1.
      use_pallas: attention by the Pallas kernel instead of the dense jnp reference.

    Returns:
      `(logits [T, V] float32, keys [layers, T, Hkv, d], values [layers, T, Hkv, d])`: logits
      at every position and the K (after norm and RoPE) and V every layer caches.

    Raises:
      ValueError: on an empty prompt or a token outside the vocabulary.
    """
    ids = jnp.asarray(token_ids, jnp.int32)
    if ids.ndim != 1 or ids.shape[0] < 1:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
    vocab = model.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"token_ids must be in [0, {vocab}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    graphdef, state = nnx.split(model)
    return _full_prefill(graphdef, state, ids, use_pallas=use_pallas)
