"""`RayBackend` holds a request's prefill behind the prefix copy made for it, step by step.

The real `RayBackend` and `Scheduler` over fake host agents whose calls the test answers by
hand (Ray is imported, never started), so the order of events is the test's: a cross-host
copy (export, then import) that the prefill must wait for, a source or destination host lost
mid-copy, and a copy Ray refuses at once. `test_ray_pool.py` checks the same on real agents.
"""

from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("ray")

from serving.policy.replication import FetchOnDispatch  # noqa: E402
from serving.policy.request import Request, chain_block_hashes  # noqa: E402
from serving.policy.scheduler import Scheduler  # noqa: E402
from serving.policy.worker import WorkerSpec  # noqa: E402
from serving.ray_backend import RayBackend  # noqa: E402
from serving.ray_state import HostState  # noqa: E402

BS = 16


class Cost:
    def predict(self, cp_degree, input_len, cached_len):
        return (input_len - cached_len) * 1e-3 / cp_degree


class Ref:
    """An `ObjectRef` stand-in the test resolves by hand."""

    def __init__(self, name, args):
        self.name, self.args, self._future = name, args, concurrent.futures.Future()

    def future(self):
        return self._future


class Agent:
    """A host agent: `agent.method.remote(*args)` records a `Ref`, or raises `refuse[method]`."""

    def __init__(self):
        self.calls, self.refuse = [], {}

    def __getattr__(self, name):
        agent = self

        class Method:
            @staticmethod
            def remote(*args):
                if name in agent.refuse:
                    raise agent.refuse[name]
                agent.calls.append(Ref(name, args))
                return agent.calls[-1]
        return Method

    def pending(self, name):
        return [r for r in self.calls if r.name == name and not r._future.done()]


class Router:
    """Places every request on `worker_id`, planning a fetch of `fetch` blocks."""

    def __init__(self):
        self.worker_id, self.fetch = 0, None

    def bind(self, scheduler):
        self.fetches = FetchOnDispatch()
        self.fetches.attach(scheduler)

    def choose(self, request, candidates, matched_blocks, now):
        i = next(i for i, w in enumerate(candidates) if w.worker_id == self.worker_id)
        if self.fetch:
            self.fetches.plan(request, self.worker_id, self.fetch)
        return i


class Pool:
    """Two hosts of two CP-1 workers each (workers 0, 1 on host 0; 2, 3 on host 1); worker 0
    has prefilled request "r0" and caches its 3 full blocks."""

    def __init__(self):
        self.posted, self.records, self.router = [], [], Router()
        self.hosts = [HostState(h, Agent(), (1, 1), state="alive",
                                info={"pid": 100 + h, "ready": True}) for h in (0, 1)]
        specs = [WorkerSpec(w, 1, w, 1000, 4096, host=w // 2) for w in range(4)]
        self.backend = RayBackend(self.hosts, specs, devices_per_host=2, post=self.posted.append,
                                  clock=lambda: 0.0, kv_blocks_per_device=1000,
                                  max_input_len=lambda c: 4096)
        self.scheduler = Scheduler(specs, Cost(), self.router, self.backend,
                                   listener=self.records.append)
        self.backend.scheduler = self.scheduler
        self.scheduler.submit(self.request("r0"), 0.0)
        self.answer_prefill(self.agent(0).pending("prefill")[0],
                            inserted=self.request("r0").block_hashes[:3])

    def request(self, rid):
        return Request(rid, 0.0, 64, 1, chain_block_hashes(range(4)), BS,
                       token_ids=list(range(64)))

    def agent(self, host):
        return self.hosts[host].agent

    def run(self):
        while self.posted:
            self.posted.pop(0)()

    def resolve(self, ref, value):
        (ref._future.set_exception if isinstance(value, BaseException)
         else ref._future.set_result)(value)
        self.run()

    def answer_prefill(self, ref, cached=0, inserted=()):
        _, request, _ = ref.args
        self.resolve(ref, {"ok": True, "entered": 0, "left": 0, "worker": None,
                           "device_ids": [0], "cp_degree": 1, "block_ids": [],
                           "num_tokens": request.input_len, "cached_len": cached,
                           "inserted": tuple(inserted), "evicted": (), "first_token": 1,
                           "hold_id": None})

    def fetch_to_worker_2(self):
        """Submits "r1" to worker 2 (host 1) with a fetch of its 3 blocks from worker 0."""
        self.router.worker_id, self.router.fetch = 2, 3
        self.scheduler.submit(self.request("r1"), 1.0)
        self.run()


def test_the_prefill_is_sent_once_the_cross_host_copy_has_landed():
    pool = Pool()
    pool.fetch_to_worker_2()
    export, = pool.agent(0).pending("export_prefix")
    imp, = pool.agent(1).pending("import_prefix")
    assert imp.args[3] is export and len(pool.backend.waits) == 1
    assert pool.agent(1).pending("prefill") == []  # held behind the copy
    pool.resolve(export, ("k", "v"))
    assert pool.agent(1).pending("prefill") == []  # the import has not landed yet
    blocks = pool.request("r1").block_hashes[:3]
    pool.resolve(imp, (tuple(blocks), ()))
    assert pool.scheduler.prefix_index.match_blocks(blocks, 3, [2]) == [3]  # seen first
    prefill, = pool.agent(1).pending("prefill")
    assert prefill.args[0] == 2 and prefill.args[1].request_id == "r1"
    pool.answer_prefill(prefill, cached=48)
    assert [(r.request.request_id, r.worker_id, r.cached_len, r.error)
            for r in pool.records] == [("r0", 0, 0, None), ("r1", 2, 48, None)]
    assert (pool.backend.waits.started, len(pool.backend.waits)) == (1, 0)


def test_a_source_lost_mid_copy_lets_the_prefill_start_on_its_local_prefix():
    pool = Pool()
    pool.fetch_to_worker_2()
    imp, = pool.agent(1).pending("import_prefix")
    pool.backend.host_lost(0, "test")
    prefill, = pool.agent(1).pending("prefill")  # started at once, the copy given up
    pool.resolve(imp, ((), ()))  # a late answer of the import: ignored
    pool.answer_prefill(prefill)
    assert pool.records[-1].request.request_id == "r1" and pool.records[-1].error is None
    assert len(pool.agent(1).pending("prefill")) == 0 and len(pool.backend.waits) == 0


def test_a_destination_lost_mid_copy_fails_the_request_once_and_sends_nothing():
    pool = Pool()
    pool.fetch_to_worker_2()
    imp, = pool.agent(1).pending("import_prefix")
    pool.backend.host_lost(1, "test")
    pool.run()
    assert [r.request.request_id for r in pool.records if r.error] == ["r1"]
    assert pool.backend.waits.dropped == 1 and len(pool.backend.waits) == 0
    pool.resolve(imp, ((), ()))
    assert pool.agent(1).pending("prefill") == []


def test_a_copy_ray_refuses_holds_nothing():
    pool = Pool()
    pool.agent(1).refuse["import_prefix"] = ValueError("refused")
    pool.fetch_to_worker_2()
    assert len(pool.backend.waits) == 0 and pool.router.fetches.skipped == 1
    prefill, = pool.agent(1).pending("prefill")  # runs now, on its local prefix
    pool.answer_prefill(prefill)
    assert pool.records[-1].request.request_id == "r1" and pool.records[-1].error is None
