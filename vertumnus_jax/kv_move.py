"""Moving KV blocks between devices and re-striping cached prefixes onto re-carved workers.

Device-to-device moves (`move_blocks`): per (source, destination) device pair the blocks are
gathered on the source (a jitted take), sent with `jax.device_put` to the destination (no host
round trip), and scattered into the destination's pool buffers by a jitted update that donates
them (in place). Every gather is dispatched before any scatter, so a block freed on a device and
re-used there as a destination is read before it is overwritten (jax's value semantics).

Re-striping (`collect_blocks`, `fit`, `plan`, `build_cache`): the cached blocks of the old
workers are pooled by hash with the devices that hold a copy. Each new worker of degree C keeps
an ancestor-closed set of them; the block at depth i must live on its rank `i mod C`
(DESIGN.md "Devices, meshes and KV"). Where that device already holds a copy the block stays in
place under the same block id; otherwise it gets a free id there and is moved from a copy.
Prefixes that do not fit are dropped, least recently used leaves first.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from vertumnus_jax.cache_event import CacheEvent
from vertumnus_jax.prefix_cache import PrefixCache

# Per device: K and V `[layers, num_blocks, block_size, kv_heads, head_dim]` single-device arrays.
Buffers = dict[jax.Device, tuple[jax.Array, jax.Array]]


@functools.cache
def _gather():
    return jax.jit(lambda k, v, ids: (k[:, ids], v[:, ids]))


@functools.cache
def _scatter():
    def update(k, v, ids, kb, vb):
        return k.at[:, ids].set(kb, mode="drop"), v.at[:, ids].set(vb, mode="drop")

    return jax.jit(update, donate_argnums=(0, 1))


@dataclasses.dataclass(frozen=True)
class BlockMove:
    """Copy block `src_block` of device `src`'s pool into block `dst_block` of `dst`'s pool."""

    src: jax.Device
    src_block: int
    dst: jax.Device
    dst_block: int


def block_bytes(config, block_size: int) -> int:
    """Bytes of one KV block, K plus V over all layers: `kv_bytes_per_token * block_size`."""
    return int(config.kv_bytes_per_token) * int(block_size)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def move_blocks(buffers: Buffers, moves: Sequence[BlockMove]) -> Buffers:
    """Applies `moves` to per-device pool buffers; returns the updated buffers (same devices).

    Every source block is read as it was before any move (all gathers precede all scatters).
    Destination buffers are donated: the update is in place (same device buffers). Index
    vectors are padded to powers of two (padding reads block 0 and writes nowhere), so jit
    compiles once per (shape, padded count).

    Raises ValueError for a device without buffers, a block id outside `[0, num_blocks)`, or
    two moves into the same destination block.
    """
    dests = [(m.dst, m.dst_block) for m in moves]
    if len(set(dests)) != len(dests):
        raise ValueError("two moves write the same destination block")
    for m in moves:
        for dev, b in ((m.src, m.src_block), (m.dst, m.dst_block)):
            if dev not in buffers:
                raise ValueError(f"device {dev.id} has no pool buffers")
            if not 0 <= b < buffers[dev][0].shape[1]:
                raise ValueError(f"block id must be in [0, {buffers[dev][0].shape[1]}), got {b}")
    groups: dict[tuple, list[BlockMove]] = collections.defaultdict(list)
    for m in moves:
        groups[(m.src, m.dst)].append(m)
    staged = []
    for (src, dst), ms in groups.items():
        width, nb = _pow2(len(ms)), buffers[dst][0].shape[1]
        src_ids = np.zeros(width, np.int32)
        dst_ids = np.full(width, nb, np.int32)  # id nb: dropped
        src_ids[:len(ms)] = [m.src_block for m in ms]
        dst_ids[:len(ms)] = [m.dst_block for m in ms]
        kb, vb = _gather()(*buffers[src], jax.device_put(src_ids, src))
        if src != dst:
            kb, vb = jax.device_put((kb, vb), dst)
        staged.append((dst, dst_ids, kb, vb))
    out = dict(buffers)
    for dst, ids, kb, vb in staged:
        out[dst] = _scatter()(*out[dst], jax.device_put(ids, dst), kb, vb)
    return out


@dataclasses.dataclass
class SourceBlock:
    """A cached block of the old workers: its tree position, the copies (device -> block id)
    and its LRU age in (0, 1] (rank of its last access within its cache; larger is newer)."""

    block_hash: int
    parent_hash: int | None
    depth: int
    copies: dict[jax.Device, int]
    age: float


def collect_blocks(workers: Iterable) -> dict[int, SourceBlock]:
    """Every cached block of `workers` by hash, parents before children.

    A block cached by several workers has one entry with all copies and the newest age (each
    cache's logical clock is its own, so ages are ranks normalised to (0, 1]).

    Raises ValueError when two workers cache one hash under different parents or depths.
    """
    out: dict[int, SourceBlock] = {}
    for w in workers:
        blocks, devices = w.cache.blocks(), w.devices
        ticks = {t: i for i, t in enumerate(sorted({b.last_access for b in blocks}))}
        for b in blocks:
            age = (ticks[b.last_access] + 1) / len(ticks)
            s = out.get(b.block_hash)
            if s is None:
                out[b.block_hash] = SourceBlock(b.block_hash, b.parent_hash, b.depth,
                                                {devices[b.rank]: b.block_id}, age)
                continue
            if (s.parent_hash, s.depth) != (b.parent_hash, b.depth):
                raise ValueError(f"block hash {b.block_hash:#x} is cached under different "
                                 "parents by the workers (not a chained hash)")
            s.copies[devices[b.rank]] = b.block_id
            s.age = max(s.age, age)
    return out


def chain(blocks: dict[int, SourceBlock], leaf: int) -> tuple[int, ...]:
    """Hashes from the root to `leaf`."""
    out, h = [], leaf
    while h is not None:
        out.append(h)
        h = blocks[h].parent_hash
    return tuple(reversed(out))


def fit(blocks: dict[int, SourceBlock], members: set[int], cp_degree: int,
        num_blocks: int) -> list[int]:
    """Drops leaves of the ancestor-closed set `members` (in place) until no rank `depth % C`
    holds more than `num_blocks`: the least recently used leaf on an over-full rank first, else
    the least recently used leaf. Returns the dropped hashes in order."""
    counts = collections.Counter(blocks[h].depth % cp_degree for h in members)
    nchild = collections.Counter(blocks[h].parent_hash for h in members)
    dropped = []
    while any(n > num_blocks for n in counts.values()):
        over = {r for r, n in counts.items() if n > num_blocks}
        leaves = [h for h in members if not nchild[h]]
        cands = [h for h in leaves if blocks[h].depth % cp_degree in over] or leaves
        victim = min(cands, key=lambda h: (blocks[h].age, -blocks[h].depth, h))
        members.discard(victim)
        counts[blocks[victim].depth % cp_degree] -= 1
        nchild[blocks[victim].parent_hash] -= 1
        dropped.append(victim)
    return dropped


def plan(blocks: dict[int, SourceBlock], targets: Sequence[tuple[Sequence[jax.Device], set]],
         num_blocks: int) -> tuple[list[dict[int, int]], list[BlockMove]]:
    """Block ids of every target's blocks and the moves that put them there.

    Args:
      blocks: `collect_blocks` of the old workers.
      targets: per new worker, its devices in rank order (disjoint across targets) and the
        ancestor-closed hashes it keeps (each rank's count within `num_blocks`, see `fit`).
      num_blocks: blocks per device.

    Returns:
      `(layouts, moves)`: per target `{hash: block id on rank depth % C}`; a block whose device
      already holds a copy keeps that id (no move), the others take the lowest ids free after
      those and are moved from the copy on the lowest device id.
    """
    layouts, moves = [], []
    for devices, members in targets:
        c = len(devices)
        order = [h for h in blocks if h in members]  # parents first
        ids, used = {}, collections.defaultdict(set)
        for h in order:
            dev = devices[blocks[h].depth % c]
            b = blocks[h].copies.get(dev)
            if b is not None:
                ids[h] = b
                used[dev].add(b)
        free = {d: iter(sorted(set(range(num_blocks)) - used[d])) for d in devices}
        for h in order:
            if h in ids:
                continue
            dev = devices[blocks[h].depth % c]
            ids[h] = next(free[dev])
            src = min(blocks[h].copies, key=lambda d: d.id)
            moves.append(BlockMove(src, blocks[h].copies[src], dev, ids[h]))
        layouts.append(ids)
    return layouts, moves


def build_cache(blocks: dict[int, SourceBlock], ids: dict[int, int], num_blocks: int,
                cp_degree: int) -> PrefixCache:
    """A `PrefixCache` holding exactly the blocks `ids` (hash -> block id on rank depth % C).

    Leaf paths are inserted least recently used first, so the new cache evicts in about the
    old order. Its event stream is left empty (the caller reports the new contents).
    """
    members = set(ids)
    parents = {blocks[h].parent_hash for h in members}
    leaves = sorted((h for h in members if h not in parents),
                    key=lambda h: (blocks[h].age, blocks[h].depth, h))
    events, done = [], set()
    for leaf in leaves:
        for h in chain(blocks, leaf):
            if h not in done:
                done.add(h)
                b = blocks[h]
                events.append(CacheEvent("insert", h, b.parent_hash, b.depth % cp_degree,
                                         ids[h]))
    cache = PrefixCache.replay(num_blocks, cp_degree, events)
    cache.drain_events()
    return cache
