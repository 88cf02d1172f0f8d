"""Behaviour of the Vertumnus placement-cost router (issue: the Vertumnus policies)."""

from __future__ import annotations

import collections
import zlib

import pytest

from serving.policy.cost_model import PrefillCostModel
from serving.policy.cost_router import VertumnusRouter
from serving.policy.profiles import generate_profile
from serving.policy.request import Request, chain_block_hashes, num_blocks
from serving.policy.scheduler import Scheduler
from serving.policy.worker import layout_workers


@pytest.fixture(scope="module")
def cost_model():
    return PrefillCostModel.fit(generate_profile("h20", "qwen3-30b-a3b", degrees=(1, 2, 4, 8)))


class NullBackend:
    def start_prefill(self, worker_id, request, now):
        pass


def req(rid, length, prefix_ids=(), t=0.0):
    n = num_blocks(length, 512)
    ids = list(prefix_ids)[:n] + [zlib.crc32(f"{rid}/{k}".encode()) for k in range(n - len(prefix_ids))]
    return Request(rid, t, length, 1, chain_block_hashes(ids[:n]), 512)


def scheduler(degrees, cost_model, router=None):
    return Scheduler(layout_workers(degrees, 10_000, 1_000_000), cost_model,
                     router or VertumnusRouter(), NullBackend())


def test_burst_sharing_one_long_prefix_spreads_over_idle_workers(cost_model):
    s = scheduler([2] * 8, cost_model)
    prefix = list(range(40))  # a shared 20K-token prefix
    placed = collections.Counter(s.submit(req(i, 20_480 + 300, prefix), 0.0) for i in range(300))
    # Reservations are immediate, so the burst spreads; and since every placement promises the
    # prefix to its worker (FIFO: cached when the next one starts), followers pile on a worker
    # until its queue outweighs a cold 20K-token prefill plus its GPU-time cost, not beyond.
    assert len(placed) >= 5
    assert max(placed.values()) <= 0.25 * 300
    t_cold = cost_model.predict(2, 20_780, 0)
    t_hit = cost_model.predict(2, 20_780, 20_480)
    used = [s.workers[w].outstanding_seconds(0.0) for w in placed]
    bound = t_cold + 2 * (t_cold - t_hit) + t_hit  # one cold prefill + lambda*G + one hit
    assert max(used) - min(used) <= bound + 1e-9


def test_short_request_avoids_large_degree_long_cold_request_takes_it(cost_model):
    s = scheduler([4, 2, 1, 1], cost_model)
    short = s.submit(req("short", 300), 0.0)
    assert s.workers[short].cp_degree == 1
    s2 = scheduler([4, 2, 1, 1], cost_model)
    long = s2.submit(req("long", 40_000), 0.0)
    assert s2.workers[long].cp_degree == 4


def test_prefix_holder_preferred_when_load_is_equal(cost_model):
    s = scheduler([2, 2, 2, 2], cost_model)
    r = req("a", 16_384, range(32))
    s.prefix_index.insert(2, r.block_hashes[:31])
    assert s.submit(r, 0.0) == 2


def test_costs_match_formula_by_hand(cost_model):
    router = VertumnusRouter(beta=2.0, lam=0.5, cost_model=cost_model)
    s = scheduler([4, 2, 2], cost_model, router)
    r = req("x", 8192)
    s.workers[1].queued_seconds = 0.7  # the CP-2 worker at devices 4-5 has 0.7 s reserved
    candidates = list(s.workers.values())
    costs = router.costs(r, candidates, [0, 3, 0], now=0.0)
    t4, t2h, t2 = (cost_model.predict(4, 8192, 0), cost_model.predict(2, 8192, 1536),
                   cost_model.predict(2, 8192, 0))
    cheapest = min(4 * t4, 2 * t2h, 2 * t2)
    assert costs == pytest.approx([2 * t4 + 0.5 * (4 * t4 - cheapest),
                                   0.7 + 2 * t2h + 0.5 * (2 * t2h - cheapest),
                                   2 * t2 + 0.5 * (2 * t2 - cheapest)])


def test_degree_cost_by_hand_and_choose_agrees_with_costs(cost_model):
    # gpu_cost="degree": G against the cheapest degree at each worker's own match.
    router = VertumnusRouter(beta=2.0, lam=0.5, cost_model=cost_model, gpu_cost="degree")
    s = scheduler([4, 2, 2], cost_model, router)
    r = req("x", 8192)
    s.workers[1].queued_seconds = 0.7
    candidates = list(s.workers.values())
    costs = router.costs(r, candidates, [0, 3, 0], now=0.0)
    t = {(c, h): cost_model.predict(c, 8192, h) for c in (2, 4) for h in (0, 1536)}
    floor = {h: min(c * t[(c, h)] for c in (2, 4)) for h in (0, 1536)}
    assert costs == pytest.approx([2 * t[(4, 0)] + 0.5 * (4 * t[(4, 0)] - floor[0]),
                                   0.7 + 2 * t[(2, 1536)] + 0.5 * (2 * t[(2, 1536)] - floor[1536]),
                                   2 * t[(2, 0)] + 0.5 * (2 * t[(2, 0)] - floor[0])])
    assert router.choose(r, candidates, [0, 3, 0], 0.0) == costs.index(min(costs))
    # one degree: G = 0, the cost is Q + beta S whatever the caches hold
    one = VertumnusRouter(beta=1.0, lam=1.0, cost_model=cost_model, gpu_cost="degree")
    s2 = scheduler([2, 2], cost_model, one)
    costs = one.costs(r, list(s2.workers.values()), [4, 0], 0.0)
    assert costs == pytest.approx([cost_model.predict(2, 8192, 2048), t[(2, 0)]])
    with pytest.raises(ValueError, match="gpu_cost"):
        VertumnusRouter(gpu_cost="cache")


def test_rejects_negative_weights():
    with pytest.raises(ValueError, match="beta"):
        VertumnusRouter(beta=-1)
    with pytest.raises(ValueError, match="lam"):
        VertumnusRouter(lam=-0.1)
