"""Wall-clock timing of a JAX callable, shared by `pallas_kernels.bench` and `.tune`."""

from __future__ import annotations

import time

import jax
import numpy as np


def call_seconds(fn, args, iters: int, warmup: int) -> list[float]:
    """Seconds of each of `iters` timed calls `fn(*args)` after `warmup` untimed ones; every
    call waits for its outputs (`jax.block_until_ready`). Also the GPU check's timing loop
    (`vertumnus_jax.gpu_check_timing.time_fn`)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def median_ms(fn, args, iters: int, warmup: int) -> tuple[float, float]:
    """(first call incl. compile, median of `iters` timed calls), in ms, after `warmup` calls;
    every call waits for its outputs (`jax.block_until_ready`).

    Raises ValueError for `iters` < 1 or `warmup` < 0."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, "
                         f"warmup={warmup}")
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    return 1e3 * first, 1e3 * float(np.median(call_seconds(fn, args, iters, warmup)))
