"""The unit of work of the prefill pool: one prompt to prefill.

A request carries its prompt as a *chain of block hashes*: the prompt is cut into
`block_size`-token blocks and block k's hash identifies the whole prefix up to and including
block k (vLLM's prefix-caching hash, SGLang's page-aligned radix keys). Two requests share a
cached prefix of k blocks exactly when their first k hashes are equal, so a prefix match is a
walk over hashes and never compares tokens.

Only *full* blocks are cacheable (as in vLLM): the last, partial block of a prompt is computed
but never reused. And the last prompt token is always recomputed so that the prefill produces
logits for it; hence `max_cacheable_blocks = (input_len - 1) // block_size`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64 finaliser (Steele, Lea, Flood 2014): a well-mixed 64-bit permutation."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def chain_block_hashes(block_ids: Iterable[int], parent: int = 0) -> tuple[int, ...]:
    """Turns per-block content ids into a hash chain.

    Args:
      block_ids: one integer per block that identifies that block's *content* (for example a
        Mooncake `hash_ids` entry, or the hash of the block's token ids).
      parent: the hash of the prefix before the first block (0 for the start of a prompt).

    Returns:
      A tuple of 64-bit ints, `h[k] = splitmix64((h[k-1] * 31) ^ splitmix64(id[k]))` (mod
      2**64), so `h[k]` depends on every block up to k. Deterministic across processes (no
      `PYTHONHASHSEED`).
    """
    out = []
    h = parent
    for b in block_ids:
        h = splitmix64(((h * 31) & _MASK64) ^ splitmix64(int(b) & _MASK64))
        out.append(h)
    return tuple(out)


def block_content_id(tokens: Sequence[int]) -> int:
    """64-bit id of one block's token ids: BLAKE2b-64 of their little-endian int32 bytes.

    The content id the live service chains into a prompt's block hashes; the same formula as
    `vertumnus_jax.block_hash.block_content_id`, which keys the workers' KV caches (kept apart
    by the layer rule, DESIGN.md; tests check that both agree).
    """
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The hash chain of a prompt of token ids: one hash per `block_size` tokens, the last block
    partial when `len(token_ids) % block_size` (`num_blocks(len(token_ids), block_size)` hashes).

    `chain_block_hashes` over `block_content_id` of each block, so the full blocks' hashes equal
    the KV cache keys of `vertumnus_jax.block_hash.block_hashes`.

    Raises:
      ValueError: `block_size < 1`, or a token id outside [0, 2**31) (the int32 ids the model
        and the cache keys use).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    toks = np.asarray(token_ids)
    if toks.size and (toks.ndim != 1 or not np.issubdtype(toks.dtype, np.integer)
                      or toks.min() < 0 or toks.max() >= 2**31):
        raise ValueError(f"token_ids must be a flat sequence of integers in [0, 2**31), got "
                         f"dtype {toks.dtype}, shape {toks.shape}"
                         + (f", range [{toks.min()}, {toks.max()}]" if toks.size and np.issubdtype(
                             toks.dtype, np.integer) else ""))
    toks = toks.astype("<i4")
    return chain_block_hashes(block_content_id(toks[i:i + block_size])
                              for i in range(0, len(toks), block_size))


def num_blocks(input_len: int, block_size: int) -> int:
    """Blocks that hold `input_len` tokens: `ceil(input_len / block_size)`."""
    return -(-input_len // block_size)


@dataclasses.dataclass(slots=True)
class Request:
    """One prefill request.

    Attributes:
      request_id: unique id (str or int) within a run.
      arrival_time: seconds since the start of the run (simulated or wall clock).
      input_len: prompt length in tokens, >= 1.
      output_len: tokens the decode pool will generate (>= 0); the prefill pool produces only
        the first one, the rest is carried for metrics and for the decode pool.
      block_hashes: hash chain, one per `block_size` block of the prompt (the last may be
        partial): `len(block_hashes) == ceil(input_len / block_size)`.
      block_size: tokens per block, >= 1.
      ttft_slo: the request's TTFT objective in seconds, or None when it has none.
      token_ids: the prompt's token ids when a live backend must run it; None in simulation.

    Raises:
      ValueError: naming the field, when a field is out of range or the hash count disagrees
        with `ceil(input_len / block_size)`.
    """

    request_id: str | int
    arrival_time: float
    input_len: int
    output_len: int
    block_hashes: tuple[int, ...]
    block_size: int = 512
    ttft_slo: float | None = None
    token_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival_time, (int, float)) and math.isfinite(self.arrival_time)
                and self.arrival_time >= 0):
            raise ValueError(f"arrival_time must be a finite number >= 0 seconds, got {self.arrival_time!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.input_len, int) or self.input_len < 1:
            raise ValueError(f"input_len must be an integer >= 1 token, got {self.input_len!r}")
        if not isinstance(self.output_len, int) or self.output_len < 0:
            raise ValueError(f"output_len must be an integer >= 0 tokens, got {self.output_len!r}")
        expected = num_blocks(self.input_len, self.block_size)
        if len(self.block_hashes) != expected:
            raise ValueError(
                f"block_hashes must have ceil(input_len / block_size) = {expected} entries "
                f"(input_len={self.input_len}, block_size={self.block_size}), got {len(self.block_hashes)}")
        if self.ttft_slo is not None and not (math.isfinite(self.ttft_slo) and self.ttft_slo > 0):
            raise ValueError(f"ttft_slo must be a finite number > 0 seconds or None, got {self.ttft_slo!r}")
        if self.token_ids is not None and len(self.token_ids) != self.input_len:
            raise ValueError(
                f"token_ids must have input_len = {self.input_len} entries, got {len(self.token_ids)}")

    @property
    def max_cacheable_blocks(self) -> int:
        """Leading full blocks that a cache hit may cover: `(input_len - 1) // block_size`.

        The last token is always recomputed so the prefill yields its logits (vLLM does the same).
        """
        return (self.input_len - 1) // self.block_size

    @property
    def full_blocks(self) -> int:
        """Full blocks the prefill leaves in the cache afterwards: `input_len // block_size`."""
        return self.input_len // self.block_size


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """How one request ended. Times are seconds on the caller's clock.

    Attributes:
      request: the request.
      worker_id, cp_degree, epoch: where it ran (None when it never ran).
      start_time: when the scheduler started it on its worker (`Backend.start_prefill`; a
        simulated prefill that waits for a prefix copy made for it begins later, so the wait
        counts here as prefill, not queueing); finish_time: when it ended on the worker.
      first_token_time: when the first token reached the client (None on failure).
      cached_len: prompt tokens served from the worker's prefix cache.
      predicted_cached_len: the prefix the scheduler expected the worker to hold.
      predicted_seconds: the reserved prefill estimate.
      error: None on success, else a message saying why the request failed.
      first_token: generated token id when the backend runs a real model.
      global_cached_len: the longest prefix of the request cached on *any* worker when it was
        routed (tokens); `cached_len` is the part actually reused.
      aborted: True when the request was withdrawn before it started (`Scheduler.abort`, e.g.
        its client went away); `error` then says why.
      retryable: True when it failed through no fault of its own and may be sent again (its
        worker's host was lost while it ran: `Membership.lose`); the API answers 503.
    """

    request: Request
    worker_id: int | None = None
    cp_degree: int | None = None
    epoch: int | None = None
    start_time: float | None = None
    finish_time: float | None = None
    first_token_time: float | None = None
    cached_len: int = 0
    predicted_cached_len: int = 0
    predicted_seconds: float = 0.0
    error: str | None = None
    first_token: int | None = None
    global_cached_len: int = 0
    aborted: bool = False
    retryable: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds, `first_token_time - arrival_time`; None on failure."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.request.arrival_time
