"""Model configuration of the Qwen3-style decoder (dense and mixture-of-experts).

`ModelConfig` is a frozen dataclass holding exactly the shapes and constants the forward pass
needs. Named configs: `tiny` / `tiny_moe` (built-in test models, seeded random weights, fast on
CPU; `tiny` has the shapes of `serving.policy.specs.MODELS["tiny"]`), and the shapes of Qwen3-0.6B,
Qwen3-8B and Qwen3-30B-A3B (from their Hugging Face `config.json` files) for profiling and for
loading real checkpoints. `from_hf_config` reads a Hugging Face Qwen3 / Qwen3-MoE config dict;
`to_hf_config` writes one (tests use it to build HF checkpoints).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")
_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Qwen3 / Qwen3-MoE decoder.

    Attributes:
      name: a label (e.g. "qwen3-8b").
      vocab_size: tokens in the vocabulary (V).
      hidden_size: residual stream width (D).
      num_layers: decoder layers.
      num_q_heads: query heads (Hq).
      num_kv_heads: key/value heads (Hkv); `num_q_heads % num_kv_heads == 0` (GQA).
      head_dim: per-head width (d); Qwen3 decouples it from D / Hq.
      intermediate_size: SwiGLU width of the dense MLP layers.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: rotary base (default RoPE, no scaling).
      tie_word_embeddings: LM head = embedding matrix transposed.
      num_experts: experts per MoE layer; 0 means a dense model.
      num_experts_per_tok: experts chosen per token (top-k).
      moe_intermediate_size: SwiGLU width of each expert.
      norm_topk_prob: renormalise the top-k router probabilities to sum to one.
      decoder_sparse_step: layer i is MoE when `(i + 1) % decoder_sparse_step == 0`.
      mlp_only_layers: layers forced to the dense MLP.
      dtype: parameter and activation dtype ("float32", "bfloat16" or "float16").
      init_std: standard deviation of the seeded random initialisation of matrices.

    Raises:
      ValueError: naming the field, for a non-positive size, heads not divisible, an unknown
        dtype, or MoE fields out of range.

    Source: Hugging Face transformers `Qwen3Config` / `Qwen3MoeConfig` (same field meanings).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    dtype: str = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "num_layers", "num_q_heads", "num_kv_heads",
                  "head_dim", "decoder_sparse_step"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{f} must be an int >= 1, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_q_heads ({self.num_q_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (RoPE), got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0 or not self.init_std > 0:
            raise ValueError("ModelConfig.rms_norm_eps, rope_theta and init_std must be > 0, got "
                             f"{self.rms_norm_eps}, {self.rope_theta}, {self.init_std}")
        if self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts="
                                 f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise ValueError("ModelConfig.moe_intermediate_size must be >= 1 for MoE, got "
                                 f"{self.moe_intermediate_size}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if any(self.is_dense_layer(i) for i in range(self.num_layers)) and \
                self.intermediate_size < 1:
            raise ValueError("ModelConfig.intermediate_size must be >= 1 when a layer is dense, "
                             f"got {self.intermediate_size}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) uses the MoE MLP (Qwen3-MoE's rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def is_dense_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` uses the dense SwiGLU MLP."""
        return not self.is_moe_layer(layer)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers at `dtype`."""
        item = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * item

    # ---- named configs ------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """The built-in test model: 2 layers, D=64, 4 query / 2 KV heads of 16, V=256."""
        base = dict(name="tiny", vocab_size=256, hidden_size=64, num_layers=2, num_q_heads=4,
                    num_kv_heads=2, head_dim=16, intermediate_size=128, rope_theta=10_000.0,
                    tie_word_embeddings=False, init_std=0.1)
        return cls(**{**base, **overrides})

    @classmethod
    def tiny_moe(cls, **overrides) -> ModelConfig:
        """`tiny` with every layer a top-2-of-8 MoE (expert width 32)."""
        base = dict(name="tiny-moe", num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=32, norm_topk_prob=True)
        return cls.tiny(**{**base, **overrides})

    @classmethod
    def qwen3_0_6b(cls, **overrides) -> ModelConfig:
        """Qwen/Qwen3-0.6B config.json shapes (tied embeddings)."""
        base = dict(name="qwen3-0.6b", vocab_size=151936, hidden_size=1024, num_layers=28,
                    num_q_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
                    tie_word_embeddings=True, dtype="bfloat16")
        return cls(**{**base, **overrides})

    @classmethod
    def qwen3_8b(cls, **overrides) -> ModelConfig:
        """Qwen/Qwen3-8B config.json shapes."""
        base = dict(name="qwen3-8b", vocab_size=151936, hidden_size=4096, num_layers=36,
                    num_q_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
                    dtype="bfloat16")
        return cls(**{**base, **overrides})

    @classmethod
    def qwen3_30b_a3b(cls, **overrides) -> ModelConfig:
        """Qwen/Qwen3-30B-A3B config.json shapes (every layer MoE, top-8 of 128)."""
        base = dict(name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48,
                    num_q_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                    norm_topk_prob=True, dtype="bfloat16")
        return cls(**{**base, **overrides})

    @classmethod
    def named(cls, name: str, **overrides) -> ModelConfig:
        """One of "tiny", "tiny-moe", "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b".

        Raises ValueError for another name.
        """
        table = {"tiny": cls.tiny, "tiny-moe": cls.tiny_moe, "qwen3-0.6b": cls.qwen3_0_6b,
                 "qwen3-8b": cls.qwen3_8b, "qwen3-30b-a3b": cls.qwen3_30b_a3b}
        if name not in table:
            raise ValueError(f"model name must be one of {sorted(table)}, got {name!r}")
        return table[name](**overrides)

    # ---- Hugging Face config.json -------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, name: str | None = None,
                       dtype: str | None = None) -> ModelConfig:
        """Reads a Hugging Face `Qwen3Config` / `Qwen3MoeConfig` dict (a `config.json`).

        `dtype` defaults to the config's `torch_dtype` / `dtype` (else float32). RoPE theta is
        read from `rope_theta` or `rope_parameters["rope_theta"]` (equal when both are given).
        As in transformers, `num_key_value_heads: null` means `num_attention_heads` and
        `head_dim: null` means `hidden_size // num_attention_heads`; other fields must not be
        null.

        Raises:
          ValueError: naming the field, for a `model_type` other than "qwen3" / "qwen3_moe", a
            missing or null field, a field of the wrong JSON type, or a feature this model does
            not implement: RoPE scaling (a non-default `rope_type` in `rope_parameters` or
            `rope_scaling`), sliding-window attention (`use_sliding_window`, a `layer_types`
            entry other than "full_attention"), attention bias, an activation other than SiLU,
            or quantisation (`quantization_config`: quantised checkpoints are not supported).
        """
        model_type = hf.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"config.json model_type must be 'qwen3' or 'qwen3_moe', "
                             f"got {model_type!r}")
        types = {int: (int,), float: (int, float), bool: (bool,), dict: (dict,), list: (list,),
                 str: (str,)}

        def get(key, kind, default=_ABSENT, null=_ABSENT):
            if key not in hf:
                if default is _ABSENT:
                    raise ValueError(f"config.json is missing field {key!r}")
                return default
            v = hf[key]
            if v is None:
                if null is _ABSENT:
                    raise ValueError(f"config.json field {key!r} must not be null")
                return null
            if not isinstance(v, types[kind]) or (kind is not bool and isinstance(v, bool)):
                raise ValueError(f"config.json field {key!r} must be a JSON {kind.__name__}, "
                                 f"got {v!r}")
            return v

        if get("quantization_config", dict, None, None):
            raise ValueError("config.json has a quantization_config: quantised checkpoints are "
                             "not supported")
        rope = get("rope_parameters", dict, {}, {})
        scaling = get("rope_scaling", dict, {}, {})
        for key, params in (("rope_parameters", rope), ("rope_scaling", scaling)):
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in (None, "default"):
                raise ValueError(f"config.json {key} rope_type must be 'default' (no RoPE "
                                 f"scaling), got {kind!r}")
        theta = get("rope_theta", float, None, None)
        if "rope_theta" in rope:
            if theta is not None and float(rope["rope_theta"]) != float(theta):
                raise ValueError(f"config.json rope_theta ({theta}) and rope_parameters"
                                 f"['rope_theta'] ({rope['rope_theta']}) differ")
            theta = rope["rope_theta"]
        if theta is None:
            raise ValueError("config.json is missing field 'rope_theta'")
        if get("use_sliding_window", bool, False, False):
            raise ValueError("config.json use_sliding_window must be false (not implemented)")
        layer_types = get("layer_types", list, [], [])
        if any(t != "full_attention" for t in layer_types):
            raise ValueError("config.json layer_types must all be 'full_attention' (sliding "
                             f"window not implemented), got {sorted(set(layer_types))}")
        if get("attention_bias", bool, False, False):
            raise ValueError("config.json attention_bias must be false (Qwen3 has none)")
        act = get("hidden_act", str, "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act must be 'silu', got {act!r}")
        if dtype is None:
            src = hf.get("dtype", hf.get("torch_dtype")) or "float32"
            dtype = src if src in _DTYPES else "float32"
        hidden, heads = get("hidden_size", int), get("num_attention_heads", int)
        layers = get("num_hidden_layers", int)
        if heads < 1:
            raise ValueError(f"config.json num_attention_heads must be >= 1, got {heads}")
        if layer_types and len(layer_types) != layers:
            raise ValueError(f"config.json layer_types must have num_hidden_layers={layers} "
                             f"entries, got {len(layer_types)}")
        moe = model_type == "qwen3_moe"
        return cls(
            name=name or str(hf.get("_name_or_path") or model_type),
            vocab_size=get("vocab_size", int),
            hidden_size=hidden,
            num_layers=layers,
            num_q_heads=heads,
            num_kv_heads=get("num_key_value_heads", int, heads, heads),
            head_dim=get("head_dim", int, hidden // heads, hidden // heads),
            intermediate_size=get("intermediate_size", int, 0),
            rms_norm_eps=float(get("rms_norm_eps", float, 1e-6)),
            rope_theta=float(theta),
            tie_word_embeddings=get("tie_word_embeddings", bool, False),
            num_experts=get("num_experts", int) if moe else 0,
            num_experts_per_tok=get("num_experts_per_tok", int) if moe else 0,
            moe_intermediate_size=get("moe_intermediate_size", int) if moe else 0,
            norm_topk_prob=get("norm_topk_prob", bool, True),
            decoder_sparse_step=get("decoder_sparse_step", int, 1, 1),
            mlp_only_layers=tuple(get("mlp_only_layers", list, [], [])),
            dtype=dtype,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A Hugging Face `config.json` dict (Qwen3ForCausalLM or Qwen3MoeForCausalLM)."""
        moe = self.num_experts > 0
        out: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "max_position_embeddings": 40960,
            "torch_dtype": self.dtype,
        }
        if moe:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        return out
