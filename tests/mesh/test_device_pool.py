"""DevicePool: aligned power-of-two groups, legal operations, two-phase split/merge with epochs,
errors that change nothing, and seeded random sequences of operations keeping the invariants."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from mesh import DevicePool, check_composition


def _snapshot(pool):
    return (pool.groups, pool.epoch, pool.pending, pool.legal_splits(), pool.legal_merges())


def _check_invariants(pool, used):
    groups = pool.groups
    covered = [i for g in groups for i in g.device_indices]
    assert covered == list(range(used))  # every used device exactly once, in device order
    for g in groups:
        assert g.cp_degree >= 1 and g.cp_degree & (g.cp_degree - 1) == 0
        assert g.first_device % g.cp_degree == 0  # aligned
        assert g.epoch <= pool.epoch
        devices = [d.id for d in pool.mesh(g.worker_id).devices.reshape(-1)]
        assert devices == [pool.devices[i].id for i in g.device_indices]
    assert len({g.worker_id for g in groups}) == len(groups)


def test_groups_meshes_and_legal_operations():
    pool = DevicePool(jax.devices(), [4, 2, 2])
    assert [(g.worker_id, g.first_device, g.cp_degree, g.epoch) for g in pool.groups] == [
        (0, 0, 4, 0), (1, 4, 2, 0), (2, 6, 2, 0)]
    assert pool.composition == [4, 2, 2] and pool.num_devices_used == 8
    assert pool.mesh(1).axis_names == ("cp",) and pool.mesh(1).shape["cp"] == 2
    assert pool.legal_splits() == [0, 1, 2] and pool.legal_merges() == [(1, 2)]
    pool = DevicePool(jax.devices(), [2, 1, 1, 4], worker_ids=[10, 11, 12, 13])
    assert pool.legal_splits() == [10, 13] and pool.legal_merges() == [(11, 12)]
    pool = DevicePool(jax.devices(), [1, 1, 1, 1, 2])  # 6 of 8 devices
    assert pool.legal_merges() == [(0, 1), (2, 3)] and pool.num_devices_used == 6
    pool.mark_busy(1)
    pool.mark_draining(2)
    assert pool.legal_merges(idle_only=True) == [] and pool.legal_merges() == [(0, 1), (2, 3)]
    assert pool.legal_splits(idle_only=True) == [4]


@pytest.mark.parametrize("composition,match", [
    ([], "at least one"), ([3], "power of two"), ([0, 2], "power of two"),
    ([True], "power of two"), ([2, 4], "not a multiple of 4"), ([1, 2], "not a multiple of 2"),
    ([4, 4, 2], "needs 10 devices, only 8"), ([16], "needs 16 devices"),
])
def test_invalid_compositions(composition, match):
    with pytest.raises(ValueError, match=match):
        DevicePool(jax.devices(), composition)
    with pytest.raises(ValueError, match=match):
        check_composition(composition, 8)


def test_split_is_adopted_only_when_every_rank_is_ready():
    pool = DevicePool(jax.devices(), [4, 4])
    change = pool.begin_split(1)
    assert change.kind == "split" and change.epoch == 1 and change.old_ids == (1,)
    assert [(g.worker_id, g.first_device, g.cp_degree, g.epoch) for g in change.new_groups] == [
        (2, 4, 2, 1), (3, 6, 2, 1)]
    assert [d.id for d in pool.mesh(3).devices.reshape(-1)] == [6, 7]  # pending worker's mesh
    assert pool.legal_splits() == [0] and pool.legal_merges() == []  # 1 is reserved
    with pytest.raises(ValueError, match="pending change"):
        pool.begin_split(1)
    with pytest.raises(ValueError, match="being re-carved"):
        pool.mark_busy(1)
    change.mark_ready(2, 0)
    change.mark_ready(2, 1)
    change.mark_ready(3, 1)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=r"ranks not ready \{3: \[0\]\}"):
        pool.commit(change)
    assert _snapshot(pool) == before and pool.composition == [4, 4]
    for bad in ((3, 2), (3, -1), (1, 0)):
        with pytest.raises(ValueError):
            change.mark_ready(*bad)
    change.mark_ready(3, 0)
    assert change.ready
    new = pool.commit(change)
    assert pool.composition == [4, 2, 2] and [g.worker_id for g in new] == [2, 3]
    assert pool.group(2).epoch == 1 and pool.group(0).epoch == 0
    with pytest.raises(ValueError, match="not a pending change"):
        pool.commit(change)
    with pytest.raises(ValueError, match="not a worker"):
        pool.group(1)


def test_split_into_parts_in_one_change():
    pool = DevicePool(jax.devices(), [8])
    before = _snapshot(pool)
    for parts in ([2, 4, 2], [4, 2], [4, 4, 4], [8], [4, True, 2, 1], [4, 2.0, 2]):
        with pytest.raises(ValueError, match="parts must be two or more"):
            pool.begin_split(0, parts=parts)
        assert _snapshot(pool) == before
    with pytest.raises(ValueError, match="3 distinct"):
        pool.begin_split(0, new_ids=[5, 6], parts=[4, 2, 2])
    change = pool.begin_split(0, new_ids=[5, 6, 7, 8], parts=[1, 1, 2, 4])
    assert [(g.worker_id, g.first_device, g.cp_degree) for g in change.new_groups] == [
        (5, 0, 1), (6, 1, 1), (7, 2, 2), (8, 4, 4)]
    for wid in change.new_ids:
        change.mark_worker_ready(wid)
    pool.commit(change)
    assert pool.composition == [1, 1, 2, 4] and pool.legal_merges() == [(5, 6)]
    change = pool.begin_split(8, parts=np.array([2, 1, 1]))  # (numpy integers as ints)
    assert [type(g.cp_degree) for g in change.new_groups] == [int] * 3


def test_merge_abort_and_explicit_ids_and_epochs():
    pool = DevicePool(jax.devices(), [2, 2, 2, 2])
    change = pool.begin_merge(3, 2, new_id=40, epoch=7)  # any order; scheduler's id and epoch
    assert change.old_ids == (2, 3) and change.epoch == 7
    assert [(g.worker_id, g.first_device, g.cp_degree) for g in change.new_groups] == [(40, 4, 4)]
    with pytest.raises(ValueError, match="already in use"):
        pool.begin_merge(0, 1, new_id=40)
    with pytest.raises(ValueError, match="epoch must be an int > 7"):
        pool.begin_merge(0, 1, epoch=7)
    pool.abort(change)
    assert pool.composition == [2, 2, 2, 2] and pool.pending == ()
    with pytest.raises(ValueError, match="not a pending change"):
        pool.abort(change)
    change = pool.begin_merge(0, 1)
    assert change.new_ids == (41,) and change.epoch == 8  # ids and epochs are never reused
    change.mark_worker_ready(41)
    pool.commit(change)
    assert pool.composition == [4, 2, 2] and pool.group(41).epoch == 8


def test_invalid_operations_change_nothing():
    pool = DevicePool(jax.devices(), [2, 2, 2, 1, 1])
    pool.mark_busy(0)
    pool.mark_draining(3)
    before = _snapshot(pool)
    cases = [
        (lambda: pool.begin_split(3), "draining"),
        (lambda: pool.begin_split(0), "busy"),
        (lambda: pool.begin_split(4), "CP degree 1"),
        (lambda: pool.begin_split(9), "not a worker"),
        (lambda: pool.begin_merge(1, 2), "not buddies: not the two halves"),
        (lambda: pool.begin_merge(2, 4), "CP degrees 2 and 1 differ"),
        (lambda: pool.begin_merge(0, 1), "busy"),
        (lambda: pool.begin_merge(3, 4), "draining"),
        (lambda: pool.begin_merge(1, 1), "itself"),
        (lambda: pool.begin_split(1, new_ids=[5, 5]), "distinct"),
        (lambda: pool.begin_split(1, new_ids=[2, 9]), "already in use"),
        (lambda: pool.mark_busy(9), "not a worker"),
    ]
    for op, match in cases:
        with pytest.raises(ValueError, match=match):
            op()
        assert _snapshot(pool) == before
    pool.mark_draining(3, False)
    pool.mark_busy(0, False)
    assert pool.legal_merges(idle_only=True) == [(0, 1), (3, 4)]
    assert pool.begin_merge(4, 3).new_ids == (5,)


def test_random_split_merge_sequences_keep_the_invariants():
    rng = random.Random(0)
    for start in ([8], [1] * 8, [4, 2, 1, 1], [2, 2, 1, 1]):
        pool = DevicePool(jax.devices(), start)
        used = sum(start)
        seen = {tuple(pool.composition)}
        for _ in range(150):
            ids = [g.worker_id for g in pool.groups]
            splits, merges = pool.legal_splits(), pool.legal_merges()
            # An operation that is not listed as legal must raise and change nothing.
            a, b = rng.choice(ids), rng.choice(ids)
            if (min(a, b, key=lambda w: pool.group(w).first_device),
                    max(a, b, key=lambda w: pool.group(w).first_device)) not in merges:
                before = _snapshot(pool)
                with pytest.raises(ValueError):
                    pool.begin_merge(a, b)
                assert _snapshot(pool) == before
            if a not in splits:
                with pytest.raises(ValueError):
                    pool.begin_split(a)
            ops = [("split", w) for w in splits] + [("merge", p) for p in merges]
            kind, arg = rng.choice(ops)
            change = pool.begin_split(arg) if kind == "split" else pool.begin_merge(*arg)
            if rng.random() < 0.2:
                pool.abort(change)
            else:
                for g in change.new_groups:
                    change.mark_worker_ready(g.worker_id)
                pool.commit(change)
            _check_invariants(pool, used)
            seen.add(tuple(pool.composition))
        assert len(seen) > 3


def test_edge_inputs_rejected_or_normalised():
    import numpy as np

    devs = jax.devices()
    with pytest.raises(ValueError, match="distinct"):
        DevicePool([devs[0]] * 8, [8])
    assert DevicePool(devs, [np.int64(4), 2, 2]).composition == [4, 2, 2]
    pool = DevicePool(devs, [4, 4])
    change = pool.begin_split(0)
    with pytest.raises(ValueError, match="pending"):
        pool.mark_draining(0)
    with pytest.raises(ValueError, match="rank"):
        change.mark_ready(change.new_ids[0], True)
