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
from collections.abc import Callable, Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import Qwen3


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: a missing, unexpected, duplicated, misshaped
    or non-float tensor, or an unsupported config.json (the message names the tensor or field).
    """


_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


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


def _unexpected(config: ModelConfig, names: list[str], source: str) -> CheckpointError:
    def why(name: str) -> str:
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit() and \
                int(parts[2]) >= config.num_layers:
            return f" (layer {parts[2]} >= num_hidden_layers={config.num_layers})"
        if "scale" in parts[-1] or parts[-1].startswith(("qweight", "qzeros", "g_idx")):
            return " (quantised checkpoints are not supported)"
        return ""

    shown = ", ".join(f"{n!r}{why(n)}" for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return CheckpointError(f"{source}: unexpected tensor(s) {shown}{more}; a Qwen3 checkpoint "
                           "for this config has none of them")


def load_hf_tensors(config: ModelConfig, get: Callable[[str], np.ndarray | None],
                    source: str = "checkpoint", names: Collection[str] | None = None) -> Qwen3:
    """Builds the model from HF-named tensors.

    Args:
      config: the model config (shapes are checked against it).
      get: `name -> array` (numpy or jax; float16, bfloat16, float32 or float64), or None when
        absent.
      source: a label for error messages (e.g. the directory).
      names: every tensor name the checkpoint holds; when given, a name the config does not
        use is an error (checked before any tensor is read).

    Returns:
      The model, parameters cast to `config.dtype`.

    Raises:
      CheckpointError: naming the first missing tensor, a tensor whose shape differs from the
        one `config` implies (both shapes in the message), a tensor of another dtype (integer,
        bool, float8: quantised checkpoints are not supported), unexpected tensors (extra
        layers, biases, quantisation scales, a mix of fused and per-expert MoE layouts), or an
        `lm_head.weight` that differs from the embedding while `tie_word_embeddings` is true
        (an identical copy is accepted).
    """
    graphdef, state, pure = _abstract(config)
    dtype = jnp.dtype(config.dtype)
    has = (lambda n: n in names) if names is not None else (lambda n: get(n) is not None)
    plan: list[tuple[str, tuple, Callable[[jax.Array], None]]] = []  # name, HF shape, store

    def fetch(name: str, shape: tuple) -> jax.Array:
        x = get(name)
        if x is None:
            raise CheckpointError(f"{source}: missing tensor {name!r} (expected shape {shape})")
        if tuple(x.shape) != tuple(shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(x.shape)}, "
                                  f"expected {tuple(shape)}")
        if jnp.dtype(x.dtype).name not in _FLOAT_DTYPES:
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {x.dtype}, expected one "
                                  f"of {_FLOAT_DTYPES} (quantised checkpoints are not supported)")
        return jnp.asarray(x).astype(dtype)

    def linear(name: str, path: tuple) -> None:  # HF [out, in] -> ours [in, out]
        din, dout = _get(pure, path).shape
        plan.append((name, (dout, din), lambda x: _set(pure, path, x.T)))

    def vector(name: str, path: tuple) -> None:
        plan.append((name, _get(pure, path).shape, lambda x: _set(pure, path, x)))

    stacks: dict[tuple, list] = {}  # per-expert tensors stacked into [E, in, out]

    def expert(name: str, shape: tuple, path: tuple, j: int) -> None:
        stacks.setdefault(path, [None] * config.num_experts)
        plan.append((name, shape, lambda x: stacks[path].__setitem__(j, x.T)))

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
        if has(f"{hf}.mlp.experts.gate_up_proj"):  # transformers v5 fused layout

            def gate_up(x, mlp=mlp, inter=inter):
                _set(pure, mlp + ("gate_proj",), x[:, :inter].swapaxes(1, 2))
                _set(pure, mlp + ("up_proj",), x[:, inter:].swapaxes(1, 2))

            plan.append((f"{hf}.mlp.experts.gate_up_proj", (e, 2 * inter, dim), gate_up))
            plan.append((f"{hf}.mlp.experts.down_proj", (e, dim, inter),
                         lambda x, mlp=mlp: _set(pure, mlp + ("down_proj",), x.swapaxes(1, 2))))
            continue
        for p, shape in (("gate_proj", (inter, dim)), ("up_proj", (inter, dim)),
                         ("down_proj", (dim, inter))):
            for j in range(e):
                expert(f"{hf}.mlp.experts.{j}.{p}.weight", shape, mlp + (p,), j)

    tied_head = config.tie_word_embeddings and names is not None and "lm_head.weight" in names
    if names is not None:
        extra = sorted(set(names) - {n for n, _, _ in plan} - ({"lm_head.weight"} if tied_head
                                                               else set()))
        if extra:
            raise _unexpected(config, extra, source)
    for name, shape, store in plan:
        store(fetch(name, shape))
    for path, parts in stacks.items():
        _set(pure, path, jnp.stack(parts))
    if tied_head:
        head = fetch("lm_head.weight", (config.vocab_size, config.hidden_size))
        if not bool(jnp.array_equal(head, pure["embed_tokens"])):
            raise CheckpointError(f"{source}: tensor 'lm_head.weight' differs from "
                                  "'model.embed_tokens.weight' while config.json has "
                                  "tie_word_embeddings=true")
    unset = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(pure)
             if isinstance(x, jax.ShapeDtypeStruct)]
    if unset:  # a parameter with no checkpoint mapping: a bug in this file, not in the input
        raise AssertionError(f"parameters not loaded: {unset}")
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: str | None = None) -> Qwen3:
    """Loads a Hugging Face Qwen3 / Qwen3-MoE checkpoint directory (unquantised weights only).

    Args:
      path: a local directory with `config.json` and `*.safetensors`.
      dtype: parameter dtype; default the config's `torch_dtype` (else float32).

    Returns:
      The model (its `config` from `ModelConfig.from_hf_config`).

    Raises:
      FileNotFoundError: when the directory, `config.json` or any `*.safetensors` is absent.
      CheckpointError: for an unsupported config.json (see `ModelConfig.from_hf_config`; a
        `quantization_config` included), an unreadable `*.safetensors` file, a tensor held by
        two files, and every tensor error of `load_hf_tensors` (missing, unexpected,
        misshaped, non-float), naming it.
    """
    from safetensors import SafetensorError, safe_open  # a dependency only of loading

    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in checkpoint directory {path!r}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf_config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object, got "
                              f"{type(hf_config).__name__}")
    try:
        config = ModelConfig.from_hf_config(hf_config, name=os.path.basename(path), dtype=dtype)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path!r}")
    where: dict[str, tuple[str, object]] = {}
    for file in files:
        try:
            handle = safe_open(file, framework="flax")
        except SafetensorError as e:
            raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e
        for name in handle.keys():
            if name in where:
                raise CheckpointError(f"{path}: tensor {name!r} is in two files: "
                                      f"{os.path.basename(where[name][0])} and "
                                      f"{os.path.basename(file)}")
            where[name] = (file, handle)

    def get(name: str):
        entry = where.get(name)
        return None if entry is None else entry[1].get_tensor(name)

    return load_hf_tensors(config, get, source=path, names=list(where))


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
