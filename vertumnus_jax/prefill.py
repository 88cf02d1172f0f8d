"""Zigzag context-parallel (CP) prefill on a worker's submesh, over a cached prefix in its KV pool.

Layout: a prompt of L tokens whose first `h = k * block_size` tokens are cached (k blocks) has
`n = L - h` new tokens. They are padded to a bucket `N` (a power of two, at least
`max(2C, block_size, min_bucket)`) and cut into 2C chunks of `S = N / 2C`; rank r holds chunks
r and 2C-1-r (the zigzag that balances causal work, Meta's CP paper, arXiv 2411.01783 §3.2),
with global positions `h + index` (padding: -1).

Per layer, inside `jax.shard_map` over the `cp` axis:
  1. q, k, v of the rank's 2S tokens (RoPE at global positions);
  2. all-gather the new K/V over `cp` and undo the zigzag (a static reshape) -> natural order;
  3. gather the rank's cached prefix blocks from its pool (block i lives on rank i mod C) and
     all-gather them -> the whole prefix in natural order;
  4. the Pallas flash-attention kernel over [prefix, new] keys with global positions;
  5. write the new blocks this rank owns under striping into its pool (donated buffers).
The last real token's hidden state is picked at its (rank, slot) under the zigzag (the inverse
permutation of index n-1) and psum'd; the LM head gives the logits and the greedy first token.
Executables are compiled once per (device set, C, N, prefix-block bucket).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_kernels import flash_attention
from vertumnus_jax.prefix_cache import block_hashes as hash_blocks
from vertumnus_jax.worker import Worker


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def bucket_length(new_tokens: int, cp_degree: int, block_size: int, min_bucket: int = 16) -> int:
    """Padded length N of `new_tokens` uncached tokens: the next power of two >= all of
    `new_tokens`, `2 * cp_degree`, `block_size` and `min_bucket` (so N splits into 2C chunks and
    whole blocks)."""
    return _next_pow2(max(new_tokens, 2 * cp_degree, block_size, min_bucket))


def zigzag_indices(bucket: int, cp_degree: int) -> np.ndarray:
    """`[C, 2S]` int: row r = natural token indices of chunks r and 2C-1-r (S = bucket / 2C)."""
    s = bucket // (2 * cp_degree)
    r = np.arange(cp_degree)[:, None]
    j = np.arange(s)[None, :]
    return np.concatenate([r * s + j, (2 * cp_degree - 1 - r) * s + j], axis=1)


def _step(worker: Worker, bucket: int, prefix_slots: int):
    """The jitted shard_map'd prefill step for one (N, J) bucket."""
    cfg, c, axis, bs = worker.config, worker.cp_degree, worker.axis, worker.block_size
    s, nbs = bucket // (2 * c), bucket // bs
    new_slots = max(1, -(-nbs // c))
    kvh, d = cfg.num_kv_heads, cfg.head_dim
    graphdef = worker.graphdef
    kernel_kwargs = dict(block_sizes=worker.block_sizes, interpret=worker.interpret)

    def local(state, pool_k, pool_v, tokens, prefix_ids, new_dst, n_cached_blocks, n_new):
        model = nnx.merge(graphdef, state)
        tokens, prefix_ids, new_dst = tokens[0], prefix_ids[0], new_dst[0]
        r = lax.axis_index(axis)
        h = n_cached_blocks * bs
        idx = jnp.concatenate([r * s + jnp.arange(s), (2 * c - 1 - r) * s + jnp.arange(s)])
        q_pos = jnp.where(idx < n_new, h + idx, -1).astype(jnp.int32)  # [2S]
        pre = jnp.arange(c * prefix_slots * bs)
        new = jnp.arange(bucket)
        kv_pos = jnp.concatenate([jnp.where(pre < h, pre, -1),
                                  jnp.where(new < n_new, h + new, -1)]).astype(jnp.int32)
        # New block m (sequence index n_cached + m) is owned by rank (n_cached + m) % C.
        src = jnp.minimum((r - n_cached_blocks) % c + jnp.arange(new_slots) * c, nbs - 1)
        pools = [pool_k, pool_v]

        def natural(x):  # [2S, kvh, d] per rank -> [N, kvh, d] in natural token order
            g = lax.all_gather(x, axis).reshape(c, 2, s, kvh, d)
            return jnp.concatenate([g[:, 0].reshape(c * s, kvh, d),
                                    g[::-1, 1].reshape(c * s, kvh, d)])

        def prefix(pool_layer):  # [num_blocks, bs, kvh, d] -> [C*J*bs, kvh, d] natural order
            g = lax.all_gather(pool_layer[prefix_ids], axis)  # [C, J, bs, kvh, d]
            return g.swapaxes(0, 1).reshape(c * prefix_slots * bs, kvh, d)

        def attend(layer, q, k, v):
            k_new, v_new = natural(k), natural(v)
            keys = jnp.concatenate([prefix(pools[0][layer]), k_new])
            values = jnp.concatenate([prefix(pools[1][layer]), v_new])
            out, _ = flash_attention(q[None], keys[None], values[None], q_pos[None],
                                     kv_pos[None], **kernel_kwargs)
            for i, x in enumerate((k_new, v_new)):
                blocks = x.reshape(nbs, bs, kvh, d)[src]  # [new_slots, bs, kvh, d]
                pools[i] = pools[i].at[layer, new_dst].set(blocks, mode="drop")
            return out[0]

        hidden = model.hidden_states(tokens, q_pos, attend)  # [2S, D]
        last = n_new - 1
        chunk, offset = last // s, last % s
        owner = jnp.where(chunk < c, chunk, 2 * c - 1 - chunk)
        slot = jnp.where(chunk < c, offset, s + offset)
        row = lax.psum(jnp.where(r == owner, hidden[slot], jnp.zeros_like(hidden[slot])), axis)
        logits = model.logits(row)  # [V] float32
        return logits, jnp.argmax(logits).astype(jnp.int32), pools[0], pools[1]

    sh = P(axis)
    fn = jax.shard_map(local, mesh=worker.mesh,
                       in_specs=(P(), sh, sh, sh, sh, sh, P(), P()),
                       out_specs=(P(), P(), sh, sh), check_vma=False)
    return jax.jit(fn, donate_argnums=(1, 2)), new_slots


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    """`first_token` (greedy), `logits` `[V]` float32 of the last prompt position, and
    `new_block_ids`: the blocks written for sequence indices `len(cached) ..` (owned by the
    caller: insert them into the prefix cache or free them)."""

    first_token: int
    logits: np.ndarray
    new_block_ids: list[int]

    def __iter__(self):
        return iter((self.first_token, self.logits, self.new_block_ids))


def as_token_ids(token_ids, vocab_size: int) -> np.ndarray:
    """Validates a prompt: `[L]` int64 from a 1-D sequence of Python / numpy integers (or an
    integer array) in `[0, vocab_size)`, L >= 1.

    Raises ValueError naming `token_ids` for None, a scalar, a string, a nested or 2-D input,
    an empty prompt, a bool or non-integer element (floats are rejected, not truncated), or a
    value outside `[0, vocab_size)` (huge ints included).
    """
    if isinstance(token_ids, np.ndarray) or hasattr(token_ids, "__array__"):
        arr = np.asarray(token_ids)
        if arr.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got an array of shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token_ids must have an integer dtype, got {arr.dtype}")
        lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    elif isinstance(token_ids, Sequence) and not isinstance(token_ids, (str, bytes)):
        for i, x in enumerate(token_ids):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                raise ValueError(f"token_ids must hold integers, got {type(x).__name__} "
                                 f"{x!r} at index {i}")
        arr = token_ids
        lo, hi = (int(min(arr)), int(max(arr))) if len(arr) else (0, 0)
    else:
        raise ValueError("token_ids must be a 1-D sequence of ints, got "
                         f"{type(token_ids).__name__}")
    if len(arr) < 1:
        raise ValueError("token_ids must hold at least one token")
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token_ids must be in [0, {vocab_size}), got range [{lo}, {hi}]")
    return np.asarray(arr, dtype=np.int64)


def prefill(worker: Worker, token_ids: Sequence[int], cached: Sequence[int]) -> PrefillResult:
    """Zigzag CP prefill of one prompt on `worker` over its cached prefix blocks.

    Args:
      worker: the worker (C devices, weights replicated, KV pool, prefix cache).
      token_ids: the whole prompt, `[L]` ints in `[0, vocab_size)`, L >= 1 (`as_token_ids`).
      cached: block ids of the first `len(cached)` blocks of the prompt already in the pool
        (block i on rank i % C), with `len(cached) * block_size < L`. The caller keeps them
        alive (locked) during the call.

    Returns:
      `PrefillResult(first_token, logits_of_last_position, new_block_ids)`; unpacks as a
      3-tuple. New blocks (the last may be partial) are allocated from `worker.cache`
      (evicting LRU unreferenced blocks when needed) and hold the prompt's K/V.

    Raises:
      ValueError: for bad `token_ids` (see `as_token_ids`), a cached prefix that is not
        shorter than the prompt, or a cached block id outside the pool, free, or repeated on
        a rank.
      OutOfBlocksError: when the pool cannot hold the new blocks. On this or any other
        failure the prefix cache is left as it was (evictions and allocations undone).
    """
    cfg, c, bs = worker.config, worker.cp_degree, worker.block_size
    tokens = as_token_ids(token_ids, cfg.vocab_size)
    length = tokens.shape[0]
    cached = [int(b) for b in cached]
    k = len(cached)
    if k * bs >= length:
        raise ValueError(f"cached prefix must be shorter than the prompt: len(cached)="
                         f"{k} blocks of {bs} >= {length} tokens (at most {(length - 1) // bs})")
    if cached and not all(0 <= b < worker.pool.num_blocks for b in cached):
        raise ValueError(f"cached block ids must be in [0, {worker.pool.num_blocks}), got "
                         f"{cached}")
    placed = [(i % c, b) for i, b in enumerate(cached)]
    if len(set(placed)) != k or any(worker.cache.is_free(r, b) for r, b in placed):
        raise ValueError(f"cached block ids must be distinct allocated blocks per rank (block i "
                         f"on rank i % {c}), got {cached}")
    n_new = length - k * bs
    bucket = bucket_length(n_new, c, bs, worker.min_bucket)
    prefix_slots = _next_pow2(max(1, -(-k // c)))
    key = (worker.device_ids, c, bucket, prefix_slots)
    if key not in worker.executables:
        worker.executables[key] = _step(worker, bucket, prefix_slots)
    step, new_slots = worker.executables[key]

    with worker.cache.transaction():  # any failure below undoes the allocation and evictions
        new_ids = worker.cache.allocate(k, -(-n_new // bs))
        padded = np.zeros(bucket, np.int32)
        padded[:n_new] = tokens[k * bs:]
        prefix_ids = np.zeros((c, prefix_slots), np.int32)
        for i, b in enumerate(cached):
            prefix_ids[i % c, i // c] = b
        new_dst = np.full((c, new_slots), worker.pool.num_blocks, np.int32)  # dropped
        for m, b in enumerate(new_ids):
            r = (k + m) % c
            new_dst[r, (m - (r - k) % c) // c] = b
        logits, token, pool_k, pool_v = step(
            worker.params, worker.pool.k, worker.pool.v,
            worker.sharded(padded[zigzag_indices(bucket, c)]), worker.sharded(prefix_ids),
            worker.sharded(new_dst), worker.replicated(np.int32(k)),
            worker.replicated(np.int32(n_new)))
        worker.pool.replace(pool_k, pool_v)
        return PrefillResult(int(token), np.asarray(logits), new_ids)


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """Outcome of `prefill_request`.

    Attributes:
      first_token, logits: as in `PrefillResult`.
      block_ids: the prompt's blocks, `ceil(L / block_size)` ids (block i on rank i % C).
      cached_blocks: blocks that were a prefix hit (`cached_tokens = cached_blocks * bs`).
      cached_tokens: tokens not recomputed.
      locked_hashes: the full-block hashes this request holds locked until `release_request`.
      request_id: the handle under which the worker tracks the live request (unique in the
        process); `release_request` retires it.
    """

    first_token: int
    logits: np.ndarray
    block_ids: list[int]
    cached_blocks: int
    cached_tokens: int
    locked_hashes: tuple[int, ...]
    request_id: int


_REQUEST_IDS = itertools.count(1)


def _as_hashes(block_hashes, length: int, bs: int) -> tuple[int, ...]:
    n_full, n_all = length // bs, -(-length // bs)
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes,
                                                                (Sequence, np.ndarray)):
        raise ValueError(f"block_hashes must be a sequence of ints, got "
                         f"{type(block_hashes).__name__}")
    for i, h in enumerate(block_hashes):
        if isinstance(h, (bool, np.bool_)) or not isinstance(h, (int, np.integer)) or \
                not 0 <= int(h) < 1 << 64:
            raise ValueError(f"block_hashes must hold ints in [0, 2**64), got {h!r} at index {i}")
    if len(block_hashes) not in (n_full, n_all):
        raise ValueError(f"block_hashes must have {n_full} or {n_all} entries for {length} "
                         f"tokens of block size {bs}, got {len(block_hashes)}")
    return tuple(int(h) for h in block_hashes)[:n_full]


def prefill_request(worker: Worker, token_ids: Sequence[int],
                    block_hashes: Sequence[int] | None = None) -> RequestResult:
    """Prefill with the worker's prefix cache: match, lock, CP prefill, insert the new blocks.

    Args:
      worker: the worker.
      token_ids: the prompt, `[L]` ints (`as_token_ids`).
      block_hashes: the prompt's chained block hashes, ints in `[0, 2**64)` (`L // bs`
        full-block ones, optionally one more for a partial last block, which is ignored);
        default `block_hashes(token_ids, block_size)` from `vertumnus_jax.prefix_cache`.

    Returns:
      A `RequestResult`; its full blocks stay locked (and its partial last block owned) until
      `release_request`. New full blocks are in the cache and in `worker.cache.events`.

    Raises:
      ValueError: on bad tokens, a hash count other than `L // bs` or `ceil(L / bs)`, or
        hashes that are not a chain (a repeat, or a hash cached under another parent); checked
        before anything changes.
      OutOfBlocksError: when the pool cannot hold the new blocks. On this or any other
        failure the cache is as before: tree, refcounts, LRU ages, free lists and events.
    """
    bs = worker.block_size
    tokens = as_token_ids(token_ids, worker.config.vocab_size)
    length = len(tokens)
    n_full = length // bs
    if block_hashes is None:
        hashes = hash_blocks(tokens, bs)
    else:
        hashes = _as_hashes(block_hashes, length, bs)
    cache = worker.cache
    cache.validate_chain(hashes)
    with cache.transaction():
        hit = cache.match(hashes[:max(0, (length - 1) // bs)], touch=False)
        k = len(hit)
        cache.lock(hashes[:k])
        result = prefill(worker, tokens, hit)
        ids = hit + result.new_block_ids
        canonical = cache.insert(hashes, ids[:n_full])  # touches the whole path (LRU)
        cache.lock(hashes)
        cache.unlock(hashes[:k])
    tail = tuple(ids[n_full:])
    request_id = next(_REQUEST_IDS)
    worker.live_requests[request_id] = (hashes, tail)
    return RequestResult(result.first_token, result.logits, canonical + list(tail), k, k * bs,
                         hashes, request_id)


def release_request(worker: Worker, result: RequestResult) -> None:
    """Unlocks the request's cached blocks and frees its partial last block (if any).

    Raises ValueError, with nothing changed, when `result` is not a live request of `worker`
    (already released, returned by another worker, or altered).
    """
    if not isinstance(result, RequestResult):
        raise ValueError(f"result must be a RequestResult, got {type(result).__name__}")
    live = worker.live_requests.get(result.request_id)
    n_full = len(result.locked_hashes)
    if live != (tuple(result.locked_hashes), tuple(result.block_ids[n_full:])):
        raise ValueError(f"result (request_id {result.request_id}) is not a "
                         "live request of this worker: already released, from another worker, "
                         "or altered")
    with worker.cache.transaction():
        worker.cache.unlock(result.locked_hashes)
        worker.cache.free(n_full, result.block_ids[n_full:])
    del worker.live_requests[result.request_id]
