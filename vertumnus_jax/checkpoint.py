"""Loading Hugging Face Qwen3 / Qwen3-MoE checkpoints, and orbax save/restore of our parameters.

A Hugging Face checkpoint directory holds `config.json` and one or more `*.safetensors` files
with Qwen3 tensor names (`model.layers.{i}.self_attn.q_proj.weight`, ...; MoE experts either
per expert, `mlp.experts.{e}.gate_proj.weight` as published, or fused as transformers v5 keeps
them in memory, `mlp.experts.gate_up_proj`). Linear weights are `[out, in]` there and `[in, out]`
here. Nothing is downloaded: the directory must exist locally.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import Qwen3


class CheckpointError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape (the message names it)."""


def _abstract(config: ModelConfig):
    model = nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return graphdef, state, nnx.to_pure_dict(state)


def _set(tree: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def _get(tree: dict, path: tuple):
    for p in path:
        tree = tree[p]
    return tree


def load_hf_tensors(config: ModelConfig, get: Callable[[str], np.ndarray | None],
                    source: str = "checkpoint") -> Qwen3:
    """Builds the model from HF-named tensors.

    Args:
      config: the model config (shapes are checked against it).
      get: `name -> array` (numpy or jax, any float dtype), or None when absent.
      source: a label for error messages (e.g. the directory).

    Returns:
      The model, parameters cast to `config.dtype`.

    Raises:
      CheckpointError: naming the first missing tensor, or a tensor whose shape differs from
        the one `config` implies (both shapes in the message).
    """
    graphdef, state, pure = _abstract(config)
    dtype = jnp.dtype(config.dtype)

    def fetch(name: str, shape: tuple) -> jax.Array:
        x = get(name)
        if x is None:
            raise CheckpointError(f"{source}: missing tensor {name!r} (expected shape {shape})")
        if tuple(x.shape) != tuple(shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(x.shape)}, "
                                  f"expected {tuple(shape)}")
        return jnp.asarray(x).astype(dtype)

    def linear(name: str, path: tuple) -> None:  # HF [out, in] -> ours [in, out]
        din, dout = _get(pure, path).shape
        _set(pure, path, fetch(name, (dout, din)).T)

    def vector(name: str, path: tuple) -> None:
        _set(pure, path, fetch(name, _get(pure, path).shape))

    vector("model.embed_tokens.weight", ("embed_tokens",))
    vector("model.norm.weight", ("norm", "weight"))
    if not config.tie_word_embeddings:
        linear("lm_head.weight", ("lm_head",))
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", ("layers", i)
        vector(f"{hf}.input_layernorm.weight", ours + ("input_layernorm", "weight"))
        vector(f"{hf}.post_attention_layernorm.weight",
               ours + ("post_attention_layernorm", "weight"))
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear(f"{hf}.self_attn.{p}.weight", ours + ("self_attn", p))
        for p in ("q_norm", "k_norm"):
            vector(f"{hf}.self_attn.{p}.weight", ours + ("self_attn", p, "weight"))
        mlp = ours + ("mlp",)
        if config.is_dense_layer(i):
            for p in ("gate_proj", "up_proj", "down_proj"):
                linear(f"{hf}.mlp.{p}.weight", mlp + (p,))
            continue
        linear(f"{hf}.mlp.gate.weight", mlp + ("router",))
        e, dim, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        if get(f"{hf}.mlp.experts.gate_up_proj") is not None:  # transformers v5 fused layout
            gate_up = fetch(f"{hf}.mlp.experts.gate_up_proj", (e, 2 * inter, dim))
            _set(pure, mlp + ("gate_proj",), gate_up[:, :inter].swapaxes(1, 2))
            _set(pure, mlp + ("up_proj",), gate_up[:, inter:].swapaxes(1, 2))
            down = fetch(f"{hf}.mlp.experts.down_proj", (e, dim, inter))
            _set(pure, mlp + ("down_proj",), down.swapaxes(1, 2))
            continue
        for p, shape in (("gate_proj", (inter, dim)), ("up_proj", (inter, dim)),
                         ("down_proj", (dim, inter))):
            _set(pure, mlp + (p,), jnp.stack(
                [fetch(f"{hf}.mlp.experts.{j}.{p}.weight", shape).T for j in range(e)]))
    unset = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(pure)
             if isinstance(x, jax.ShapeDtypeStruct)]
    if unset:  # a parameter with no checkpoint mapping: a bug in this file, not in the input
        raise AssertionError(f"parameters not loaded: {unset}")
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: str | None = None) -> Qwen3:
    """Loads a Hugging Face Qwen3 / Qwen3-MoE checkpoint directory.

    Args:
      path: a local directory with `config.json` and `*.safetensors`.
      dtype: parameter dtype; default the config's `torch_dtype` (else float32).

    Returns:
      The model (its `config` from `ModelConfig.from_hf_config`).

    Raises:
      FileNotFoundError: when the directory, `config.json` or any `*.safetensors` is absent.
      ValueError: for an unsupported config (see `ModelConfig.from_hf_config`).
      CheckpointError: naming a missing tensor or one of the wrong shape.
    """
    from safetensors import safe_open  # a runtime dependency only of checkpoint loading

    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in checkpoint directory {path!r}")
    with open(cfg_path) as f:
        config = ModelConfig.from_hf_config(json.load(f), name=os.path.basename(path),
                                            dtype=dtype)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path!r}")
    handles = [safe_open(f, framework="flax") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def get(name: str):
        h = where.get(name)
        return None if h is None else h.get_tensor(name)

    return load_hf_tensors(config, get, source=path)


def save_params(model: Qwen3, path: str | os.PathLike) -> None:
    """Saves the model's parameters with orbax (a new directory `path`, absolute or relative).

    Raises ValueError (from orbax) when `path` already exists.
    """
    import orbax.checkpoint as ocp

    pure = nnx.to_pure_dict(nnx.state(model))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(os.fspath(path)), pure)
        ckpt.wait_until_finished()


def restore_params(config: ModelConfig, path: str | os.PathLike) -> Qwen3:
    """Restores a model of `config` saved by `save_params`.

    Raises FileNotFoundError when `path` does not exist, and orbax's error on a structure or
    shape mismatch with `config`.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    graphdef, state, pure = _abstract(config)
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pure)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(path, target)
    nnx.replace_by_pure_dict(state, _as_int_keys(restored))
    return nnx.merge(graphdef, state)


def _as_int_keys(tree):
    """Orbax returns the layer list's integer keys as strings; map them back."""
    if isinstance(tree, Mapping):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _as_int_keys(v)
                for k, v in tree.items()}
    return tree
