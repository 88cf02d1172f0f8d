"""The congestion price of GPU time: lambda + n_min * K / N_gpu (issue 15), with n_min the
requests queued on the least-queued of K candidates and N_gpu their GPUs.

Hand-computed placements with a linear cost model, the price's identity with the paper's cost
when nothing is queued, and the systems and the serving binary that switch it on.
"""

from __future__ import annotations

import numpy as np
import pytest

from serving.policy.cost_router import VertumnusRouter
from serving.policy.fetch_router import FetchingVertumnusRouter
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import WorkerSpec, WorkerState
from tests.serving.policy.live_fixtures import Linear


def worker(wid, c, queued_seconds, queued_requests):
    w = WorkerState(WorkerSpec(wid, c, wid * 8, 10_000, 1_000_000))
    w.queued_seconds = queued_seconds
    w.queue.extend(f"q{wid}-{k}" for k in range(queued_requests))  # (only counted)
    return w


def routers(**kw):
    return [VertumnusRouter(cost_model=Linear, **kw),
            VertumnusRouter(cost_model=Linear, gpu_cost="degree", **kw),
            FetchingVertumnusRouter(0, cost_model=Linear, **kw)]


def test_gpu_price_is_lambda_plus_the_pool_wide_backlog_per_gpu():
    # 3, 5 and 9 requests queued on 8 GPUs: 3 on every one of the 3 workers, 9 / 8 per GPU
    cands = [worker(0, 2, 1.0, 3), worker(1, 4, 0.0, 5), worker(2, 2, 2.0, 9)]
    assert VertumnusRouter(lam=0.5, congestion_price=True).gpu_price(cands) == 0.5 + 9 / 8
    assert VertumnusRouter(lam=0.5).gpu_price(cands) == 0.5  # off: the paper's lambda
    # a worker with nothing queued takes more work without delaying anyone: the paper's lambda
    cands.append(worker(3, 1, 0.3, 0))
    assert VertumnusRouter(lam=0.5, congestion_price=True).gpu_price(cands) == 0.5
    assert VertumnusRouter(lam=0.5, congestion_price=True).gpu_price([]) == 0.5


def test_backlog_keeps_a_request_on_the_worker_holding_its_prefix():
    # A 10-block request; worker 0 (CP-2) holds 8 of its blocks behind a 5 s queue, worker 1
    # (CP-2) holds none behind 0.5 s; 10 requests queued on each. With lambda = 0:
    #   worker 0: 5 + S0,  S0 = (5120 - 4096) ms / 2 + 10 ms = 0.522 s  -> 5.522
    #   worker 1: 0.5 + S1, S1 = 5120 ms / 2 + 10 ms = 2.570 s           -> 3.070
    # so the paper's cost takes the short queue and prefills 8 blocks again. With the
    # congestion price lambda is 10 * 2 / 4 = 5 and worker 1 pays 5 * 2 * (2.570 - 0.522) more:
    #   23.55 s against 5.522 s, so the request stays with its prefix. (G against the cheapest
    # degree, `gpu_cost="degree"`, is 0 with one degree: that reading is not changed.)
    r = Request("r", 0.0, 10 * 512, 1, chain_block_hashes(range(10)), 512)
    cands = [worker(0, 2, 5.0, 10), worker(1, 2, 0.5, 10)]
    for paper, priced in zip(routers(lam=0.0)[::2], routers(lam=0.0, congestion_price=True)[::2]):
        assert paper.costs(r, cands, [8, 0], 0.0) == pytest.approx([5.522, 3.070])
        assert priced.costs(r, cands, [8, 0], 0.0) == pytest.approx(
            [5.522, 3.070 + 5 * 2 * (2.570 - 0.522)])
        assert paper.choose(r, cands, [8, 0], 0.0) == 1
        assert priced.choose(r, cands, [8, 0], 0.0) == 0


def test_while_a_queue_is_empty_the_costs_are_the_papers():
    # Random pools with queued seconds and requests, one worker's queue empty: the same
    # floats, and the same choices, as the paper's fixed lambda.
    rng = np.random.default_rng(5)
    for trial in range(50):
        cands = [worker(i, int(c), float(q), int(k)) for i, (c, q, k) in enumerate(
            zip(rng.choice([1, 2, 4], 6), rng.exponential(0.5, 6), rng.integers(0, 9, 6)))]
        cands[int(rng.integers(6))].queue.clear()
        n = int(rng.integers(2, 20))
        r = Request(f"r{trial}", 0.0, n * 512 + 7, 1, chain_block_hashes(range(n + 1)), 512)
        matched = rng.integers(0, n, 6).tolist()
        for paper, priced in zip(routers(lam=1.5), routers(lam=1.5, congestion_price=True)):
            assert priced.costs(r, cands, matched, 0.0) == paper.costs(r, cands, matched, 0.0)
            assert priced.choose(r, cands, matched, 0.0) == paper.choose(r, cands, matched, 0.0)


def test_the_default_system_prices_congestion_and_the_papers_does_not():
    from eval.experiment import ReplayConfig, ReplayEnv
    cfg = ReplayConfig(num_gpus=8, degrees=(2, 4))
    env = ReplayEnv.build(cfg, 512, {2, 4}, ())
    assert env.build_system("vertumnus", None).router.congestion_price
    assert not env.build_system("vertumnus-paper", None).router.congestion_price
    assert not env.build_system("homogeneous-cp2", None).router.congestion_price


def test_engine_config_and_flag_take_the_congestion_price():
    from serving.engine_config import EngineConfig
    assert not EngineConfig().congestion_price  # EngineConfig's default: the paper's cost
    assert EngineConfig(congestion_price=True).congestion_price


def test_congestion_price_must_be_a_bool():
    from serving.engine_config import EngineConfig
    for bad in ("no", 1, None):
        with pytest.raises(ValueError, match="congestion_price must be True or False"):
            VertumnusRouter(congestion_price=bad)
        with pytest.raises(ValueError, match="congestion_price must be True or False"):
            FetchingVertumnusRouter(0, congestion_price=bad)
        with pytest.raises(ValueError, match="congestion_price must be True or False"):
            EngineConfig(congestion_price=bad)
