"""Content model of prompts without token ids: segments, block content ids, re-blocking.

A prompt is modelled as a concatenation of content *segments* `(segment_id, length)`; each
block's content id is derived from the segment pieces it covers, so equal content ids at equal
block positions mean equal tokens. Block content ids are then chained with
`serving.policy.request.chain_block_hashes` into the prefix-identifying hashes a `Request` carries.
Used by the trace loaders (`eval.traces.loaders`) and the workload generators (`eval.traces.workloads`).
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.policy.request import chain_block_hashes, num_blocks, splitmix64

_MASK64 = (1 << 64) - 1
TAG_MOONCAKE = 0x4D4F4F4E  # mixes Mooncake hash_ids into segment ids when re-blocking


def segment_id(*parts: int) -> int:
    """A well-mixed 64-bit id for a content segment named by integers (kind tag, indices, ...).

    `h = splitmix64(31*h ^ splitmix64(part))` folded over `parts`; deterministic across
    processes. Distinct part tuples collide with probability about 2^-64.
    """
    h = 0
    for p in parts:
        h = splitmix64(((h * 31) & _MASK64) ^ splitmix64(int(p) & _MASK64))
    return h


def segment_block_ids(segments: Sequence[tuple[int, int]], block_size: int,
                      start_block: int = 0) -> list[int]:
    """Content id of each `block_size`-token block of a prompt made of content segments.

    The prompt is the concatenation of `segments`, each `(segment_id, length_tokens)`; a segment
    id names a run of tokens (the same id means the same tokens) and must be well mixed (random
    64-bit, or from `segment_id`). Block j covers tokens `[j*B, min((j+1)*B, L))`; its content id
    folds, in order, one value per segment piece it covers,
    `piece = segment_id ^ (offset_in_segment << 32 | piece_length)`, as
    `acc = (31 * acc mod 2^64) ^ piece` from `acc = 0`. Two blocks at the same position get equal
    ids exactly when they cover the same spans of the same segments (up to ~2^-64 collisions;
    `chain_block_hashes` mixes the ids further). A partial last block differs from the full block
    it would grow into. Chain the result with `serving.policy.request.chain_block_hashes`.

    Args:
      segments: `(segment_id: int, length: int in [1, 2^32))` pairs.
      block_size: tokens per block, >= 1.
      start_block: first block to return, in `[0, ceil(L / block_size)]`.

    Returns:
      `ceil(L / block_size) - start_block` ints in [0, 2^64), L the total length in tokens.

    Raises:
      ValueError: block_size < 1, a segment length out of range, or start_block out of range.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    total = 0
    for _, length in segments:
        if not 1 <= length < (1 << 32):
            raise ValueError(f"segment length must be in [1, 2^32) tokens, got {length!r}")
        total += length
    n = num_blocks(total, block_size)
    if not 0 <= start_block <= n:
        raise ValueError(f"start_block must be in [0, {n}], got {start_block!r}")
    out: list[int] = []
    if start_block == n:
        return out
    pos = start_block * block_size        # current token
    end = min(pos + block_size, total)    # end of the current block
    k, ks = 0, 0                          # current segment and its first token
    while ks + segments[k][1] <= pos:
        ks += segments[k][1]
        k += 1
    acc = 0
    while True:
        sid, slen = segments[k]
        sid = int(sid) & _MASK64
        send = ks + slen
        while True:
            hi = send if send < end else end
            acc = ((acc * 31) & _MASK64) ^ sid ^ (((pos - ks) << 32) | (hi - pos))
            pos = hi
            if hi == end:
                out.append(acc)
                if end == total:
                    return out
                acc, end = 0, min(end + block_size, total)
            if hi == send:
                break
        ks, k = send, k + 1


def reblock_hash_ids(hash_ids: Sequence[int], input_len: int, source_block_size: int,
                     block_size: int) -> tuple[int, ...]:
    """Hash chain at `block_size` from per-block ids given at `source_block_size`.

    Each source block i becomes a segment `(splitmix64(hash_ids[i] ^ TAG), its length)` (the last
    one `input_len - (n-1)*source_block_size` tokens) and the new blocks get content ids by
    `segment_block_ids`. Hence a new block is shared by two requests exactly when every source
    block it overlaps (and every one before it) has the same id in both and it covers the same
    span: re-blocking keeps the trace's sharing structure, at the new granularity.

    Raises:
      ValueError: `len(hash_ids) != ceil(input_len / source_block_size)` or a size < 1.
    """
    if len(hash_ids) != num_blocks(input_len, source_block_size):
        raise ValueError(f"hash_ids must have ceil(input_len / source_block_size) = "
                         f"{num_blocks(input_len, source_block_size)} entries, got {len(hash_ids)}")
    last = input_len - (len(hash_ids) - 1) * source_block_size
    # Segment id of a source block: splitmix64 is a bijection, so distinct ids stay distinct.
    segs = [(splitmix64((int(h) ^ TAG_MOONCAKE) & _MASK64), source_block_size) for h in hash_ids]
    segs[-1] = (segs[-1][0], last)
    return chain_block_hashes(segment_block_ids(segs, block_size))

