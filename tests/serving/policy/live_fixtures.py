"""Helpers shared by the live-set tests: a cost model priced by hand, workers, warm live sets."""

from __future__ import annotations

from serving.policy.cost_model import PrefillCostModel
from serving.policy.profiles import generate_profile
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import WorkerSpec, WorkerState

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
    their matches, and gives `live` the evidence that every live block pushed out was asked
    for again (one block pushed, one lost: white-box, so no other worker's set is touched):
    `victim_reuse_rate` is then 1, which it returns."""
    live.touch(worker_id, blocks, t)
    live.touch(worker_id, blocks, t)
    if not live._pushed:
        live._pushed = live._lost = 1.0
    assert live.victim_reuse_rate == 1.0
    return 1.0


def request(rid, blocks, first=0, t=0.0):
    return Request(rid, t, blocks * 512, 1, chain_block_hashes(range(first, first + blocks)), 512)
