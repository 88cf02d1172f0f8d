"""Model pieces against independent numpy formulas; the plain prefill with either attention."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import MoE, apply_rope, full_prefill, init_model


def test_rope_is_complex_rotation_at_global_positions():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    pos = np.array([0, 1, 7, 300, 4095], np.int32)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), 10_000.0))
    # rotate_half layout: pairs (i, i + d/2) rotate by pos * theta^(-2i/d).
    freq = 10_000.0 ** (-np.arange(4) * 2 / 8)
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * pos[:, None, None] * freq)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), atol=2e-4)


def test_moe_matches_per_token_loop():
    cfg = ModelConfig.tiny_moe(num_experts=4, num_experts_per_tok=2)
    moe = MoE(cfg, nnx.Rngs(3))
    x = np.random.default_rng(1).standard_normal((9, cfg.hidden_size)).astype(np.float32)
    got = np.asarray(moe(jnp.asarray(x)))
    router, gate, up, down = (np.asarray(p[...], np.float64) for p in
                              (moe.router, moe.gate_proj, moe.up_proj, moe.down_proj))
    want = np.zeros_like(x, dtype=np.float64)

    def silu(a):
        return a / (1 + np.exp(-a))

    for t in range(9):
        logits = x[t] @ router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:2]
        w = p[top] / p[top].sum()
        for e, we in zip(top, w, strict=True):
            want[t] += we * (silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e]
    assert len({tuple(np.argsort(-(x[t] @ router))[:2]) for t in range(9)}) > 1
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_full_prefill_pallas_equals_reference_and_is_causal():
    model = init_model(ModelConfig.tiny(), 0)
    ids = np.random.default_rng(2).integers(0, 256, 40)
    logits, k, v = full_prefill(model, ids)
    logits_p, k_p, v_p = full_prefill(model, ids, use_pallas=True)
    np.testing.assert_allclose(np.asarray(logits_p), np.asarray(logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(k_p), np.asarray(k), atol=1e-5)
    assert logits.shape == (40, 256) and k.shape == (2, 40, 2, 16)
    # Causality: a prefix's logits do not depend on later tokens.
    short, _, _ = full_prefill(model, ids[:25])
    np.testing.assert_allclose(np.asarray(short), np.asarray(logits)[:25], atol=1e-5)


def test_full_prefill_rejects_bad_tokens():
    model = init_model(ModelConfig.tiny(), 0)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        full_prefill(model, [1, 256])
    with pytest.raises(ValueError, match="non-empty"):
        full_prefill(model, [])


def test_config_validation_and_hf_round_trip():
    for cfg in (ModelConfig.tiny(), ModelConfig.tiny_moe(mlp_only_layers=(0,)),
                ModelConfig.qwen3_0_6b(), ModelConfig.qwen3_8b(), ModelConfig.qwen3_30b_a3b()):
        back = ModelConfig.from_hf_config(cfg.to_hf_config(), name=cfg.name)
        assert back == dataclasses.replace(cfg, init_std=back.init_std)  # init_std is ours
    assert ModelConfig.qwen3_30b_a3b().is_moe_layer(0)
    assert not ModelConfig.tiny_moe(mlp_only_layers=(0,)).is_moe_layer(0)
    with pytest.raises(ValueError, match="num_q_heads"):
        ModelConfig.tiny(num_q_heads=3)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.tiny_moe(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config({"model_type": "llama"})
    hf = ModelConfig.tiny().to_hf_config()
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf_config({**hf, "rope_scaling": {"rope_type": "yarn"}})
    del hf["vocab_size"]
    with pytest.raises(ValueError, match="'vocab_size'"):
        ModelConfig.from_hf_config(hf)


def test_hf_config_nulls_and_unsupported_features():
    hf = ModelConfig.tiny(num_kv_heads=4).to_hf_config()
    # As in transformers: a null num_key_value_heads means multi-head attention.
    assert ModelConfig.from_hf_config({**hf, "num_key_value_heads": None}).num_kv_heads == 4
    assert ModelConfig.from_hf_config({**hf, "head_dim": None}).head_dim == 64 // 4
    assert ModelConfig.from_hf_config(
        {**hf, "rope_theta": None, "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 500.0}}).rope_theta == 500.0
    bad = {
        "'rms_norm_eps' must not be null": {"rms_norm_eps": None},
        "rope_scaling rope_type must be 'default'": {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
            "rope_scaling": {"type": "linear", "factor": 2.0}},
        "rope_parameters rope_type must be 'default'": {
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10_000.0}},
        "layer_types must all be 'full_attention'": {
            "layer_types": ["sliding_attention", "full_attention"]},
        "quantization_config": {"quantization_config": {"quant_method": "fp8"}},
        "'vocab_size' must be a JSON int": {"vocab_size": "256"},
        "rope_theta .* differ": {"rope_parameters": {"rope_theta": 5.0}},
    }
    for message, fields in bad.items():
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_config({**hf, **fields})
