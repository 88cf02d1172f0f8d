"""An engine with the fake backend behind the real HTTP app, for the API, plug-in and load
generator tests (no JAX)."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from serving.api import create_app
from serving.policy.cost_model import PrefillCostModel
from serving.engine import Engine, EngineConfig
from serving.policy.profiles import read_profile_csv
from serving.policy.queue_order import FCFS
from serving.server import DEFAULT_PROFILE
from serving.tokenizer import ByteTokenizer
from serving.policy.worker import layout_workers
from tests.serving.fake_backend import FakeBackend

BS = 16


def make_client(**kwargs):
    """A `TestClient` over `make_app(**kwargs)`, and the engine."""
    app, engine = make_app(**kwargs)
    return TestClient(app), engine


def make_app(*, seconds=0.01, max_in_flight=64, api_key=None, admin_api_key="admin",
             fail_token=None, composition=(4, 2, 2), max_model_len=1024, router=None,
             degrees=(1, 2, 4, 8), controller_policy=None, body_timeout=30.0,
             live_horizon_s=None, congestion_price=False, queue_order=FCFS,
             prefix_fetch=False, kv_bytes_per_token=0):
    """The real HTTP app over an engine whose backend is `FakeBackend` (`seconds` per prefill),
    and the engine."""
    cfg = EngineConfig(block_size=BS, kv_blocks_per_device=64, max_model_len=max_model_len,
                       controller=controller_policy is not None, cache_manager=False,
                       max_in_flight=max_in_flight, tick_seconds=0.05,
                       controller_policy=controller_policy or "paper",
                       live_horizon_s=live_horizon_s, congestion_price=congestion_price,
                       queue_order=queue_order, prefix_fetch=prefix_fetch)
    specs = layout_workers(list(composition), 64, max_model_len)
    cost = PrefillCostModel.fit(read_profile_csv(DEFAULT_PROFILE))

    def make_backend(post, clock):
        return FakeBackend(post, clock, seconds=seconds, fail_token=fail_token,
                           worker_ids=[s.worker_id for s in specs])

    def hash_prompt(tokens):
        from serving.policy.request import chain_block_hashes
        return chain_block_hashes(hash(tuple(tokens[i:i + BS])) for i in range(0, len(tokens), BS))

    engine = Engine(cfg, make_backend, specs, cost, sum(composition), hash_prompt, router=router,
                    degrees=degrees, kv_bytes_per_token=kv_bytes_per_token)
    app = create_app(engine, tokenizer=ByteTokenizer(256), model_name="tiny", vocab_size=256,
                     api_key=api_key, admin_api_key=admin_api_key, body_timeout=body_timeout)
    return app, engine


def wait_until(cond, timeout=120.0):
    """Polls `cond()` every 20 ms until true; AssertionError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")
