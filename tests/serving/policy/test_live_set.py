"""The live working sets (issue 15): the window, the overflow a placement causes, the reuse and
victim rates, the eviction cost they give, and the bookkeeping against a naive reference.

How the routers and the controller use them: test_live_price.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from serving.policy.cost_router import VertumnusRouter
from serving.policy.live_set import NO_EVIDENCE, REUSE_DECAY, LiveWorkingSet
from serving.policy.request import chain_block_hashes
from tests.serving.policy.live_fixtures import Linear, request, warm, worker


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


def test_victim_reuse_rate_by_hand():
    live = LiveWorkingSet(60.0)
    a, b = list(range(1, 9)), list(range(11, 19))
    live.touch(0, a, 0.0, 0, 0, 10)  # 8 blocks on 10: nothing pushed out
    assert live.victim_reuse_rate == 0.0  # nothing pushed out yet: `reuse_rate`, 0 here
    live.touch(0, b, 1.0, 0, 0, 10)  # min(8, 8 + 8 - 10) = 6 pushed out, nothing lost
    assert live.victim_reuse_rate == 0.0 and live._pushed == 6
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


def test_victim_reuse_rate_before_any_push_is_the_reuse_rate():
    # Until a placement is predicted to push a live block out there is no evidence of what
    # pushed-out context does; the rate is then the share of placed blocks already live where
    # they are placed (`reuse_rate`), 0 before any placement. By hand: one placement of 4 new
    # blocks (share 0), then the same 4 again (share 1): (0 * d + 1) / (1 * d + 1).
    live = LiveWorkingSet(60.0)
    assert live.victim_reuse_rate == 0.0
    a = [1, 2, 3, 4]
    live.touch(0, a, 0.0, 0, 0, 10)
    assert live.victim_reuse_rate == 0.0
    live.touch(0, a, 1.0, 4, 4, 10)
    assert live.victim_reuse_rate == pytest.approx(1 / (REUSE_DECAY + 1)) == live.reuse_rate
    live.touch(0, list(range(10, 18)), 2.0, 0, 0, 10)  # 4 + 8 - 10 = 2 pushed out, none lost
    assert live.victim_reuse_rate == 0.0


def test_blocks_lost_with_none_pushed_out_leave_the_rate_at_the_reuse_rate():
    # 8 blocks live on worker 0 (100-block cache, nothing pushed out) are asked for again by a
    # request whose candidates hold none of them (worker 0 was no candidate): lost, but no
    # placement's push lost them, and p stays the reuse rate (0: neither placement reused).
    live = LiveWorkingSet(60.0)
    a = list(range(1, 9))
    live.touch(0, a, 0.0, 0, 0, 100)
    live.touch(1, a, 1.0, 0, 0, 100)
    assert live._pushed == 0.0 and live._lost == 8.0
    assert live.victim_reuse_rate == live.reuse_rate == 0.0
    live.touch(1, a, 2.0, 8, 8, 100)  # reused where placed: share 1 -> 1 / (1 + d + d^2)
    assert live.victim_reuse_rate == live.reuse_rate == pytest.approx(
        1 / (1 + REUSE_DECAY + REUSE_DECAY ** 2))


def test_victim_evidence_decayed_below_the_floor_is_dropped():
    # One push of one block, then k push-free placements, leave d ** k in the sum: from
    # k = 230,144 on (d ** k < 1e-100) it is no evidence and the rate is the reuse rate again.
    k = math.ceil(math.log(NO_EVIDENCE) / math.log(REUSE_DECAY))
    assert k == 230_144 and REUSE_DECAY ** k < NO_EVIDENCE <= REUSE_DECAY ** (k - 1)
    live = LiveWorkingSet(60.0)
    live.touch(0, [1, 2], 0.0, 0, 0, 100)  # (share 0; nothing pushed out or lost)
    # the sums k - 2 push-free placements after one push (half its blocks lost since)
    live._pushed, live._lost = REUSE_DECAY ** (k - 2), 0.5 * REUSE_DECAY ** (k - 2)
    live.touch(0, [3, 4], 1.0, 0, 0, 100)  # the (k-1)-th: d ** (k-1) >= 1e-100, kept
    assert live.victim_reuse_rate == pytest.approx(0.5, rel=1e-12)
    live.touch(0, [1, 2], 2.0, 2, 2, 100)  # the k-th (blocks reused: share 1): dropped
    assert live._pushed == live._lost == 0.0
    assert live.victim_reuse_rate == live.reuse_rate == pytest.approx(
        1 / (1 + REUSE_DECAY + REUSE_DECAY ** 2))


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


def test_total_counts_a_context_moved_to_a_successor_once():
    live = LiveWorkingSet(60.0)
    live.touch(0, [1, 2, 3, 4], 0.0)  # worker 0 is split into 5 and 6; its session moves to 5
    live.touch(5, [1, 2, 3, 4, 5], 10.0)
    live.touch(6, [9], 10.0)
    assert live.total(10.0, [5, 6]) == 5 + 1  # blocks 1-4 of worker 0 are worker 5's now
    assert live.total(10.0) == 4 + 5 + 1  # every worker, summed
    live.touch(0, [7], 11.0)  # (a late placement on the old worker: counted as its own)
    assert live.total(11.0, [5, 6]) == 5 + 1 + 1


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
            if self.lost < NO_EVIDENCE and self.pushed < NO_EVIDENCE:
                self.lost = self.pushed = 0.0
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
