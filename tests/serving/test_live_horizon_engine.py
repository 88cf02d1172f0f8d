"""The live engine runs the placement cost with live sets (`--live_horizon_s`), the congestion
price, the queue order and prefix fetches (`--prefix_fetch`): the same routers the simulator's
`vertumnus` uses, over the fake backend behind the real app."""

from __future__ import annotations

import pytest

from serving.engine import EngineConfig
from serving.policy.fetch_router import FetchingVertumnusRouter
from serving.policy.live_set import LiveWorkingSet
from serving.policy.queue_order import FCFS, SJF
from tests.serving.api_fixtures import BS, make_client


def test_live_engine_records_each_placement_in_the_live_sets():
    client, engine = make_client(live_horizon_s=300.0)
    with client:
        live = engine._router.live
        assert isinstance(live, LiveWorkingSet) and live.horizon_s == 300.0
        placed = {}
        for k in range(4):
            ids = [(7 * k + j) % 250 + 1 for j in range(3 * BS + 5)]  # 3 full blocks each
            body = client.post("/v1/completions", json={"prompt": ids}).json()
            placed.setdefault(body["worker_id"], []).append(k)
        # every request's 3 full blocks are live on the worker that served it (distinct
        # prompts: no block shared), and nothing was live there before (p = 0 so far)
        for wid, ks in placed.items():
            assert live.size(wid, engine.now()) == 3 * len(ks)
        assert live.reuse_rate == 0.0
        again = client.post("/v1/completions", json={"prompt": ids}).json()  # the last one
        assert live.reuse_rate > 0.0 and again["worker_id"] == body["worker_id"]


def test_live_engine_default_is_the_papers_cost():
    client, engine = make_client()
    with client:
        assert engine._router.live is None


def test_live_engine_prices_congestion_when_asked():
    # The price itself is checked by hand in tests/serving/policy/test_congestion_price.py;
    # here the engine's router is the one the config describes, and it serves.
    client, engine = make_client(congestion_price=True)
    with client:
        assert engine._router.congestion_price
        ids = [(5 * j) % 250 + 1 for j in range(2 * BS + 3)]
        assert client.post("/v1/completions", json={"prompt": ids}).status_code == 200
    client, engine = make_client()
    with client:
        assert not engine._router.congestion_price  # EngineConfig's default: the paper's lambda


def test_live_engine_starts_queued_prefills_in_the_configured_order():
    # The order itself is checked by hand in tests/serving/policy/test_queue_order.py; here
    # the engine's scheduler takes it from the config, and it serves.
    client, engine = make_client(queue_order=SJF)
    with client:
        assert engine._router.queue_order == SJF and engine.scheduler.queue_order == SJF
        ids = [(3 * j) % 250 + 1 for j in range(2 * BS + 1)]
        assert client.post("/v1/completions", json={"prompt": ids}).status_code == 200
    client, engine = make_client()
    with client:
        assert engine.scheduler.queue_order == FCFS  # EngineConfig's default: the paper's order


def test_live_engine_fetches_prefixes_when_asked():
    # The plans are checked by hand in tests/serving/policy/test_fetch_router.py, the hold of
    # a prefill behind its copy in test_kv_handoff.py and test_ray_pool.py; here the engine's
    # router is the fetching one, with the model's KV bytes and the config's knobs.
    client, engine = make_client(prefix_fetch=True, kv_bytes_per_token=4096, queue_order=SJF,
                                 live_horizon_s=300.0)
    with client:
        router = engine._router
        assert isinstance(router, FetchingVertumnusRouter)
        assert (router.kv_bytes_per_token, router.transfer_gb_per_s) == (4096, 100.0)
        assert router.scaleout_gb_per_s == engine.config.scaleout_gb_per_s
        assert router.queue_order == SJF and router.live.horizon_s == 300.0
        ids = [(11 * j) % 250 + 1 for j in range(4 * BS + 1)]  # 4 full blocks
        first = client.post("/v1/completions", json={"prompt": ids}).json()
        holder = engine.scheduler.workers[first["worker_id"]]
        holder.queued_seconds = 1e6  # the holder looks busy: the prefix is fetched elsewhere
        try:
            again = client.post("/v1/completions", json={"prompt": ids}).json()
        finally:
            holder.queued_seconds = 0.0
        assert again["worker_id"] != first["worker_id"]
        assert router.fetches.started == 1
        copies = list(engine.scheduler.copies.log)
        assert [(c["src"], c["dst"], c["blocks"], c["reason"]) for c in copies] == [
            (first["worker_id"], again["worker_id"], 4, "request-transfer")]
    client, engine = make_client()
    with client:
        assert not isinstance(engine._router, FetchingVertumnusRouter)  # EngineConfig's default


def test_prefix_fetch_needs_the_models_kv_bytes():
    with pytest.raises(ValueError, match="kv_bytes_per_token >= 1"):
        make_client(prefix_fetch=True)
    with pytest.raises(ValueError, match="prefix_fetch must be True or False"):
        EngineConfig(prefix_fetch=1)
