"""Pallas attention kernels and their pure-jnp references.

Public API:
  flash_attention(q, k, v, q_positions, kv_positions, *, sm_scale, block_sizes, interpret)
      -> (out, lse): causal-by-position forward attention (Pallas; Triton on GPU, interpret on CPU).
  attention_reference(...): the same in plain jnp, for tests.
  merge_attention_states(out_a, lse_a, out_b, lse_b) -> (out, lse): exact LSE merge.
  BlockSizes: the kernel's tiling, with per-backend defaults.
"""

from __future__ import annotations

from pallas_kernels.flash_attention import (
    BlockSizes,
    attention_reference,
    flash_attention,
    merge_attention_states,
)

__all__ = ["BlockSizes", "attention_reference", "flash_attention", "merge_attention_states"]
