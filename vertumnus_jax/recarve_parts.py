"""Split a CP worker into more than two workers in one re-carve, by repeated halving.

A pool under overload that must go from CP-8 to CP-2 (or CP-1) workers pays one drain and one
re-carve this way instead of one per halving (`serving.policy.composition`: the overload rule
plans the splits a window calls for and makes each worker's at once). The parts are what
halving the worker, then some of its halves, and so on, makes (`serving.policy.worker.
is_aligned_tiling`): each halving is `vertumnus_jax.recarve.split_worker`, so every retained
prefix goes to one part and the weights are re-wrapped, never copied; the intermediate
halves exist only inside this call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np

from mesh.replicas import ParamReplicas
from vertumnus_jax.recarve import MoveStats, check_idle, split_worker
from vertumnus_jax.worker import Worker


def split_worker_into(worker: Worker, meshes: Sequence[jax.sharding.Mesh], *,
                      replicas: ParamReplicas | None = None
                      ) -> tuple[tuple[Worker, ...], MoveStats]:
    """Splits an idle worker into the parts `meshes` cover, in device order.

    Args:
      worker: the worker, CP degree >= 2, idle (`recarve.check_idle`).
      meshes: 1-D meshes with the worker's axis, two or more, over consecutive runs of its
        devices in rank order whose sizes repeated halving makes (`[4, 2, 2]` of an 8, not
        `[2, 4, 2]`); two meshes are `split_worker`'s halves.
      replicas: a `mesh.ParamReplicas` to assemble each part's parameters from; default the
        old worker's per-device parameter buffers re-wrapped (zero copy).

    Returns:
      `(workers, MoveStats)`: one worker per mesh, in order. The copies (KV blocks and bytes,
      weight bytes) are summed over the halvings (a block moved twice counts twice);
      `kv_blocks_in_place` counts the new workers' blocks on the device they were on before;
      `cached_hashes` per new worker; `dropped_hashes` those no part holds; `seconds` the
      whole call. The old worker (and every intermediate half) is retired.

    Raises:
      ValueError: (nothing changed) a busy or retired worker, degree 1, fewer than two meshes,
        or meshes that are not such parts of its devices (checked before any change).
    """
    start = time.perf_counter()
    check_idle(worker)
    meshes = list(meshes)
    devs, axis = list(worker.devices), worker.axis
    sizes = [m.devices.size if isinstance(m, jax.sharding.Mesh) else -1 for m in meshes]
    at, ok = 0, len(meshes) >= 2
    for m, c in zip(meshes, sizes):
        ok = ok and c >= 1 and not c & (c - 1) and at % c == 0 and \
            tuple(m.axis_names) == (axis,) and list(m.devices.reshape(-1)) == devs[at:at + c]
        at += max(c, 0)
    if not ok or at != len(devs):
        raise ValueError(
            f"meshes must be two or more 1-D meshes with axis {axis!r} over the parts repeated "
            f"halving makes of devices {[d.id for d in devs]}, in order; got sizes {sizes}")
    out: list[Worker] = []
    copies = [0, 0, 0]  # KV blocks and bytes copied, weight bytes not re-wrapped: every halving's
    where = _block_devices(worker)  # hash -> device id, before

    def halve(w: Worker, parts: list[jax.sharding.Mesh]) -> None:
        if len(parts) == 1:
            out.append(w)
            return
        c, k, n = w.cp_degree // 2, 0, 0
        while n < c:  # (the lower half's parts end exactly at its middle: an aligned tiling)
            n, k = n + parts[k].devices.size, k + 1
        halves = tuple(p[0] if len(p) == 1 else jax.sharding.Mesh(
            np.array(list(w.devices[i * c:(i + 1) * c])), (axis,))
            for i, p in enumerate((parts[:k], parts[k:])))
        lower, upper, stats = split_worker(w, halves, replicas=replicas)
        copies[0] += stats.kv_blocks_moved
        copies[1] += stats.kv_bytes_moved
        copies[2] += stats.weight_bytes_moved
        halve(lower, parts[:k])
        halve(upper, parts[k:])

    halve(worker, meshes)
    cached = tuple(tuple(w.cached_hashes()) for w in out)
    after = [_block_devices(w) for w in out]
    in_place = sum(1 for part in after for h, d in part.items() if where.get(h) == d)
    dropped = tuple(h for h in where if not any(h in part for part in after))
    return tuple(out), MoveStats(copies[0], copies[1], in_place, copies[2],
                                 time.perf_counter() - start, dropped, cached)


def _block_devices(worker: Worker) -> dict[int, int]:
    """Per cached block hash, the id of the device (of `worker`'s) its K/V sits on."""
    devs = worker.devices
    return {b.block_hash: devs[b.rank].id for b in worker.cache.blocks()}
