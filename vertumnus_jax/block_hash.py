"""Chained block hashes of token ids: the keys of the prefix cache.

Block k's hash covers every token up to the end of block k:
`h[k] = splitmix64((h[k-1] * 31) ^ splitmix64(id[k]))` with `id[k]` the BLAKE2b-64 of block k's
int32 tokens; the formulas of `serving.policy.request.chain_block_hashes` and `block_content_id`, so the
scheduler's hashes (`serving.policy.request.prompt_block_hashes`) can be passed in precomputed. The two
copies exist because the policy core may not import this package (DESIGN.md, layers);
tests/vertumnus_jax/test_prefix_cache.py checks that they agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def chain_hashes(content_ids: Iterable[int], parent: int = 0) -> tuple[int, ...]:
    """Chains per-block content ids: `h[k] = splitmix64((h[k-1] * 31) ^ splitmix64(id[k]))`.

    The same formula as `serving.policy.request.chain_block_hashes` (64-bit, deterministic across
    processes), so hashes computed by the scheduler can be passed in precomputed.
    """
    out, h = [], int(parent) & _MASK64
    for c in content_ids:
        h = _splitmix64(((h * 31) & _MASK64) ^ _splitmix64(int(c) & _MASK64))
        out.append(h)
    return tuple(out)


def block_content_id(tokens: Sequence[int]) -> int:
    """64-bit id of one block's token ids: BLAKE2b-64 of their little-endian int32 bytes."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0) -> tuple[int, ...]:
    """Chained hashes of the *full* blocks of a prompt: `len(token_ids) // block_size` ints.

    Raises ValueError for `block_size < 1`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    toks = np.asarray(token_ids, dtype=np.int64)
    n = len(toks) // block_size
    return chain_hashes((block_content_id(toks[i * block_size:(i + 1) * block_size])
                         for i in range(n)), parent)
