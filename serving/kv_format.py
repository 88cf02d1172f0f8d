"""The binary layout of a pulled prompt KV (`GET /v1/kv/{request_id}`): safetensors.

One safetensors file (https://huggingface.co/docs/safetensors, the format checkpoints use)
holds, for every layer `i` of the model, two tensors:

  `layers.{i}.key`    [num_tokens, num_kv_heads, head_dim]  K after the layer's k-norm and RoPE
                      at the token's absolute position (what attention reads)
  `layers.{i}.value`  [num_tokens, num_kv_heads, head_dim]  V as projected

in natural token order (token 0 first, whatever the CP degree and block striping that held them),
in the model's dtype (`F32`, `BF16` or `F16`). Its `__metadata__` (strings, as safetensors
wants) carries `format` (`vertumnus-kv/1`), `request_id`, `model`, `num_tokens`, `num_layers`,
`num_kv_heads`, `head_dim`, `dtype`, and where the blocks lay: `block_size`, `cp_degree`.

Any safetensors reader opens it (`safetensors.torch.load(data)` on the decode side of a PyTorch
stack); `load_kv` is ours, on numpy (bfloat16 via `ml_dtypes`, which JAX ships).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import safetensors
from safetensors.numpy import save

FORMAT = "vertumnus-kv/1"
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def kv_to_safetensors(k: np.ndarray, v: np.ndarray, metadata: dict[str, object]) -> bytes:
    """Serialises a prompt's KV.

    Args:
      k, v: `[layers, num_tokens, kv_heads, head_dim]`, float32, float16 or bfloat16.
      metadata: extra header fields (values turned into strings); `format`, `num_tokens`,
        `num_layers`, `num_kv_heads`, `head_dim` and `dtype` are filled in.

    Raises:
      ValueError: `k` and `v` of different or non-4-D shapes.
    """
    k, v = np.asarray(k), np.asarray(v)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must be [layers, tokens, kv_heads, head_dim] of one shape, "
                         f"got {k.shape} and {v.shape}")
    layers, tokens, heads, dim = k.shape
    meta = {key: str(value) for key, value in metadata.items()}
    meta.update(format=FORMAT, num_tokens=str(tokens), num_layers=str(layers),
                num_kv_heads=str(heads), head_dim=str(dim), dtype=str(k.dtype))
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.key"] = np.ascontiguousarray(k[i])
        tensors[f"layers.{i}.value"] = np.ascontiguousarray(v[i])
    return save(tensors, metadata=meta)


def load_kv(data: bytes) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """Reads what `kv_to_safetensors` wrote.

    Returns:
      `(k, v, metadata)`: k, v numpy `[layers, num_tokens, kv_heads, head_dim]`.

    Raises:
      ValueError: not safetensors, or not this layout (a layer's key or value missing).
    """
    try:
        tensors = dict(safetensors.deserialize(data))
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    except Exception as e:  # SafetensorError, JSON, short data
        raise ValueError(f"not a safetensors KV payload: {type(e).__name__}: {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"format must be {FORMAT!r}, got {meta.get('format')!r}")
    layers = int(meta["num_layers"])

    def tensor(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"KV payload lacks tensor {name!r}")
        t = tensors[name]
        return np.frombuffer(t["data"], _DTYPES[t["dtype"]]).reshape(t["shape"])

    k = np.stack([tensor(f"layers.{i}.key") for i in range(layers)])
    v = np.stack([tensor(f"layers.{i}.value") for i in range(layers)])
    return k, v, meta
