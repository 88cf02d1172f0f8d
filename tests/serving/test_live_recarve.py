"""A live re-carve that fails once begun never stays in progress (`serving.live_recarve`), on
8 CPU devices with the tiny model, a pool of its own ([4, 2, 2]); first tokens checked against
the single-device reference as in `test_live_e2e.py`, whose fixtures it uses."""

from __future__ import annotations

import vertumnus_jax.recarve as recarve_kv
from serving import live_recarve
from tests.serving.api_fixtures import wait_until as _wait
from tests.serving.test_live_e2e import _admin, _prompts, _stream, client, reference  # noqa: F401


def test_a_re_carve_failing_after_it_began_never_stays_in_progress(
        client, reference, monkeypatch):  # noqa: F811 (the fixtures imported above)
    # A change in progress holds its workers' devices and every later change, so a failure
    # must end it. Before any KV moved (the move refused, the cold new workers not built: out
    # of memory, say) it is given up and the old worker serves again; once the move retired
    # the old worker it leaves the pool as a lost host's would, the device pool's change
    # dropped, and the other workers serve on (`serving.live_recarve`), never with the old
    # worker back in service on buffers the move donated.
    engine = client.app.state.engine
    backend = engine.backend

    def refuse(worker, meshes, **kwargs):
        raise ValueError("refused for the test")

    def no_memory(mesh):
        raise MemoryError("no memory for the test")

    def no_memory_for_the_cache(*args, **kwargs):  # (after the blocks moved)
        raise MemoryError("no memory for the new caches, for the test")

    monkeypatch.setattr(live_recarve, "split_worker_into", refuse)
    monkeypatch.setattr(backend, "_worker_on", no_memory)
    state = client.get("/v1/workers").json()
    before = [(w["worker_id"], w["cp_degree"]) for w in state["workers"]]
    big = next(wid for wid, c in before if c == 2)
    _admin(client, "/v1/workers/split", {"worker_id": big})
    _wait(lambda: not engine.scheduler.reconfig.in_progress)
    state = client.get("/v1/workers").json()
    assert [(w["worker_id"], w["cp_degree"]) for w in state["workers"]] == before
    assert all(w["status"] == "active" for w in state["workers"]), state["workers"]
    assert backend.pool.pending == () and big in backend.workers
    assert [e for e in backend.errors if "failed: MemoryError: no memory" in e], backend.errors
    for p in _prompts(4, seed=12):
        r = client.post("/v1/completions", json={"prompt": p}).json()
        assert r["choices"][0]["token_ids"] == [reference(p)]

    monkeypatch.undo()  # (the real KV move, failing once the old buffers were donated)
    monkeypatch.setattr(recarve_kv, "build_cache", no_memory_for_the_cache)
    monkeypatch.setattr(backend, "_worker_on", no_memory)
    prompts = _prompts(24, seed=14, lengths=(64,))  # (at once: spread over the workers)
    served = [r.json()["worker_id"] for r in _stream(client, prompts, {})]
    big = max((wid for wid, c in before if c >= 2), key=served.count)
    cached = [p for p, wid in zip(prompts, served) if wid == big]
    assert cached, (served, before)
    old = backend.workers[big]
    old_keys, _ = old.pool.device_buffers()
    pool_before = backend.pool.composition
    _admin(client, "/v1/workers/split", {"worker_id": big})
    _wait(lambda: not engine.scheduler.reconfig.in_progress)
    state = client.get("/v1/workers").json()
    assert [(w["worker_id"], w["cp_degree"]) for w in state["workers"]] == [
        (wid, c) for wid, c in before if wid != big]
    assert backend.pool.pending == () and backend.pool.composition == pool_before
    assert big not in backend.workers and big not in engine.scheduler.workers
    assert [e for e in backend.errors if f"workers [{big}] leave the pool" in e], backend.errors
    assert old.retired is not None and all(k.is_deleted() for k in old_keys)  # (donated)
    monkeypatch.undo()
    for p in cached + _prompts(6, seed=13):
        r = client.post("/v1/completions", json={"prompt": p}).json()
        assert r["choices"][0]["token_ids"] == [reference(p)]
