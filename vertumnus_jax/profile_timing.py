"""The prefill profiler's timing routine, without flags: `python -m vertumnus_jax.profile` and the
GPU check (`vertumnus_jax.gpu_check`) both time grid points with it.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from vertumnus_jax.prefill import prefill, prefill_request, release_request
from vertumnus_jax.prefix_cache import block_hashes
from vertumnus_jax.worker import Worker


def cached_length(input_len: int, fraction: float, block_size: int) -> int:
    """Cached tokens for a prompt: `fraction * input_len` rounded down to whole blocks, capped at
    `(input_len - 1) // block_size` blocks (the last token is always recomputed)."""
    blocks = min(int(fraction * input_len) // block_size, (input_len - 1) // block_size)
    return blocks * block_size


def time_prefill(worker: Worker, tokens: np.ndarray, cached_len: int, warmup: int,
                 repeats: int) -> float:
    """Median seconds of `prefill(worker, tokens, prefix)` over `repeats` runs after `warmup`,
    with the first `cached_len` tokens (whole blocks) cached beforehand."""
    bs = worker.block_size
    hashes = block_hashes(tokens, bs)[:cached_len // bs]
    if cached_len:
        release_request(worker, prefill_request(worker, tokens[:cached_len]))
    hit = worker.cache.match(hashes)
    if len(hit) != len(hashes):
        raise RuntimeError(f"prefix of {cached_len} tokens was not cached (hit {len(hit)} blocks)")
    worker.cache.lock(hashes)
    times = []
    try:
        for i in range(warmup + repeats):
            start = time.perf_counter()
            result = prefill(worker, tokens, hit)
            elapsed = time.perf_counter() - start  # first_token is already on the host
            worker.cache.free(len(hit), result.new_block_ids)
            if i >= warmup:
                times.append(elapsed)
    finally:
        worker.cache.unlock(hashes)
    return statistics.median(times)
