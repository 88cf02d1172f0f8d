"""HF checkpoint loading (equivalence with transformers' Qwen3 / Qwen3-MoE), errors, orbax."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from vertumnus_jax.checkpoint import (
    CheckpointError,
    load_hf_checkpoint,
    restore_params,
    save_params,
)
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import full_prefill, init_model

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors not installed")


def hf_tensors(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded random weights under the published Qwen3 / Qwen3-MoE tensor names ([out, in])."""
    rng = np.random.default_rng(seed)

    def n(*shape, std=0.1):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    dim, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    t = {"model.embed_tokens.weight": n(cfg.vocab_size, dim, std=0.5),
         "model.norm.weight": 1 + n(dim)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = n(cfg.vocab_size, dim)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + n(dim)
        t[p + "post_attention_layernorm.weight"] = 1 + n(dim)
        t[p + "self_attn.q_proj.weight"] = n(hq * d, dim)
        t[p + "self_attn.k_proj.weight"] = n(hkv * d, dim)
        t[p + "self_attn.v_proj.weight"] = n(hkv * d, dim)
        t[p + "self_attn.o_proj.weight"] = n(dim, hq * d)
        t[p + "self_attn.q_norm.weight"] = 1 + n(d)
        t[p + "self_attn.k_norm.weight"] = 1 + n(d)
        if cfg.is_moe_layer(i):
            inter = cfg.moe_intermediate_size
            t[p + "mlp.gate.weight"] = n(cfg.num_experts, dim, std=0.5)
            for e in range(cfg.num_experts):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = n(inter, dim)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = n(inter, dim)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = n(dim, inter)
        else:
            inter = cfg.intermediate_size
            t[p + "mlp.gate_proj.weight"] = n(inter, dim)
            t[p + "mlp.up_proj.weight"] = n(inter, dim)
            t[p + "mlp.down_proj.weight"] = n(dim, inter)
    return t


def write_hf(path, cfg: ModelConfig, tensors: dict[str, np.ndarray], shards: int = 1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::shards]}
        safetensors_numpy.save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}  # HF's sharded-checkpoint index
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


HF_CASES = {
    "dense": ModelConfig.tiny(),
    "dense-tied": ModelConfig.tiny(tie_word_embeddings=True),
    "moe": ModelConfig.tiny_moe(num_layers=3, mlp_only_layers=(1,)),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_equal_transformers(tmp_path, case):
    torch = pytest.importorskip("torch", reason="torch (test-only dependency) not installed")
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    cfg = HF_CASES[case]
    path = write_hf(tmp_path / case, cfg, hf_tensors(cfg, seed=11), shards=2)
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 96)
    with torch.no_grad():
        want = hf_model(torch.tensor(ids[None])).logits[0].numpy()
    model = load_hf_checkpoint(path)
    assert model.config.num_experts == cfg.num_experts
    got, _, _ = full_prefill(model, ids)
    assert np.abs(want).mean() > 0.1  # non-trivial logits
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def test_missing_or_misshaped_tensor_is_named(tmp_path):
    cfg = ModelConfig.tiny_moe()
    tensors = hf_tensors(cfg, seed=0)
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    del tensors[name]
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_hf_checkpoint(write_hf(tmp_path / "missing", cfg, tensors))
    tensors = hf_tensors(cfg, seed=0)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:, :-1]
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(32, 63\), expected "
                                              r"\(32, 64\)"):
        load_hf_checkpoint(write_hf(tmp_path / "shape", cfg, tensors))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path / "nowhere")


def _expect(tmp_path, name, tensors, match, **config_fields):
    cfg = ModelConfig.tiny()
    path = write_hf(tmp_path / name, cfg, tensors)
    if config_fields:
        hf = {**cfg.to_hf_config(), **config_fields}
        (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(path)


def test_unexpected_duplicated_and_non_float_tensors_are_named(tmp_path):
    cfg = ModelConfig.tiny()  # 2 layers, untied
    base = hf_tensors(cfg, seed=1)
    up = "model.layers.0.mlp.up_proj.weight"
    _expect(tmp_path, "layer2", {**base, "model.layers.2.mlp.up_proj.weight": base[up]},
            r"unexpected tensor\(s\) 'model.layers.2.mlp.up_proj.weight' \(layer 2 >= "
            r"num_hidden_layers=2\)")
    _expect(tmp_path, "bias", {**base, "model.layers.0.self_attn.q_proj.bias":
                               np.ones(64, np.float32)}, "'model.layers.0.self_attn.q_proj.bias'")
    _expect(tmp_path, "fp8", {**base, up + "_scale_inv": np.ones((1, 1), np.float32)},
            f"'{up}_scale_inv' \\(quantised checkpoints are not supported\\)")
    _expect(tmp_path, "quant", base, "quantization_config",
            quantization_config={"quant_method": "fp8"})
    _expect(tmp_path, "int", {**base, up: base[up].astype(np.int32)}, f"'{up}' has dtype int32")
    _expect(tmp_path, "tied", base, "'lm_head.weight' differs", tie_word_embeddings=True)
    stale = write_hf(tmp_path / "stale", cfg, base, shards=2)
    safetensors_numpy.save_file({"model.norm.weight": base["model.norm.weight"] + 1},
                                str(stale / "zz-stale.safetensors"))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is in two files: "
                                              "model-00001-of-00002.safetensors and zz-stale"):
        load_hf_checkpoint(stale)
    # A tied checkpoint may carry an identical copy of the embedding as lm_head.weight.
    tied = ModelConfig.tiny(tie_word_embeddings=True)
    plain = hf_tensors(tied, seed=1)
    with_head = {**plain, "lm_head.weight": plain["model.embed_tokens.weight"]}
    got = [nnx.to_pure_dict(nnx.state(load_hf_checkpoint(write_hf(tmp_path / n, tied, t))))
           for n, t in (("plain", plain), ("with_head", with_head))]
    jax.tree_util.tree_map(np.testing.assert_array_equal, got[0], got[1])
    np.testing.assert_array_equal(got[0]["embed_tokens"], plain["model.embed_tokens.weight"])


def test_orbax_round_trip(tmp_path):
    cfg = ModelConfig.tiny_moe(mlp_only_layers=(0,))
    model = init_model(cfg, seed=4)
    save_params(model, tmp_path / "ckpt")
    restored = restore_params(cfg, tmp_path / "ckpt")
    want = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))
    got = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(restored))))
    assert len(want) == len(got) == 26
    for path, leaf in want:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(leaf))
    with pytest.raises(FileNotFoundError):
        restore_params(cfg, tmp_path / "absent")


@pytest.mark.parametrize("text, message", [("[]", "JSON object, got list"),
                                           ('{"model_type": ', "not valid JSON")])
def test_config_json_that_is_not_an_object(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message) as e:
        load_hf_checkpoint(tmp_path)
    assert "config.json" in str(e.value)
