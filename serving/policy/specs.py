"""Named accelerators and model shapes: the inputs of the analytic prefill profile.

`GPUS` and `MODELS` are registries of frozen dataclasses; each entry cites where its figures come
from. `serving.policy.profiles.analytic_prefill_seconds` turns a (GPU, model) pair into prefill times;
`eval` uses `ModelSpec.kv_bytes_per_token` and `weight_bytes` to size KV pools and transfers.
"""

from __future__ import annotations

import dataclasses

@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One accelerator. Rates are dense peaks per GPU.

    Attributes: bf16_tflops (TFLOP/s, dense, no sparsity), hbm_tb_per_s (TB/s), hbm_gb (GB),
    nvlink_gb_per_s (GB/s, vendor's bidirectional total; one direction is half), scaleout_gb_per_s
    (GB/s per GPU NIC per direction; 400 Gb/s = 50), gpus_per_host, mfu_max and mfu_half_tokens
    (efficiency curve, see module doc), link_efficiency (achieved / nominal link bandwidth),
    collective_latency_s (seconds per collective), source (where the figures come from).
    """

    name: str
    bf16_tflops: float
    hbm_tb_per_s: float
    hbm_gb: float
    nvlink_gb_per_s: float
    scaleout_gb_per_s: float = 50.0
    gpus_per_host: int = 8
    mfu_max: float = 0.6
    mfu_half_tokens: float = 64.0
    link_efficiency: float = 0.8
    collective_latency_s: float = 20e-6
    source: str = ""


_H20_SRC = ("NVIDIA H20 product brief figures as reported at willitrunai.com/es/gpus/h20-96gb and "
            "zangshuxian.com/new/674733024499207168: 148 TFLOP/s FP16/BF16 dense, 96 GB HBM3, "
            "4.0 TB/s, NVLink 900 GB/s")
GPUS: dict[str, GpuSpec] = {
    "h20": GpuSpec("h20", 148.0, 4.0, 96.0, 900.0, source=_H20_SRC),
    "h20-3e": GpuSpec("h20-3e", 148.0, 4.8, 141.0, 900.0, source=(
        "H20 compute (as h20) with 141 GB HBM3e at 4.8 TB/s, the Vertumnus paper's H20-3e per "
        "issue 2; no vendor page found for the 3e memory figures")),
    "h200": GpuSpec("h200", 989.0, 4.8, 141.0, 900.0, source=(
        "NVIDIA H200 SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOP/s with sparsity = 989 dense, "
        "NVLink 900 GB/s (anandtech.com SC23 H200 table; nvidia.com H200 page)")),
    "h100": GpuSpec("h100", 989.0, 3.35, 80.0, 900.0, source=(
        "NVIDIA H100 SXM5: 989 TFLOP/s BF16 dense, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s "
        "(anandtech.com SC23 table); the hardware of Meta's CP paper (arXiv 2411.01783)")),
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shapes (HF config names in brackets).

    Attributes: num_layers [num_hidden_layers], hidden [hidden_size], num_q_heads, num_kv_heads,
    head_dim, intermediate (dense SwiGLU size; 0 when every layer is MoE), vocab, num_experts
    (0 = dense), experts_per_token (top-k), moe_intermediate (per expert), dtype_bytes (2 = bf16),
    tie_embeddings, source.
    """

    name: str
    num_layers: int
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    dtype_bytes: int = 2
    tie_embeddings: bool = False
    source: str = ""

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V bytes of one token in one layer: 2 * num_kv_heads * head_dim * dtype_bytes."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    @property
    def attn_params_per_layer(self) -> int:
        """Q, K, V and O projection parameters of one layer."""
        D, d = self.hidden, self.head_dim
        return D * (self.num_q_heads + 2 * self.num_kv_heads) * d + self.num_q_heads * d * D

    def mlp_params_per_layer(self, experts: float | None = None) -> float:
        """MLP parameters of one layer touched when `experts` experts are used (all when None;
        router included for MoE)."""
        if self.num_experts == 0:
            return 3 * self.hidden * self.intermediate
        e = self.num_experts if experts is None else experts
        return self.hidden * self.num_experts + e * 3 * self.hidden * self.moe_intermediate

    @property
    def embedding_params(self) -> int:
        """Input embedding plus LM head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def total_params(self) -> int:
        """All parameters (norm weights ignored)."""
        per_layer = self.attn_params_per_layer + self.mlp_params_per_layer()
        return int(self.num_layers * per_layer + self.embedding_params)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights at `dtype_bytes`."""
        return self.total_params * self.dtype_bytes

    @property
    def active_params(self) -> int:
        """Parameters used per token (top-k experts, embeddings counted, as model cards do)."""
        k = self.experts_per_token if self.num_experts else None
        per_layer = self.attn_params_per_layer + self.mlp_params_per_layer(k)
        return int(self.num_layers * per_layer + self.embedding_params)


def _llama(name, layers, hidden, heads, kv, inter, vocab=128256, src=""):
    return ModelSpec(name, layers, hidden, heads, kv, 128, inter, vocab, source=src)


MODELS: dict[str, ModelSpec] = {
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b", 48, 2048, 32, 4, 128, 0, 151936, num_experts=128, experts_per_token=8,
        moe_intermediate=768, source="Qwen/Qwen3-30B-A3B config.json (every layer MoE)"),
    "qwen3-8b": ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936,
                          source="Qwen/Qwen3-8B config.json"),
    "qwen3-32b": ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936,
                           source="Qwen/Qwen3-32B config.json (65.5 GB in bf16: fits an H20)"),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336,
                        src="meta-llama/Meta-Llama-3-8B config.json"),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672,
                         src="Llama 3 herd paper (arXiv 2407.21783) Table 3; 141 GB in bf16"),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248,
                          src="Llama 3 herd paper (arXiv 2407.21783) Table 3"),
    "tiny": ModelSpec("tiny", 2, 64, 4, 2, 16, 128, 256, source="the built-in test model"),
}


def resolve_spec(x, registry: dict, field: str):
    """Returns `registry[x]` for a name, or `x` itself for a spec object.

    Raises:
      ValueError: an unknown name; the message names `field` and the known names.
    """
    if isinstance(x, str):
        if x not in registry:
            raise ValueError(f"{field}={x!r} is not one of {sorted(registry)}")
        return registry[x]
    return x
