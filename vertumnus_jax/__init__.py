"""Execution engine of one worker: Qwen3-style model, zigzag CP prefill, paged prefix-cached KV.

Public API:
  ModelConfig                      model shapes (tiny, Qwen3-0.6B/8B/30B-A3B, from_hf_config)
  Qwen3, init_model, full_prefill  the Flax NNX model; a plain single-device reference prefill
  load_hf_checkpoint, save_params, restore_params, CheckpointError
                                   HF safetensors loading; orbax save/restore
  KVPool                           per-device K/V blocks [layers, blocks, block_size, kv_heads, d]
  PrefixCache, CacheEvent, CachedBlock, OutOfBlocksError, block_hashes, chain_hashes
                                   radix tree over chained block hashes, LRU, refcounts, events
  Worker                           a CP submesh with replicated weights, pool, cache, executables
                                   (`Worker.from_replicas`: weights re-wrapped, not copied)
  split_worker, merge_workers, replicate_prefix, reclaim_prefix, MoveStats, ReplicationResult
                                   re-carving without moving weights; KV re-striping and copies
  prefill, prefill_request, release_request, PrefillResult, RequestResult
                                   zigzag CP prefill over the cached prefix
The CLIs are `python -m vertumnus_jax.profile` and `python -m vertumnus_jax.bench_recarve`.
"""

from __future__ import annotations

from vertumnus_jax.checkpoint import (
    CheckpointError,
    load_hf_checkpoint,
    restore_params,
    save_params,
)
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.kv_pool import KVPool
from vertumnus_jax.model import Qwen3, causal_attention, full_prefill, init_model
from vertumnus_jax.prefill import (
    PrefillResult,
    RequestResult,
    prefill,
    prefill_request,
    release_request,
)
from vertumnus_jax.prefix_cache import (
    CachedBlock,
    CacheEvent,
    OutOfBlocksError,
    PrefixCache,
    block_hashes,
    chain_hashes,
)
from vertumnus_jax.recarve import (
    MoveStats,
    ReplicationResult,
    merge_workers,
    reclaim_prefix,
    replicate_prefix,
    split_worker,
)
from vertumnus_jax.worker import Worker

__all__ = [
    "CacheEvent", "CachedBlock", "CheckpointError", "KVPool", "ModelConfig", "MoveStats",
    "OutOfBlocksError", "PrefillResult", "PrefixCache", "Qwen3", "ReplicationResult",
    "RequestResult", "Worker", "block_hashes", "causal_attention", "chain_hashes",
    "full_prefill", "init_model", "load_hf_checkpoint", "merge_workers", "prefill",
    "prefill_request", "reclaim_prefix", "release_request", "replicate_prefix",
    "restore_params", "save_params", "split_worker",
]
