"""Reconfiguration: the drain/epoch protocol under load and the controller's decisions."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from eval.sim.simulator import SimConfig, simulate
from serving.policy.controller import ControllerConfig, ReconfigurationController, compositions, \
    initial_composition
from serving.policy.request import Request, chain_block_hashes, num_blocks
from serving.policy.router import LeastWorkRouter
from serving.policy.cost_router import VertumnusRouter
from serving.policy.worker import (WorkerSpec, are_buddies, is_aligned_tiling, layout_workers,
                                   merge_buddies, split_halves, split_parts)


class LinearCost:
    """T = 20 ms + 50 us per new token / C (ground truth and estimate)."""

    def predict(self, cp_degree, input_len, cached_len):
        return 0.02 + 5e-5 * (input_len - cached_len) / cp_degree

    __call__ = predict


def phased_workload(seed=0):
    """Low load, then a burst (splits), then quiet again (merges); shared prefixes."""
    rng = np.random.default_rng(seed)
    reqs, t, i = [], 0.0, 0
    for duration, rate in ((60, 2.0), (60, 60.0), (90, 1.0)):
        end = t + duration
        while True:
            t += rng.exponential(1 / rate)
            if t >= end:
                t = end
                break
            n = int(rng.integers(200, 6000))
            ids = [int(rng.integers(0, 5))] + [10_000 * i + k for k in range(num_blocks(n, 512) - 1)]
            reqs.append(Request(i, t, n, 1, chain_block_hashes(ids), 512))
            i += 1
    return reqs


@pytest.mark.parametrize("router", [LeastWorkRouter, VertumnusRouter])
def test_split_and_merge_under_load_lose_and_duplicate_nothing(router):
    reqs = phased_workload()
    workers = layout_workers([8, 8], kv_blocks_per_device=40, max_input_len=100_000)
    ctl = ReconfigurationController(
        ControllerConfig(upper=0.5, lower=0.2, window_s=5, hold_s=2, cooldown_s=3),
        num_gpus=16, max_input_len=lambda c: 100_000)
    handle = []
    cost = LinearCost()
    records = simulate(reqs, workers, cost, router(), cost, SimConfig(tick_interval=0.5),
                       setup=[ctl.attach, handle.append])
    [sched] = handle
    kinds = collections.Counter(d["kind"] for d in sched.reconfig.log)
    assert kinds["split"] >= 3 and kinds["merge"] >= 3, kinds
    ids = [r.request.request_id for r in records]
    assert sorted(ids) == list(range(len(reqs)))  # each exactly once
    assert all(r.ok for r in records)
    # Draining workers receive nothing new: nothing starts on an old worker after its drain began.
    for log in sched.reconfig.log:
        for r in records:
            if r.worker_id in log["old"]:
                assert r.start_time <= log["started"] + 1e-9
    # Devices are conserved and every worker stays aligned.
    assert sum(sched.composition) == 16
    for w in sched.workers.values():
        assert w.spec.first_device % w.cp_degree == 0
    # Epochs only grow; the new workers of an epoch start no work before it finished.
    epochs = [log["epoch"] for log in sched.reconfig.log]
    assert epochs == sorted(epochs)
    finished = {wid: log["finished"] for log in sched.reconfig.log for wid in log["new"]}
    for r in records:
        if r.worker_id in finished:
            assert r.start_time >= finished[r.worker_id] - 1e-9


def test_retained_prefixes_survive_split_and_merge_in_the_index():
    reqs = phased_workload(seed=1)
    workers = layout_workers([4, 4], kv_blocks_per_device=200, max_input_len=100_000)
    ctl = ReconfigurationController(ControllerConfig(upper=0.5, lower=0.2, window_s=5, hold_s=2,
                                                     cooldown_s=3, max_degree=4),
                                    num_gpus=8, max_input_len=lambda c: 100_000)
    handle = []
    cost = LinearCost()
    simulate(reqs, workers, cost, VertumnusRouter(), cost, SimConfig(tick_interval=0.5),
             setup=[ctl.attach, handle.append])
    [sched] = handle
    assert sched.reconfig.log
    backend_blocks = sum(sched.prefix_index.num_blocks(w) for w in sched.workers)
    assert backend_blocks > 0  # caches were carried over, not wiped


def test_geometry_rules():
    w = WorkerSpec(0, 4, 8, 40, 1000)
    a, b = split_halves(w, (5, 6), lambda c: 500 * c)
    assert (a.first_device, b.first_device, a.cp_degree, a.kv_capacity_blocks, a.max_input_len) == \
        (8, 10, 2, 20, 1000)
    assert are_buddies(a, b)
    assert merge_buddies(b, a, 9, lambda c: 7).first_device == 8
    c = WorkerSpec(1, 2, 12, 20, 1000)
    assert not are_buddies(b, c)  # 10-11 and 12-13 straddle a 4-aligned boundary
    with pytest.raises(ValueError, match="not buddies"):
        merge_buddies(b, c, 9, lambda c: 7)
    with pytest.raises(ValueError, match="cannot be split"):
        split_halves(WorkerSpec(0, 1, 0, 1, 1), (1, 2), lambda c: 1)


def test_split_parts_tile_the_worker_as_repeated_halving_does():
    w = WorkerSpec(3, 8, 16, 80, 1000, host=2)  # devices 16..23, 10 KV blocks each
    parts = split_parts(w, [2, 2, 4], (7, 8, 9), lambda c: 100 * c)
    assert [(p.worker_id, p.first_device, p.cp_degree, p.kv_capacity_blocks, p.max_input_len,
             p.host) for p in parts] == [(7, 16, 2, 20, 200, 2), (8, 18, 2, 20, 200, 2),
                                         (9, 20, 4, 40, 400, 2)]
    assert split_parts(w, [4, 4], (1, 2), lambda c: 5) == split_halves(w, (1, 2), lambda c: 5)
    made = split_parts(w, np.array([4, 2, 2]), (1, 2, 4), lambda c: 5)  # (numpy: as ints)
    assert [type(p.cp_degree) for p in made] == [int] * 3
    # (by hand: each part starts at a multiple of itself, the degrees sum to 8)
    good = ([4, 4], [4, 2, 2], [2, 2, 4], [1, 1, 2, 4], [4, 2, 1, 1], [1] * 8, [8])
    bad = ([2, 4, 2], [1, 2, 1, 4], [4, 2], [4, 4, 4], [3, 5], [4, 2, 2, 0], [], [2.0, 2, 4])
    assert all(is_aligned_tiling(8, p) for p in good)
    assert not any(is_aligned_tiling(8, p) for p in bad)
    for p in bad + ([8],):
        with pytest.raises(ValueError, match="cannot split worker 3"):
            split_parts(w, p, range(len(p)), lambda c: 5)
    with pytest.raises(ValueError, match="one id each"):
        split_parts(w, [4, 2, 2], (1, 2), lambda c: 5)


class _Idle:
    """A backend that starts nothing and re-carves nothing (the test finishes changes)."""

    def start_prefill(self, *a):
        pass

    def recarve(self, *a):
        pass


def test_begin_reconfiguration_rejects_bad_geometry_without_change():
    from serving.policy.scheduler import Scheduler

    s = Scheduler(layout_workers([2, 2, 1, 1], 10, 1000), LinearCost(), LeastWorkRouter(),
                  _Idle())
    bad = [
        ("merge", [0, 1], [WorkerSpec(9, 2, 0, 20, 1000)], "not a merge"),   # covers 2 of 4 devices
        ("fold", [0], [], "kind"),
        ("split", [0], [WorkerSpec(1, 1, 0, 10, 1000), WorkerSpec(9, 1, 1, 10, 1000)], "fresh"),
        ("split", [0], [WorkerSpec(8, 1, 0, 10, 1000), WorkerSpec(8, 1, 1, 10, 1000)], "fresh"),
        ("merge", [2, 2], [WorkerSpec(9, 2, 4, 20, 1000)], "repeat"),
        ("split", [0], [WorkerSpec(8, 2, 0, 20, 1000)], "not a split"),      # not halves
        ("merge", [1, 2], [WorkerSpec(9, 4, 0, 40, 1000)], "not a merge"),   # not buddies
        ("split", [0], [WorkerSpec(8, 1, 0, 10**6, 1000), WorkerSpec(9, 1, 1, 10**6, 1000)], "KV"),
        ("merge", [], [], "not a merge"),
    ]
    for kind, old, new, msg in bad:
        with pytest.raises(ValueError, match=msg):
            s.begin_reconfiguration(kind, old, new, 0.0)
    assert s.epoch == 0 and all(w.status.value == "active" for w in s.workers.values())
    assert s.begin_reconfiguration("merge", [2, 3], [WorkerSpec(9, 2, 4, 20, 1000)], 0.0).epoch == 1


def test_a_split_may_make_the_parts_repeated_halving_makes():
    from serving.policy.scheduler import Scheduler

    s = Scheduler(layout_workers([8, 4, 4], 10, 1000), LinearCost(), LeastWorkRouter(), _Idle())

    def specs(*parts, first=0):  # (id, degree) in device order from `first`, 10 blocks a GPU
        out = []
        for wid, c in parts:
            out.append(WorkerSpec(wid, c, first, 10 * c, 1000))
            first += c
        return out
    bad = [  # (each: not the parts halving the CP-8 at devices 0..7 makes; a part that is
        # not aligned, as [2, 4, 2], is refused by `WorkerSpec` itself)
        specs((7, 4), (8, 2)),                  # covers 6 of 8 devices
        specs((7, 2), (8, 2), (9, 4), first=8),  # another worker's devices
        specs((7, 4), (8, 2), (9, 1), (10, 1), (11, 1)),  # 9 devices
        specs((7, 8)),                          # one part
        [WorkerSpec(7, 4, 0, 40, 1000), WorkerSpec(8, 2, 6, 20, 1000),
         WorkerSpec(9, 2, 6, 20, 1000)],        # overlapping, a gap at 4..5
    ]
    for new in bad:
        with pytest.raises(ValueError, match="not a split"):
            s.begin_reconfiguration("split", [0], new, 0.0)
    assert s.epoch == 0 and s.composition == [8, 4, 4]
    rec = s.begin_reconfiguration("split", [0], specs((7, 1), (8, 1), (9, 2), (10, 4)), 0.0)
    assert rec.kind == "split" and len(rec.new_specs) == 4
    s.finish_reconfiguration(rec.epoch, 1.0, {})
    assert s.composition == [1, 1, 2, 4, 4, 4] and sorted(s.workers) == [1, 2, 7, 8, 9, 10]


def test_a_change_the_backend_could_not_make_is_given_up():
    # The backend refused to re-carve (its device pool said no) and changed nothing: the
    # scheduler gives the change up, the old worker takes placements again, a request that
    # waited for a worker is placed, and the backend's late finish of it is ignored.
    from serving.policy.scheduler import Scheduler

    s = Scheduler(layout_workers([8], 10, 1000), LinearCost(), LeastWorkRouter(), _Idle())
    parts = split_parts(s.workers[0].spec, [4, 2, 2], (1, 2, 3), lambda c: 1000)
    rec = s.begin_reconfiguration("split", [0], parts, 0.0)
    assert s.workers[0].status.value == "draining"
    s.submit(Request("r", 0.5, 100, 1, chain_block_hashes([1]), 512), 0.5)  # waits: no worker
    assert not s.workers[0].queue and s.workers[0].running is None
    assert s.abandon_reconfiguration(rec.epoch, 1.0) is rec
    assert s.workers[0].status.value == "active" and s.composition == [8]
    assert s.workers[0].running is not None and s.workers[0].running.request_id == "r"
    assert not s.reconfig.in_progress and s.reconfig.num_finished == 0
    s.finish_reconfiguration(rec.epoch, 2.0, {})  # (the backend's late finish: ignored)
    assert sorted(s.workers) == [0]
    with pytest.raises(ValueError, match="no reconfiguration of epoch"):
        s.abandon_reconfiguration(rec.epoch, 3.0)


def test_a_change_given_up_spreads_what_waited_as_a_finished_one_does():
    # [2, 2], both split at once; 4 requests arrive while every worker drains. The first change
    # is given up (its worker serves again and takes them), the second is finished: what still
    # queues is placed again over its idle new workers too, as `finish_reconfiguration` does.
    from serving.policy.scheduler import Scheduler

    s = Scheduler(layout_workers([2, 2], 10, 1000), LinearCost(), LeastWorkRouter(), _Idle())
    recs = [s.begin_reconfiguration("split", [w], split_halves(
        s.workers[w].spec, s.new_worker_ids(2), lambda c: 1000), 0.0) for w in (0, 1)]
    for i in range(4):
        s.submit(Request(f"r{i}", 0.1, 100, 1, chain_block_hashes([i]), 512), 0.1)
    assert all(not w.queue and w.running is None for w in s.workers.values())
    s.abandon_reconfiguration(recs[0].epoch, 1.0)
    assert len(s.workers[0].queue) == 3 and s.workers[0].running is not None
    s.finish_reconfiguration(recs[1].epoch, 2.0, {})
    new = [s.workers[sp.worker_id] for sp in recs[1].new_specs]
    assert sorted(len(w.queue) + (w.running is not None) for w in new) == [1, 1], s.workers
    assert len(s.workers[0].queue) == 1


def test_initial_composition_most_large_workers_with_enough_capacity():
    assert sorted(map(sorted, compositions(8, [2, 4]))) == [[2, 2, 2, 2], [2, 2, 4], [4, 4]]
    t = {2: 1.0, 4: 0.55}.get  # CP-4 is a little less efficient per GPU
    # rate 3 req/s at 80 %: [4,4] gives 3.64*0.8=2.9 < 3; [4,2,2] gives 3.82*0.8=3.05 >= 3.
    assert initial_composition(8, [2, 4], 3.0, t, 0.8) == [4, 2, 2]
    assert initial_composition(8, [2, 4], 1.0, t, 0.8) == [4, 4]
    assert initial_composition(8, [2, 4], 100.0, t, 0.8) == [2, 2, 2, 2]  # max capacity
    with pytest.raises(ValueError, match="fills num_gpus=6"):
        initial_composition(6, [4], 1.0, t, 0.8)
    with pytest.raises(ValueError, match="lower < upper"):
        ControllerConfig(upper=0.2, lower=0.5)


def test_initial_composition_keeps_a_worker_for_the_longest_prompts():
    t = {2: 1.0, 4: 0.55}.get
    assert initial_composition(8, [2, 4], 100.0, t, 0.8) == [2, 2, 2, 2]
    assert initial_composition(8, [2, 4], 100.0, t, 0.8, min_largest_degree=4) == [4, 2, 2]


def test_controller_never_splits_the_last_worker_that_holds_the_longest_prompt():
    from serving.policy.scheduler import Scheduler

    class B:
        def start_prefill(self, *a):
            pass

        def recarve(self, *a):
            pass

    max_len = {1: 1000, 2: 2000, 4: 4000}.get
    specs = [WorkerSpec(0, 4, 0, 400, 4000), WorkerSpec(1, 2, 4, 200, 2000), WorkerSpec(2, 2, 6, 200, 2000)]
    s = Scheduler(specs, LinearCost(), LeastWorkRouter(), B())
    ctl = ReconfigurationController(ControllerConfig(min_degree=1, max_degree=4), 8, max_len)
    ctl.attach(s)
    ctl.observe(Request("long", 0.0, 3500, 1, chain_block_hashes(range(7)), 512), 0, 0.0)
    s.workers[1].queued_seconds = s.workers[2].queued_seconds = 5.0  # the CP-4 is the idlest
    kind, old, new = ctl._split(s, 1.0)
    assert old == [1] and [w.cp_degree for w in new] == [1, 1]  # a CP-2 is split, not the CP-4
    ctl.longest = 1500  # once no prompt needs the CP-4, it is the cheapest to split
    assert ctl._split(s, 1.0)[1] == [0]


def test_split_gain_from_the_cost_model():
    from serving.policy.scheduler import Scheduler

    class PerfectCP:  # T = n / C: CP scales perfectly, splitting adds no capacity
        def predict(self, c, n, h):
            return (n - h) / c / 1000

    class B:
        def start_prefill(self, *a):
            pass

    for cost, want in ((PerfectCP(), 1.0), (LinearCost(), None)):
        s = Scheduler(layout_workers([4, 4], 100, 100_000), cost, LeastWorkRouter(), B())
        ctl = ReconfigurationController(ControllerConfig(), 8, lambda c: 100_000)
        ctl.attach(s)
        lengths = [300, 2000, 9000]
        for i, n in enumerate(lengths):
            ctl.observe(Request(i, 0.0, n, 1, chain_block_hashes(range(num_blocks(n, 512))), 512), 0, 0.0)
        gain = ctl.split_gain(s, 4)
        if want is not None:
            assert gain == pytest.approx(want)
        else:  # LinearCost: C*T = 0.02*C + 5e-5*n, so 4 -> 2 saves 0.04 s per request
            big = sum(4 * cost.predict(4, n, 0) for n in lengths)
            small = sum(2 * cost.predict(2, n, 0) for n in lengths)
            assert gain == pytest.approx(big / small) and gain > 1


def test_config_and_router_edges():
    import math

    from serving.policy.cost_router import VertumnusRouter
    from serving.policy.scheduler import Scheduler

    for bad in (dict(min_split_gain=math.nan), dict(hold_s=math.nan), dict(window_s=math.inf),
                dict(min_degree=3), dict(long_threshold=-1), dict(stable_band=-1)):
        with pytest.raises(ValueError):
            ControllerConfig(**bad)
    with pytest.raises(ValueError, match="num_gpus"):
        ReconfigurationController(ControllerConfig(), 0, lambda c: 1)
    with pytest.raises(ValueError, match="powers of two"):
        compositions(8, [])
    with pytest.raises(ValueError, match="mean_prefill_seconds"):
        initial_composition(8, [2, 4], 1.0, lambda c: 0.0, 0.8)

    class NanCost:
        def predict(self, c, n, h):
            return math.nan

    class B:
        def start_prefill(self, *a):
            pass

    s = Scheduler(layout_workers([1, 1], 10, 1000), NanCost(), VertumnusRouter(), B())
    with pytest.raises(ValueError, match="no finite placement cost"):
        s.submit(Request("r", 0.0, 100, 1, chain_block_hashes([1]), 512), 0.0)
    assert s.num_in_flight == 0 and all(not w.queue for w in s.workers.values())


def test_merges_back_when_merging_costs_no_capacity():
    from serving.policy.scheduler import Scheduler

    class PerfectCP:
        def predict(self, c, n, h):
            return (n - h) / c / 1000

    class B:
        def __init__(self):
            self.recarves = []

        def start_prefill(self, *a):
            pass

        def recarve(self, rec, now):
            self.recarves.append(rec)

    b = B()
    s = Scheduler(layout_workers([2, 2, 2, 2], 100, 100_000), PerfectCP(), LeastWorkRouter(), b)
    ctl = ReconfigurationController(ControllerConfig(upper=0.75, merge_margin=0.2, hold_s=2.0,
                                                     window_s=10.0, lower=0.1), 8, lambda c: 100_000)
    ctl.attach(s)
    # 8 GPUs, ~0.5 GPU-s/s per GPU of demand: above `lower`, below `upper - margin`.
    for i in range(40):
        ctl.observe(Request(i, i * 0.25, 1000, 1, chain_block_hashes([i, -i - 1]), 512), 0, i * 0.25)
    s.tick(9.0)  # 37 GPU-s over 9 s on 8 GPUs: 0.56, not yet calm
    s.tick(11.5)  # 33 GPU-s over the 10 s window: 0.41, calm from now
    assert not s.reconfig.in_progress
    s.tick(14.0)
    [rec] = s.reconfig.in_progress.values()
    assert rec.kind == "merge" and ctl.decisions[-1]["reason"].startswith("merging costs no capacity")
