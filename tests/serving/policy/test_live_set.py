"""The live working sets and the cost of evicting live context (issue 15: the agent sessions).

Hand-computed cases: the live set's window, the overflow a placement causes, the eviction cost
added to the placement cost (both G readings and the fetching router), and the controller's
refusal to split when the pool's live working set exceeds its KV capacity.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.sim.simulator import SimConfig, simulate
from serving.policy.composition import CompositionConfig, CompositionController
from serving.policy.cost_model import PrefillCostModel
from serving.policy.cost_router import VertumnusRouter
from serving.policy.fetch_router import FetchingVertumnusRouter
from serving.policy.live_set import REUSE_DECAY, LiveWorkingSet
from serving.policy.profiles import generate_profile
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import WorkerSpec, WorkerState, layout_workers

COST = PrefillCostModel.fit(generate_profile("h20", "qwen3-30b-a3b", (1, 2, 4, 8)))


class Linear:
    """A cost model simple enough to price by hand: 1 ms per uncached token over C, + 10 ms."""

    @staticmethod
    def predict(c, n, h):
        return (n - h) * 1e-3 / c + 0.01


def worker(wid, c, capacity, queued=0.0):
    w = WorkerState(WorkerSpec(wid, c, wid * 8, capacity, 1_000_000))
    w.queued_seconds = queued
    return w


def warm(live, worker_id, blocks, t=0.0):
    """Places `blocks` on the worker twice (the second time all are reused there), without
    their matches: `victim_reuse_rate` stays 1 (no placement predicted to push any out), which
    it returns."""
    live.touch(worker_id, blocks, t)
    live.touch(worker_id, blocks, t)
    assert live.victim_reuse_rate == 1.0
    return 1.0


def request(rid, blocks, first=0, t=0.0):
    return Request(rid, t, blocks * 512, 1, chain_block_hashes(range(first, first + blocks)), 512)


def test_live_set_counts_distinct_blocks_and_forgets_them_after_the_horizon():
    live = LiveWorkingSet(10.0)
    # (hash chains, as `Request.block_hashes`: the second prompt shares the first's first two
    # blocks, then differs)
    live.touch(0, [1, 2, 3], 0.0)
    live.touch(0, [1, 2, 4], 5.0)
    live.touch(1, [9], 5.0)
    assert live.size(0, 5.0) == 4 and live.size(1, 5.0) == 1 and live.size(7, 5.0) == 0
    assert live.size(0, 10.0) == 4  # placed at 0, live up to and including t = 10
    assert live.size(0, 10.5) == 3  # block 3 left; 1 and 2 were placed again at 5
    assert live.size(0, 15.5) == 0
    live.forget(1)
    assert live.size(1, 5.0) == 0


@pytest.mark.parametrize("horizon", [0.0, -1.0, math.inf, math.nan])
def test_horizon_must_be_finite_and_positive(horizon):
    with pytest.raises(ValueError, match="horizon_s must be finite and > 0"):
        LiveWorkingSet(horizon)
    with pytest.raises(ValueError, match="horizon_s"):
        VertumnusRouter(live_horizon_s=horizon)


def test_rate_chooses_the_p_of_the_eviction_cost():
    with pytest.raises(ValueError, match="rate must be 'victims' or 'reuse'"):
        LiveWorkingSet(60.0, rate="share")
    with pytest.raises(AttributeError):
        LiveWorkingSet(60.0).rate = "reuse"  # fixed at construction
    cands, r = [worker(0, 2, 20)], request("r", 8)
    e = {}
    for rate in ("victims", "reuse"):
        live = LiveWorkingSet(60.0, rate=rate)
        live.touch(0, list(range(1000, 1016)), 0.0, 0, 0, 20)
        live.touch(0, list(range(1000, 1016)), 0.5, 16, 16, 20)  # reused: share 1, nothing lost
        live.touch(0, list(range(2000, 2004)), 0.6, 0, 0, 20)  # 0 pushed out
        live.touch(0, list(range(3000, 3008)), 0.7, 0, 0, 20)  # 8 pushed out, none lost
        assert live.victim_reuse_rate == 0.0
        assert live.reuse_rate == pytest.approx(REUSE_DECAY ** 2 / (
            REUSE_DECAY ** 3 + REUSE_DECAY ** 2 + REUSE_DECAY + 1))
        e[rate] = live.eviction_costs(r, cands, [0], 1.0, Linear.predict, 1.0, 1.0)
    assert e["victims"] is None  # every block pushed out so far was dead: every E_w is 0
    over = 8  # 28 live + 8 new on 20: at most the 8 it writes
    assert e["reuse"] == pytest.approx([live.reuse_rate * 3 * Linear.predict(2, over * 512, 0)])


def test_overflow_blocks_by_hand():
    live = LiveWorkingSet(60.0)
    live.touch(0, list(range(8)), 0.0)  # 8 live blocks on a worker of 10
    w = worker(0, 2, 10)
    assert live.overflow_blocks(w, 5, 1.0) == 3  # 8 + 5 - 10
    assert live.overflow_blocks(w, 2, 1.0) == 0  # fits exactly
    assert live.overflow_blocks(w, 0, 1.0) == 0
    live.touch(0, list(range(100, 104)), 0.0)  # 12 live: more than the cache holds
    assert live.overflow_blocks(w, 5, 1.0) == 5  # at most what it writes
    assert live.overflow_blocks(worker(3, 2, 10), 9, 1.0) == 0  # never placed on
    assert live.overflow_blocks(w, 5, 61.0) == 0  # the live set has expired


def test_reuse_rate_by_hand():
    live = LiveWorkingSet(60.0)
    assert live.reuse_rate == 1.0  # nothing placed yet: every live block counts
    live.touch(0, [1, 2, 3, 4], 0.0)
    assert live.reuse_rate == 0.0
    live.touch(0, [1, 2, 5, 6], 1.0)  # 1 and 2 were live on worker 0: a share of 1/2
    assert live.reuse_rate == pytest.approx(0.5 / (0.999 + 1))
    live.touch(1, [1], 2.0)  # live on worker 0, not on worker 1: not a reuse there
    assert live.reuse_rate == pytest.approx(0.5 * 0.999 / (0.999 ** 2 + 0.999 + 1))
    live.touch(0, list(range(100, 8100)), 3.0)  # one huge cold placement counts once
    assert live.reuse_rate == pytest.approx(0.5 * 0.999 ** 2 / (0.999 ** 3 + 0.999 ** 2
                                                                  + 0.999 + 1))


def test_eviction_costs_by_hand_and_none_when_every_live_set_fits():
    live = LiveWorkingSet(60.0)
    p = warm(live, 0, list(range(1000, 1016)))  # worker 0: 16 live of 20
    cands = [worker(0, 2, 20), worker(1, 4, 40)]
    r = request("r", 8)  # 8 blocks, none cached anywhere
    beta, lam = 1.5, 0.5
    out = live.eviction_costs(r, cands, [0, 0], 1.0, Linear.predict, beta, lam)
    over = 16 + 8 - 20  # 4 live blocks pushed out of worker 0
    assert out == pytest.approx([p * (beta + lam * 2) * Linear.predict(2, over * 512, 0), 0.0])
    # with 6 of its blocks cached on worker 0 it writes 2 there: 18 <= 20, nothing evicted
    assert live.eviction_costs(r, cands, [6, 0], 1.0, Linear.predict, beta, lam) is None
    # blocks placed once and never asked for again (one-off prompts): the second placement
    # pushes out min(16, 16 + 16 - 20) = 12 live blocks, none is lost and asked for again, so
    # p = 0 and evicting them costs nothing
    once = LiveWorkingSet(60.0)
    once.touch(0, list(range(1000, 1016)), 0.0, 0, 0, 20)
    once.touch(0, list(range(2000, 2016)), 0.5, 0, 0, 20)
    assert once.victim_reuse_rate == 0.0
    assert once.eviction_costs(r, cands, [0, 0], 1.0, Linear.predict, beta, lam) is None


def test_touch_refuses_a_pool_match_below_the_workers_and_no_capacity():
    live = LiveWorkingSet(60.0)
    with pytest.raises(ValueError, match="pool_matched_blocks >= matched_blocks"):
        live.touch(0, [1, 2, 3], 0.0, 2, 1, 10)
    with pytest.raises(ValueError, match="capacity_blocks >= 1"):
        live.touch(0, [1, 2, 3], 0.0, 0, 0)
    assert live.size(0, 0.0) == 0  # nothing recorded


@pytest.mark.parametrize("input_len", [4 * 512, 4 * 512 + 100])
def test_a_prompt_placed_again_where_it_is_cached_loses_nothing(input_len):
    # The same prompt, 30 times, on workers that never evict: its blocks are live and cached,
    # so nothing is lost, also when its length is a multiple of the block size (the scheduler
    # never matches that prompt's last full block, which must not count as lost).
    router = VertumnusRouter(cost_model=Linear, live_horizon_s=60.0)
    cands = [worker(0, 2, 1000), worker(1, 2, 1000)]
    hashes = chain_block_hashes(range(-(-input_len // 512)))
    for i in range(30):
        r = Request(f"r{i}", i * 0.1, input_len, 1, hashes, 512)
        cap = (input_len - 1) // 512  # `max_cacheable_blocks`: the matches stop there
        router.choose(r, cands, [cap if i else 0] * 2, i * 0.1)
    assert router.live._lost == 0.0


def test_victim_reuse_rate_by_hand():
    live = LiveWorkingSet(60.0)
    a, b = list(range(1, 9)), list(range(11, 19))
    live.touch(0, a, 0.0, 0, 0, 10)  # 8 blocks on 10: nothing pushed out
    assert live.victim_reuse_rate == 1.0  # nothing predicted pushed out yet
    live.touch(0, b, 1.0, 0, 0, 10)  # min(8, 8 + 8 - 10) = 6 pushed out, nothing lost
    assert live.victim_reuse_rate == 0.0
    # a comes back on worker 1; its first 5 blocks are still cached on some candidate, the
    # other 3 are live (placed 2 s ago) but cached nowhere: lost. Worker 1 pushes nothing out.
    live.touch(1, a, 2.0, 0, 5, 10)
    assert live.victim_reuse_rate == pytest.approx(3 / (6 * REUSE_DECAY))
    live.touch(1, b, 3.0, 0, 0, 10)  # all 8 of b lost; worker 1 pushes out 6 of a's
    assert live.victim_reuse_rate == pytest.approx(
        (3 * REUSE_DECAY + 8) / (6 * REUSE_DECAY ** 2 + 6))
    live.touch(2, list(range(100, 140)), 4.0, 0, 0, 10)  # 30 over: lost stays, capped at 1
    assert 0.0 < live.victim_reuse_rate < 1.0
    live.touch(0, a, 70.0, 0, 0, 10)  # past the horizon a is not live anywhere: not lost
    assert live._lost == pytest.approx((3 * REUSE_DECAY + 8) * REUSE_DECAY ** 2)
    live.touch(3, a, 71.0, 0, 8, 10, request_id="x")  # a is cached on a candidate: not lost
    rate = live.victim_reuse_rate
    live.touch(4, a, 72.0, 0, 0, 10, request_id="x")  # x re-routed: its own blocks not lost
    assert live.victim_reuse_rate == rate
    live.touch(5, a, 73.0, 0, 0, 10, request_id="y")  # another request: all 8 of a lost
    assert live.victim_reuse_rate > rate


def test_add_eviction_costs_adds_in_place_what_eviction_costs_returns():
    live = LiveWorkingSet(60.0)
    warm(live, 0, list(range(1000, 1016)))
    warm(live, 2, list(range(2000, 2030)))  # worker 2: 30 live of 32
    cands = [worker(0, 2, 20), worker(1, 4, 40), worker(2, 4, 32)]
    r = request("r", 8)
    rng = np.random.default_rng(0)
    base = list(rng.uniform(0.1, 2.0, size=3))
    e = live.eviction_costs(r, cands, [0, 0, 3], 1.0, Linear.predict, 1.0, 2.0)
    assert e[0] > 0 and e[1] == 0.0 and e[2] > 0  # worker 2: min(5, 30 + 5 - 32) = 3 evicted
    costs = list(base)
    assert live.add_eviction_costs(costs, r, cands, [0, 0, 3], 1.0, Linear.predict, 1.0, 2.0)
    assert costs == [b + x for b, x in zip(base, e)]  # the same floats, added in place
    costs = list(base)  # nothing evicted anywhere: the costs are left as they were
    assert not live.add_eviction_costs(costs, r, cands, [8, 8, 8], 1.0, Linear.predict, 1.0,
                                       2.0)
    assert costs == base


def test_reuse_share_counts_a_repeated_hash_once():
    live = LiveWorkingSet(60.0)
    live.touch(0, [1, 2], 0.0)
    live.touch(0, [1, 1, 3, 4], 1.0)  # distinct blocks live before: {1}; share 1/4
    assert live.reuse_rate == pytest.approx(0.25 / (0.999 + 1))
    assert live.size(0, 1.0) == 4


@pytest.mark.parametrize("gpu_cost", ["worker", "degree"])
def test_router_moves_a_cold_request_off_a_worker_whose_live_context_it_would_evict(gpu_cost):
    # Worker 0 is idle but 16 of its 20 blocks are live (p = 1: nothing pushed out yet); worker
    # 1 has 0.2 s queued and nothing live. An 8-block cold request evicts 4 live blocks on
    # worker 0: E_0 = p (1 + 1 * 2) T(2, 2048, 0) = 3 * 1.034 s, more than worker 1's queue, so
    # it goes to worker 1. Without the live term it goes to the idle worker 0 (the contrast shows
    # the check can fail).
    cands = [worker(0, 2, 20), worker(1, 2, 20, queued=0.2)]
    r = request("r", 8)
    paper = VertumnusRouter(cost_model=Linear, gpu_cost=gpu_cost)
    assert paper.choose(r, cands, [0, 0], 1.0) == 0
    router = VertumnusRouter(cost_model=Linear, gpu_cost=gpu_cost, live_horizon_s=60.0)
    e0 = warm(router.live, 0, list(range(1000, 1016))) * 3 * Linear.predict(2, 4 * 512, 0)
    with_live = router.costs(r, cands, [0, 0], 1.0)
    assert with_live == pytest.approx([a + b for a, b in
                                       zip(paper.costs(r, cands, [0, 0], 1.0), [e0, 0.0])])
    assert router.choose(r, cands, [0, 0], 1.0) == 1
    assert router.live.size(1, 1.0) == 8  # the placement is recorded where it went
    # after the horizon worker 0's context is no longer live: the idle worker wins again
    assert router.choose(request("s", 8, first=50, t=70.0), cands, [0, 0], 70.0) == 0


def test_fetching_router_adds_the_same_eviction_cost():
    cands = [worker(0, 2, 20), worker(1, 2, 20, queued=0.2)]
    r = request("r", 8)
    plain = FetchingVertumnusRouter(0, cost_model=Linear)
    router = FetchingVertumnusRouter(0, cost_model=Linear, live_horizon_s=60.0)
    e0 = warm(router.live, 0, list(range(1000, 1016))) * 3 * Linear.predict(2, 4 * 512, 0)
    assert router.costs(r, cands, [0, 0], 1.0) == pytest.approx(
        [plain.costs(r, cands, [0, 0], 1.0)[0] + e0, plain.costs(r, cands, [0, 0], 1.0)[1]])
    assert plain.choose(r, cands, [0, 0], 1.0) == 0
    assert router.choose(r, cands, [0, 0], 1.0) == 1


def overloaded_sessions(unique_prompts=False):
    """90 req/s on 16 GPUs as [8, 8] (the issue's overload case): each request is an 8-block
    context of one of 200 sessions, taken in turn (each seen again every ~2.2 s), then 1-3K
    tokens of its own; with `unique_prompts` every context is new (nothing is reused)."""
    rng = np.random.default_rng(1)
    times = np.cumsum(rng.exponential(1 / 90.0, 1800)).tolist()
    out = []
    for i, t in enumerate(times):
        own = int(rng.integers(1000, 3000))
        ctx = [10_000_000 + i * 8 + k for k in range(8)] if unique_prompts else \
            [(i % 200) * 8 + k for k in range(8)]
        tail = [1_000_000 + i * 10 + k for k in range(-(-own // 512))]
        out.append(Request(f"r{i}", t, 4096 + own, 1, chain_block_hashes(ctx + tail), 512))
    return out


@pytest.mark.parametrize("kv_blocks_per_device, unique, splits",
                         [(10_000, False, True), (50, False, False), (50, True, True)])
def test_no_split_while_the_reused_live_set_exceeds_the_kv_capacity(kv_blocks_per_device,
                                                                   unique, splits):
    # With room for every context the controller splits at its first evaluation (the pool is
    # overloaded). With 50 blocks per GPU (800 in all) the 200 sessions' 1,600 reused context
    # blocks alone exceed the caches: p * live / capacity >= 1, the caches bind and no split is
    # made. The same small caches with nothing reused (p = 0) do not veto a split.
    cfg = CompositionConfig(interval_s=5.0, cooldown_s=5.0, min_degree=1, max_degree=8)
    ctl = CompositionController(cfg, lambda c: 100_000)
    specs = layout_workers([8, 8], kv_blocks_per_device, 100_000)
    router = VertumnusRouter(live_horizon_s=60.0)
    simulate(overloaded_sessions(unique), specs, COST, router, COST.predict,
             SimConfig(kv_transfer_gb_per_s=0.0, first_token_seconds=0.0, tick_interval=1.0),
             setup=[ctl.attach])
    made = [d for d in ctl.decisions if d.get("kind") == "split"]
    ratios = [dict(d["candidates"]).get("reused live working set / KV capacity")
              for d in ctl.decisions]
    assert all(r is not None for r in ratios)
    if splits:
        assert made and ctl.decisions[0].get("kind") == "split", ctl.decisions[0]
        assert ratios[0] < 1.0
    else:
        assert not made, made[0]
        assert ratios[-1] >= 1.0
    if unique:
        assert router.live.reuse_rate == 0.0
        assert router.live.victim_reuse_rate == 0.0


@pytest.mark.parametrize("kv_blocks_per_device, unique, rate",
                         [(100, False, "high"), (1000, False, 1.0), (100, True, 0.0)])
def test_victim_reuse_rate_of_sessions_and_of_one_off_prompts(kv_blocks_per_device, unique,
                                                              rate):
    # 40 sessions of an 8-block context, each asked again every ~20 s (within the 60 s
    # horizon), on two workers of 100 blocks: 320 context blocks for 200 cached, so contexts
    # pushed out come back (most of them: the rate is high). With 1,000 blocks nothing is
    # pushed out (1). With a new context every time nothing comes back (0).
    rng = np.random.default_rng(3)
    times = np.cumsum(rng.exponential(0.5, 400)).tolist()
    reqs = [Request(f"r{i}", t, 8 * 512 + 100, 1, chain_block_hashes(
        ([10_000_000 + i * 8 + k for k in range(8)] if unique else
         [(i % 40) * 8 + k for k in range(8)]) + [1_000_000 + i]), 512)
        for i, t in enumerate(times)]
    router = VertumnusRouter(live_horizon_s=60.0)
    simulate(reqs, layout_workers([1, 1], kv_blocks_per_device, 100_000), COST, router,
             COST.predict, SimConfig(kv_transfer_gb_per_s=0.0, first_token_seconds=0.0,
                                     tick_interval=1.0))
    if rate == "high":
        assert 0.5 < router.live.victim_reuse_rate <= 1.0
    else:
        assert router.live.victim_reuse_rate == rate


def test_total_counts_a_context_moved_to_a_successor_once():
    live = LiveWorkingSet(60.0)
    live.touch(0, [1, 2, 3, 4], 0.0)  # worker 0 is split into 5 and 6; its session moves to 5
    live.touch(5, [1, 2, 3, 4, 5], 10.0)
    live.touch(6, [9], 10.0)
    assert live.total(10.0, [5, 6]) == 5 + 1  # blocks 1-4 of worker 0 are worker 5's now
    assert live.total(10.0) == 4 + 5 + 1  # every worker, summed
    live.touch(0, [7], 11.0)  # (a late placement on the old worker: counted as its own)
    assert live.total(11.0, [5, 6]) == 5 + 1 + 1


def test_engine_config_takes_a_horizon_or_none():
    from serving.engine_config import EngineConfig
    assert EngineConfig().live_horizon_s is None  # the live default stays the paper's cost
    assert EngineConfig(live_horizon_s=300.0).live_horizon_s == 300.0
    for bad in (0.0, -5.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="live_horizon_s must be None or a finite number > 0"):
            EngineConfig(live_horizon_s=bad)


def test_memory_stays_bounded_by_one_horizon_when_the_same_blocks_recur():
    live = LiveWorkingSet(10.0)
    for k in range(5000):  # the same 4 blocks, placed every 0.1 s for 500 s
        live.touch(0, [1, 2, 3, 4], k * 0.1)
    assert live.size(0, 499.9) == 4
    assert len(live._log) <= 10.0 / 0.1 + 1  # entries older than the horizon are gone


def test_total_counts_workers_that_left_until_their_blocks_expire():
    live = LiveWorkingSet(10.0)
    live.touch(0, [1, 2, 3], 0.0)  # worker 0 is split into 5 and 6 at t = 1
    live.touch(5, [1, 4], 2.0)
    assert live.total(2.0) == 3 + 2
    assert live.total(10.5) == 2 and live.size(0, 10.5) == 0
    assert 0 not in live._last  # forgotten once empty


def test_choose_is_the_first_least_cost_from_the_rotation(cost_model=COST):
    # Random queues, matches and live sets: `choose` returns the first index of least `costs`
    # from the rotation's start, in both G readings and for the fetching router.
    rng = np.random.default_rng(7)
    for gpu_cost in ("worker", "degree", "fetch"):
        router = (FetchingVertumnusRouter(0, cost_model=cost_model, live_horizon_s=60.0)
                  if gpu_cost == "fetch" else
                  VertumnusRouter(cost_model=cost_model, gpu_cost=gpu_cost, live_horizon_s=60.0))
        for trial in range(200):
            cands = [worker(i, int(c), 24 * int(c), float(q)) for i, (c, q) in enumerate(
                zip(rng.choice([1, 2, 4], 6), rng.exponential(0.5, 6)))]
            for w in cands:
                router.live.touch(w.worker_id, list(range(w.worker_id * 100, w.worker_id * 100
                                                          + int(rng.integers(0, 30)))), 0.0)
            r = request(f"r{trial}", int(rng.integers(2, 20)), first=10_000 + trial * 50, t=1.0)
            matched = rng.integers(0, r.input_len // 512, 6).tolist()
            costs = router.costs(r, cands, matched, 1.0)
            start = router._rotation % len(cands)
            order = list(range(start, len(cands))) + list(range(start))
            least = min(costs)
            expected = next(i for i in order if costs[i] == least)
            if gpu_cost == "degree":  # sums in another order there: equal up to rounding
                assert costs[router.choose(r, cands, matched, 1.0)] == pytest.approx(least)
            else:
                assert router.choose(r, cands, matched, 1.0) == expected, (gpu_cost, trial)
            router.live = LiveWorkingSet(60.0)


def test_controller_ignores_a_router_attribute_that_is_not_a_live_set():
    from serving.policy.composition import kv_pressure

    class Sched:
        router = type("R", (), {"live": True})()
    assert kv_pressure(Sched(), [worker(0, 2, 20)], 0.0) is None


class NaiveLiveSets:
    """The reference for `LiveWorkingSet`'s bookkeeping: per worker every block with its last
    placement time, filtered whole at each step, and a lost block looked up on every worker
    (no use of the hash chains' prefix structure)."""

    def __init__(self, horizon_s):
        self.horizon_s, self.last, self.requests = horizon_s, {}, {}
        self.lost = self.pushed = 0.0

    def expire(self, now):
        limit = now - self.horizon_s
        self.last = {w: {h: t for h, t in last.items() if t >= limit}
                     for w, last in self.last.items()}
        self.requests = {r: t for r, t in self.requests.items() if t >= limit}

    def touch(self, w, hashes, now, matched, pool_matched, capacity, rid):
        self.expire(now)
        last = self.last.setdefault(w, {})
        if hashes and rid not in self.requests:
            new = len(hashes) - matched
            over = min(new, len(last) + new - capacity)
            lost = sum(any(h in other for other in self.last.values())
                       for h in hashes[pool_matched:])
            self.lost = self.lost * REUSE_DECAY + lost
            self.pushed = self.pushed * REUSE_DECAY + max(over, 0)
        last.update(dict.fromkeys(hashes, now))
        self.requests[rid] = now


@pytest.mark.parametrize("seed, steps", [(0, 600), (1, 600), (2, 1500)])
def test_live_sets_match_a_naive_reference_on_growing_and_branching_sessions(seed, steps):
    # 30 sessions whose contexts grow by 0-3 blocks a turn, one turn in five a branch (an
    # edit: a prefix of the context, then new blocks), re-sent requests (the same id within
    # the horizon), placements at equal times, pool matches up to 3 blocks past the prompt,
    # on 4 workers, over 20 to 50 horizons (1,500 placements: the forgetting of empty workers
    # every 1,024 runs too): sizes, totals and both rate statistics equal the naive
    # reference's at every step.
    rng = np.random.default_rng(seed)
    live, ref = LiveWorkingSet(10.0), NaiveLiveSets(10.0)
    sessions = [[s * 1_000_000 + k for k in range(int(rng.integers(1, 6)))] for s in range(30)]
    now, fresh, last_rid = 0.0, 10_000_000, None
    for step in range(steps):
        if rng.random() < 0.7:  # else placed at the same time as the one before
            now += float(rng.exponential(0.5))
        ids = sessions[int(rng.integers(len(sessions)))]
        if rng.random() < 0.2:  # a branch keeps a prefix of the context
            del ids[int(rng.integers(0, len(ids) + 1)):]
        for _ in range(int(rng.integers(0, 4))):
            ids.append(fresh)
            fresh += 1
        hashes = chain_block_hashes(ids)
        w = int(rng.choice(4, p=[0.33, 0.33, 0.32, 0.02]))  # worker 3: idle for horizons
        pool_matched = int(rng.integers(0, len(hashes) + 4))
        matched = int(rng.integers(0, min(pool_matched, len(hashes)) + 1))
        rid = last_rid if last_rid is not None and rng.random() < 0.1 else f"r{step}"
        last_rid = rid
        live.touch(w, hashes, now, matched, pool_matched, 12, request_id=rid)
        ref.touch(w, hashes, now, matched, pool_matched, 12, rid)
        assert live._lost == ref.lost and live._pushed == ref.pushed, step
        assert [live.size(v, now) for v in range(4)] == [len(ref.last.get(v, {}))
                                                          for v in range(4)], step
        active = [ref.last.get(v, {}) for v in range(3)]  # worker 3 taken as gone
        assert live.total(now, [0, 1, 2]) == sum(map(len, active)) + len(
            set(ref.last.get(3, {})).difference(*active)), step
    assert 0.0 < live.victim_reuse_rate < 1.0  # both kinds of placement occurred
