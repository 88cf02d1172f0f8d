"""Split and merge CP workers without reloading weights; replicate and reclaim cached prefixes.

Weights stay put: a new worker's parameters are re-wrapped from the per-device buffers of the
old workers (`mesh.ParamReplicas.from_replicated(...).assemble(mesh)`) or from given replicas;
`MoveStats.weight_bytes_moved` counts, by buffer pointer, the parameter bytes that are *not*
the old buffers on the same device (0 when re-wrapped). KV pools are re-wrapped too: every new
worker adopts its devices' pool buffers, and only blocks that must change device move
(`vertumnus_jax.kv_move`). Retained prefixes stay resident (Vertumnus paper section 6; DESIGN.md
"Devices, meshes and KV"):

- split of a 2C worker: each retained prefix (root-to-leaf path of its cache) goes to one half,
  by the `assign` policy or, by default, to the half with the lower resulting per-rank
  occupancy (then fewer moves). A block at depth i must sit on the half's rank `i mod C`; those
  that lived on the other half's ranks are moved, and the other half frees its copies. A block
  shared by prefixes assigned to both halves is kept on both.
- merge of two buddy C workers: the two caches are combined (a block cached by both is kept
  once) and re-striped to `i mod 2C` **eagerly**: every block is in place before the merged
  worker is returned, so no pending block can be read.

Blocks that do not fit (a rank over its `num_blocks`) are dropped, least recently used leaves
first, and reported in `MoveStats.dropped_hashes`. The old workers must be idle (no live
requests, no locked or held blocks); they are `retire`d on success. Every check runs before any
change: a ValueError leaves the old workers as they were.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from mesh.replicas import ParamReplicas, buffer_pointers, shard_bytes
from vertumnus_jax.kv_move import (
    BlockMove,
    block_bytes,
    build_cache,
    chain,
    collect_blocks,
    fit,
    move_blocks,
    plan,
)
from vertumnus_jax.worker import Worker, check_replicated_params


@dataclasses.dataclass(frozen=True)
class MoveStats:
    """What a split or merge did.

    Attributes:
      kv_blocks_moved: KV blocks copied to another device.
      kv_bytes_moved: their bytes (K and V, all layers).
      kv_blocks_in_place: retained blocks that stayed in their device buffer (no copy).
      weight_bytes_moved: parameter bytes of the new workers not re-wrapped from the old
        workers' buffers on the same device (0 for a re-carve).
      seconds: wall time of the call (excluding any drain), device work finished.
      dropped_hashes: block hashes cached before and held by no new worker (did not fit).
      cached_hashes: per new worker (split: lower half, upper half), its cached block hashes,
        parents first (for `Scheduler.finish_reconfiguration`).
    """

    kv_blocks_moved: int
    kv_bytes_moved: int
    kv_blocks_in_place: int
    weight_bytes_moved: int
    seconds: float
    dropped_hashes: tuple[int, ...]
    cached_hashes: tuple[tuple[int, ...], ...]


def check_idle(worker: Worker, name: str = "worker") -> None:
    """Raises ValueError unless `worker` is live and idle: no live requests, no locked block,
    no block allocated outside its cache."""
    if not isinstance(worker, Worker):
        raise ValueError(f"{name} must be a Worker, got {type(worker).__name__}")
    if worker.retired is not None:
        raise ValueError(f"{name} was retired ({worker.retired})")
    if worker.live_requests:
        raise ValueError(f"{name} has {len(worker.live_requests)} live requests; drain and "
                         "release them first")
    cache, owned = worker.cache, collections.Counter()
    for b in cache.blocks():
        if b.ref:
            raise ValueError(f"{name} has locked block {b.block_hash:#x} (refcount {b.ref})")
        owned[b.rank] += 1
    for r in range(worker.cp_degree):
        if cache.num_free(r) + owned[r] != cache.num_blocks:
            raise ValueError(f"{name} holds blocks on rank {r} outside its cache (an unfinished "
                             "request)")


def _check_mesh(mesh, devices, axis: str, name: str) -> None:
    if not isinstance(mesh, jax.sharding.Mesh) or tuple(mesh.axis_names) != (axis,) or \
            tuple(mesh.devices.reshape(-1)) != tuple(devices):
        raise ValueError(f"{name} must be a 1-D mesh with axis {axis!r} over devices "
                         f"{[d.id for d in devices]} in that order, got {mesh!r}")


def _new_params(mesh, olds, params, replicas):
    if params is not None:
        out = params
    elif replicas is not None:
        out = replicas.assemble(mesh)
    else:
        out = ParamReplicas.from_replicated(*(w.params for w in olds)).assemble(mesh)
    check_replicated_params(out, mesh)
    return out


def _weight_bytes_moved(olds, new_params) -> int:
    before: dict[int, tuple[int, ...]] = {}
    for w in olds:
        before.update(buffer_pointers(w.params))
    moved = 0
    for p in new_params:
        sizes = shard_bytes(p)
        for dev, ptrs in buffer_pointers(p).items():
            old = before.get(dev, ())
            moved += sum(n for i, (ptr, n) in enumerate(zip(ptrs, sizes[dev]))
                         if i >= len(old) or old[i] != ptr)
    return moved


def _carve(olds: Sequence[Worker], targets, meshes, params, dropped, blocks, start) -> tuple:
    """Retires the old workers, moves the blocks, builds the new workers; returns (workers,
    stats). The old workers are retired before the first of their buffers is donated, so a
    failure from there on leaves them retired, never in use with deleted buffers
    (`serving.live_recarve` takes such workers out of the pool)."""
    w0 = olds[0]
    nb = w0.cache.num_blocks
    layouts, moves = plan(blocks, targets, nb)
    buffers = {}
    for w in olds:
        ks, vs = w.pool.device_buffers()
        buffers.update({d: (k, v) for d, k, v in zip(w.devices, ks, vs)})
    weight_moved = _weight_bytes_moved(olds, params)
    for w in olds:  # from the first donated buffer on, the old workers are gone
        w.retire("merge" if len(olds) > 1 else "split")  # (one worker carved into parts: a split)
    out = move_blocks(buffers, moves)
    news = []
    for (devices, _), mesh, p, ids in zip(targets, meshes, params, layouts):
        news.append(Worker(
            mesh, w0.graphdef, num_blocks=nb, block_size=w0.block_size, axis=w0.axis,
            block_sizes=w0.block_sizes, interpret=w0.interpret, min_bucket=w0.min_bucket,
            params=p, kv_buffers=([out[d][0] for d in devices], [out[d][1] for d in devices]),
            cache=build_cache(blocks, ids, nb, len(devices)), executables=w0.executables))
    jax.block_until_ready([(w.pool.k, w.pool.v) for w in news])
    nbytes = block_bytes(w0.config, w0.block_size)
    stats = MoveStats(len(moves), len(moves) * nbytes, sum(map(len, layouts)) - len(moves),
                      weight_moved, time.perf_counter() - start, tuple(dropped),
                      tuple(w.cached_hashes() for w in news))
    return news, stats


def _default_side(path, members, counts, blocks, halves, c) -> int:
    best = None
    for side in (0, 1):
        new = [h for h in path if h not in members[side]]
        after = counts[side] + collections.Counter(blocks[h].depth % c for h in new)
        moves = sum(halves[side][blocks[h].depth % c] not in blocks[h].copies for h in new)
        key = (max(after.values(), default=0), moves, side)
        best = key if best is None or key < best else best
    return best[2]


def split_worker(worker: Worker, meshes: tuple[jax.sharding.Mesh, jax.sharding.Mesh], *,
                 params: tuple | None = None, replicas: ParamReplicas | None = None,
                 assign: Callable[[tuple[int, ...]], int] | None = None
                 ) -> tuple[Worker, Worker, MoveStats]:
    """Splits an idle 2C worker into workers on its lower and upper C devices.

    Args:
      worker: the worker, CP degree >= 2, idle (`check_idle`).
      meshes: `(lower, upper)` 1-D meshes with the worker's axis over its first and last C
        devices, in rank order (`DevicePool.mesh` of the new ids).
      params: `(lower, upper)` parameter states already replicated on those meshes, or a
        `mesh.ParamReplicas` (as `replicas`); default `replicas.assemble(mesh)`, or without
        replicas the old worker's per-device parameter buffers re-wrapped (zero copy).
      replicas: a `mesh.ParamReplicas` to assemble the parameters from.
      assign: policy callback, called once per retained prefix (block hashes from the root
        to a leaf of the cache; most recently used prefixes first): returns 0 (lower half)
        or 1 (upper half). Default: the half with the lower resulting per-rank occupancy,
        then fewer moves, then the lower half.

    Returns:
      `(lower_worker, upper_worker, MoveStats)`; the old worker is retired.

    Raises:
      ValueError: (nothing changed) a busy or retired worker, degree 1, meshes over other
        devices or axes, params not replicated on the meshes, or `assign` returning other
        than 0 or 1.
    """
    start = time.perf_counter()
    check_idle(worker)
    c2 = worker.cp_degree
    if c2 < 2:
        raise ValueError("worker has CP degree 1 and cannot split")
    if not isinstance(meshes, (tuple, list)) or len(meshes) != 2:
        raise ValueError(f"meshes must be a (lower, upper) pair, got {meshes!r}")
    c, devs = c2 // 2, worker.devices
    halves = (devs[:c], devs[c:])
    for k, (m, d) in enumerate(zip(meshes, halves)):
        _check_mesh(m, d, worker.axis, f"meshes[{k}]")
    if hasattr(params, "assemble"):  # params=replicas
        params, replicas = None, params
    if params is not None and (not isinstance(params, (tuple, list)) or len(params) != 2):
        raise ValueError("params must be a (lower, upper) pair of parameter states")
    new_params = [_new_params(m, [worker], None if params is None else params[k], replicas)
                  for k, m in enumerate(meshes)]
    blocks = collect_blocks([worker])
    parents = {b.parent_hash for b in blocks.values()}
    leaves = sorted((h for h in blocks if h not in parents),
                    key=lambda h: (-blocks[h].age, -blocks[h].depth, h))
    members = [set(), set()]
    counts = [collections.Counter(), collections.Counter()]
    for leaf in leaves:
        path = chain(blocks, leaf)
        side = (assign(path) if assign is not None
                else _default_side(path, members, counts, blocks, halves, c))
        if side not in (0, 1) or isinstance(side, bool):
            raise ValueError(f"assign must return 0 (lower) or 1 (upper), got {side!r}")
        for h in path:
            if h not in members[side]:
                members[side].add(h)
                counts[side][blocks[h].depth % c] += 1
    nb = worker.cache.num_blocks
    fit(blocks, members[0], c, nb)
    fit(blocks, members[1], c, nb)
    dropped = [h for h in blocks if h not in members[0] and h not in members[1]]
    news, stats = _carve([worker], list(zip(halves, members)), meshes, new_params, dropped,
                         blocks, start)
    return news[0], news[1], stats


def merge_workers(a: Worker, b: Worker, mesh: jax.sharding.Mesh, *, params=None,
                  replicas: ParamReplicas | None = None) -> tuple[Worker, MoveStats]:
    """Merges two idle buddy C workers into one 2C worker on `mesh`; re-striping is eager.

    Args:
      a, b: idle workers of the same model, degree, block size, blocks per device and axis.
      mesh: 1-D mesh over the lower worker's devices then the upper's (rank order).
      params: the parameter state already replicated on `mesh`, or a `mesh.ParamReplicas`;
        default as in `split_worker` (the two workers' per-device buffers re-wrapped).
      replicas: a `mesh.ParamReplicas` to assemble the parameters from.

    Returns:
      `(merged_worker, MoveStats)`: the union of both caches, block i on rank `i mod 2C`,
      all blocks in place when it returns; LRU prefixes that do not fit are dropped and
      reported. Both old workers are retired.

    Raises:
      ValueError: (nothing changed) a busy or retired worker, the same worker twice,
        workers that differ in model, degree, block size, blocks per device or axis, a mesh
        that is not the lower worker's devices followed by the upper's, or params not
        replicated on it.
    """
    start = time.perf_counter()
    check_idle(a, "a")
    check_idle(b, "b")
    if a is b:
        raise ValueError("cannot merge a worker with itself")
    fields = ("config", "cp_degree", "block_size", "axis", "block_sizes", "interpret",
              "min_bucket")
    for f in fields:
        if getattr(a, f) != getattr(b, f):
            raise ValueError(f"workers differ in {f}: {getattr(a, f)!r} vs {getattr(b, f)!r}")
    if a.cache.num_blocks != b.cache.num_blocks:
        raise ValueError(f"workers differ in num_blocks: {a.cache.num_blocks} vs "
                         f"{b.cache.num_blocks}")
    lo, hi = sorted((a, b), key=lambda w: min(d.id for d in w.devices))  # lower device ids first
    _check_mesh(mesh, lo.devices + hi.devices, a.axis, "mesh")
    if hasattr(params, "assemble"):  # params=replicas
        params, replicas = None, params
    new_params = _new_params(mesh, [lo, hi], params, replicas)
    blocks = collect_blocks([lo, hi])
    members = set(blocks)
    dropped = fit(blocks, members, 2 * a.cp_degree, a.cache.num_blocks)
    news, stats = _carve([lo, hi], [(lo.devices + hi.devices, members)], [mesh], [new_params],
                         dropped, blocks, start)
    return news[0], stats


@dataclasses.dataclass(frozen=True)
class ReplicationResult:
    """What `replicate_prefix` did on the destination: `inserted` / `evicted` block hashes
    (its cache's changes, evictions made room), KV blocks and bytes copied, wall seconds."""

    inserted: tuple[int, ...]
    evicted: tuple[int, ...]
    kv_blocks_moved: int
    kv_bytes_moved: int
    seconds: float


def _as_chain(block_hashes) -> tuple[int, ...]:
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence) or \
            not block_hashes:
        raise ValueError("block_hashes must be a non-empty sequence of ints")
    for i, h in enumerate(block_hashes):
        if isinstance(h, (bool, np.bool_)) or not isinstance(h, (int, np.integer)):
            raise ValueError(f"block_hashes must hold ints, got {h!r} at index {i}")
    return tuple(int(h) for h in block_hashes)


def _take_events(cache, n_events: int, consume: bool):
    events = list(cache.events[n_events:])
    if consume:
        del cache.events[n_events:]
    return (tuple(e.block_hash for e in events if e.kind == "insert"),
            tuple(e.block_hash for e in events if e.kind == "evict"))


def replicate_prefix(src: Worker, dst: Worker, block_hashes: Sequence[int], *,
                     consume_events: bool = True) -> ReplicationResult:
    """Copies the cached prefix `block_hashes` from `src` to `dst`, only the blocks dst lacks.

    Block i of the chain is read from src's rank `i mod C_src` and written to dst's rank
    `i mod C_dst` (re-striped to dst's degree) with a device-to-device `jax.device_put`. The
    copy has completed on the devices when this returns; only then are the blocks in dst's
    cache. dst's leading run already cached is kept (locked during the copy); room is made by
    LRU eviction of dst's unreferenced blocks.

    Args:
      src, dst: live workers of the same model and block size (any degrees), not the same.
      block_hashes: chained block hashes from the root; src must cache all of them.
      consume_events: take the insert/evict events of this copy out of `dst.cache.events`, so
        they are reported once, through the result (`PrefixCopies.finish`).

    Raises:
      ValueError: (nothing changed) src is dst, retired workers, another model or block size,
        workers sharing a device, an empty chain, src not holding the whole chain, or hashes
        that are not a chain in dst.
      OutOfBlocksError: (nothing changed) dst cannot hold the missing blocks.
    """
    start = time.perf_counter()
    chain_ = _as_chain(block_hashes)
    if src is dst:
        raise ValueError("src and dst are the same worker")
    for name, w in (("src", src), ("dst", dst)):
        if not isinstance(w, Worker) or w.retired is not None:
            raise ValueError(f"{name} must be a live Worker")
    if (src.config, src.block_size) != (dst.config, dst.block_size):
        raise ValueError("src and dst differ in model or block size")
    if set(src.devices) & set(dst.devices):
        raise ValueError(f"src (devices {src.device_ids}) and dst (devices {dst.device_ids}) "
                         "share devices")
    src_ids = src.cache.match(chain_, touch=False)
    if len(src_ids) != len(chain_):
        raise ValueError(f"src holds only {len(src_ids)} of the {len(chain_)} blocks")
    cache = dst.cache
    cache.validate_chain(chain_)
    have = cache.match(chain_, touch=False)
    k, n, n_events = len(have), len(chain_), len(cache.events)
    with cache.transaction():
        cache.lock(chain_[:k])
        new_ids = cache.allocate(k, n - k)
        moves = [BlockMove(src.devices[i % src.cp_degree], src_ids[i],
                           dst.devices[i % dst.cp_degree], new_ids[i - k]) for i in range(k, n)]
        buffers = {}
        for w in (src, dst):
            ks, vs = w.pool.device_buffers()
            buffers.update({d: (kk, vv) for d, kk, vv in zip(w.devices, ks, vs)})
        out = move_blocks(buffers, moves)
        dst.pool.replace_buffers([out[d][0] for d in dst.devices],
                                 [out[d][1] for d in dst.devices])
        cache.insert(chain_, have + new_ids)
        cache.unlock(chain_[:k])
    jax.block_until_ready((dst.pool.k, dst.pool.v))
    inserted, evicted = _take_events(cache, n_events, consume_events)
    nbytes = block_bytes(dst.config, dst.block_size)
    return ReplicationResult(inserted, evicted, n - k, (n - k) * nbytes,
                             time.perf_counter() - start)


def reclaim_prefix(worker: Worker, block_hashes: Sequence[int], *,
                   consume_events: bool = True) -> tuple[int, ...]:
    """Frees `worker`'s copy of the tail of the prefix `block_hashes` that no other cached
    prefix shares and no request holds: from its deepest cached block up while the block is
    an unreferenced leaf (`PrefixCache.evict_tail`).

    Returns the evicted hashes, deepest first (taken out of `worker.cache.events` with
    `consume_events`, for `PrefixCopies.finish_reclaim`). Raises ValueError for a retired worker
    or an empty chain.
    """
    chain_ = _as_chain(block_hashes)
    if not isinstance(worker, Worker) or worker.retired is not None:
        raise ValueError("worker must be a live Worker")
    n_events = len(worker.cache.events)
    evicted = worker.cache.evict_tail(chain_)
    _take_events(worker.cache, n_events, consume_events)
    return tuple(evicted)
