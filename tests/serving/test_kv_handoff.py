"""The P/D hand-off end to end on 8 CPU devices: vLLM's proxy request shape with
`do_remote_decode`, the answer's `kv_transfer_params`, and a decode-side pull of the KV
(`GET /v1/kv/{id}`, safetensors) compared with the single-device reference prefill
(`vertumnus_jax.full_prefill`) at CP degrees 1, 2 and 4, behind a cached prefix, under cache
pressure, across a split; release, expiry and preemption free the blocks. And a prefix fetched
for a request lands before its prefill starts.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient

from serving.api_chat import CHATML_TEMPLATE, ChatTemplate, chat_prompt_ids
from serving.engine import EngineConfig
from serving.kv_format import load_kv
from serving.server import ServerConfig, build_app
from serving.tokenizer import ByteTokenizer
from tests.serving.api_fixtures import make_client, wait_until
from tests.serving.degree_router import DegreeRouter
from vertumnus_jax import ModelConfig, full_prefill, init_model
from vertumnus_jax.recarve import check_idle

BS = 16
ADMIN = {"Authorization": "Bearer admin"}
# The body vLLM's disaggregated-prefill proxy sends to the prefill instance
# (examples/online_serving/disaggregated_serving/disagg_proxy_demo.py, toy_proxy_server.py).
PROXY_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def reference():
    model = init_model(ModelConfig.tiny(), seed=0)

    def kv(tokens):
        _, k, v = full_prefill(model, np.asarray(tokens, np.int32))
        return np.asarray(k), np.asarray(v)

    return kv


@pytest.fixture(scope="module")
def server():
    cfg = ServerConfig(composition=(4, 2, 1, 1), degrees=(1, 2, 4), admin_api_key="admin",
                       min_bucket=64, router="tests.serving.degree_router:DegreeRouter",
                       engine=EngineConfig(block_size=BS, kv_blocks_per_device=16,
                                           max_model_len=128, controller=False,
                                           cache_manager=False, tick_seconds=0.05,
                                           kv_hold_seconds=60.0))
    app = build_app(cfg, jax.devices()[:8])
    with TestClient(app) as c:
        yield c, app.state.engine
    DegreeRouter.target = DegreeRouter.worker_id = DegreeRouter.fetch_blocks = None


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def _prefill(client, prompt, degree, rid, hold=True):
    DegreeRouter.target = degree
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": False}
    if hold:
        body["kv_transfer_params"] = PROXY_KV
    r = client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    return r.json()


def _pull(client, hold_id, **params):
    r = client.get(f"/v1/kv/{hold_id}", params=params)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    return load_kv(r.content)


def _assert_kv_equal(got, want):
    k, v, meta = got
    assert k.shape == want[0].shape and v.shape == want[1].shape
    np.testing.assert_allclose(k, want[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(v, want[1], atol=1e-5, rtol=0)
    return meta


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_pulled_kv_equals_reference_prefill(server, reference, degree):
    client, _ = server
    prompt = _prompt(degree, 45)  # 2 full blocks and a partial one of 13 tokens
    body = _prefill(client, prompt, degree, f"pd-{degree}")
    kv = body["kv_transfer_params"]
    assert body["cp_degree"] == degree
    assert kv["remote_request_id"] == f"cmpl-pd-{degree}-0"
    assert (kv["remote_host"], kv["remote_port"], kv["tp_size"]) == ("testserver", 80, 1)
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["num_tokens"] == 45 and len(kv["remote_block_ids"]) == 3
    assert kv["remote_block_ranks"] == [i % degree for i in range(3)]
    assert kv["cp_degree"] == degree and kv["block_size"] == BS
    meta = _assert_kv_equal(_pull(client, kv["remote_request_id"]), reference(prompt))
    assert (meta["num_tokens"], meta["cp_degree"], meta["model"]) == ("45", str(degree), "tiny")
    gone = client.get(f"/v1/kv/{kv['remote_request_id']}")  # the pull ended the hold
    assert gone.status_code == 410 and "pulled" in gone.json()["error"]["message"]


def test_pull_behind_cached_prefix(server, reference):
    client, _ = server
    prefix = _prompt(10, 48)
    _prefill(client, prefix, 2, "prefix", hold=False)  # caches 3 full blocks, holds nothing
    prompt = prefix + _prompt(11, 20)
    body = _prefill(client, prompt, 2, "behind-prefix")
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    hold_id = body["kv_transfer_params"]["remote_request_id"]
    _assert_kv_equal(_pull(client, hold_id, release="false"), reference(prompt))
    _assert_kv_equal(_pull(client, hold_id), reference(prompt))  # kept by release=false


def test_a_prefill_waits_for_the_prefix_fetched_for_it(server):
    """A request placed on one CP-1 worker with a plan to fetch its prefix from the other (as
    a fetching router plans it) runs once the copy has landed: the copy goes first on the
    destination's one-thread executor, so its prefix is a hit (`serving.fetch_wait`)."""
    client, engine = server
    src, dst = sorted(w.worker_id for w in engine.scheduler.workers.values()
                      if w.cp_degree == 1)
    prompt = _prompt(15, 64)  # 4 full blocks, 3 cacheable
    DegreeRouter.worker_id = src
    try:
        assert _prefill(client, prompt, 1, "fetch-src", hold=False)["worker_id"] == src
        copies = len(engine.scheduler.copies.log)
        DegreeRouter.worker_id, DegreeRouter.fetch_blocks = dst, 3
        body = _prefill(client, prompt, 1, "fetch-dst", hold=False)
    finally:
        DegreeRouter.worker_id = DegreeRouter.fetch_blocks = None
    assert body["worker_id"] == dst
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # fetched, then a hit
    log = list(engine.scheduler.copies.log)[copies:]
    assert [(c["src"], c["dst"], c["blocks"], c["reason"]) for c in log] == [
        (src, dst, 3, "request-transfer")]


def test_held_blocks_survive_cache_pressure(server, reference):
    client, engine = server
    prompt = _prompt(20, 40)
    hold_id = _prefill(client, prompt, 1, "pressure")["kv_transfer_params"]["remote_request_id"]
    worker_id = engine.backend.handoff.holds.get(hold_id).worker_id
    first = _prompt(21, 64)
    for i in range(5):  # 5 x 4 new blocks through a 16-block worker: LRU evictions
        body = _prefill(client, first if i == 0 else _prompt(22 + i, 64), 1, f"fill-{i}",
                        hold=False)
        assert body["worker_id"] == worker_id
    again = _prefill(client, first, 1, "fill-again", hold=False)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # it was evicted
    _assert_kv_equal(_pull(client, hold_id), reference(prompt))


def test_release_and_errors(server):
    client, engine = server
    body = _prefill(client, [_prompt(30, 33), _prompt(31, 17)], 2, "batch")
    ids = [c["kv_transfer_params"]["remote_request_id"] for c in body["choices"]]
    assert ids == ["cmpl-batch-0", "cmpl-batch-1"]
    reused = client.post("/v1/completions", headers={"X-Request-Id": "batch"}, json={
        "prompt": _prompt(32, 20), "kv_transfer_params": PROXY_KV})
    assert reused.status_code == 409, reused.text  # "cmpl-batch-0" is still held
    assert 'reason="kv_hold_conflict"} 1.0' in client.get("/metrics").text
    for hold_id in ids:
        r = client.delete(f"/v1/kv/{hold_id}")
        assert r.status_code == 200 and r.json()["released"] is True
        gone = client.get(f"/v1/kv/{hold_id}")
        assert gone.status_code == 410 and "released" in gone.json()["error"]["message"]
    assert client.delete(f"/v1/kv/{ids[0]}").status_code == 410
    assert client.get("/v1/kv/never-sent").status_code == 404
    for rid in ("a/b", "q?x=1", "50%", "frag#1"):  # the id must be a path segment as it is
        bad = client.post("/v1/completions", headers={"X-Request-Id": rid}, json={
            "prompt": "x", "kv_transfer_params": PROXY_KV})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id", rid
    r = client.post("/v1/completions", json={
        "prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    plain = _prefill(client, _prompt(33, 40), 2, "plain", hold=False)["kv_transfer_params"]
    assert "remote_request_id" not in plain and plain["num_tokens"] == 32  # full blocks only
    assert plain["do_remote_prefill"] is False  # nothing held: nothing for a decode side to pull
    assert len(engine.backend.handoff.holds) == 0


def test_expiry_frees_the_blocks(server):
    client, engine = server
    holds = engine.backend.handoff.holds
    holds.hold_seconds = 0.3
    try:
        body = _prefill(client, _prompt(40, 50), 2, "expiring")
    finally:
        holds.hold_seconds = 60.0
    worker = engine.backend.workers[body["worker_id"]]
    with pytest.raises(ValueError, match="live requests"):
        check_idle(worker)  # pinned: a live request, locked blocks, an owned partial block
    wait_until(lambda: len(holds) == 0, timeout=30)
    check_idle(worker)  # nothing pinned, nothing owned outside the cache
    gone = client.get(f"/v1/kv/{body['kv_transfer_params']['remote_request_id']}")
    assert gone.status_code == 410 and "expired" in gone.json()["error"]["message"]
    assert holds.released["expired"] == 1


def test_preemption_releases_the_oldest_hold(server, reference):
    client, engine = server
    assert client.post("/reset_prefix_cache", headers=ADMIN).status_code == 200
    ids = [_prefill(client, _prompt(50 + i, 64), 1, f"full-{i}")["kv_transfer_params"]
           ["remote_request_id"] for i in range(3)]  # 12 of the worker's 16 blocks pinned
    prompt = _prompt(60, 80)  # 5 blocks: only 4 are free
    body = _prefill(client, prompt, 1, "needs-room", hold=False)
    assert body["worker_id"] == engine.backend.handoff.holds.get(ids[1]).worker_id
    gone = client.get(f"/v1/kv/{ids[0]}")
    assert gone.status_code == 410 and "preempted" in gone.json()["error"]["message"]
    _assert_kv_equal(_pull(client, ids[1]), reference(_prompt(51, 64)))
    assert client.delete(f"/v1/kv/{ids[2]}").status_code == 200


def test_a_hold_is_never_preempted_before_its_id_was_answered(server):
    client, engine = server
    assert client.post("/reset_prefix_cache", headers=ADMIN).status_code == 200
    holds = engine.backend.handoff.holds
    before = dict(holds.released)
    DegreeRouter.target = 1
    # 3 x 7 blocks on one 16-block worker: the third prompt cannot fit while the batch's own
    # first two are held, and those ids are not answered yet: the batch fails as a whole
    r = client.post("/v1/completions", headers={"X-Request-Id": "too-big"}, json={
        "prompt": [_prompt(80 + i, 100) for i in range(3)], "kv_transfer_params": PROXY_KV})
    DegreeRouter.target = None
    assert r.status_code == 500 and "OutOfBlocksError" in r.json()["error"]["message"], r.text
    assert len(holds) == 0 and holds.released["preempted"] == before["preempted"]
    assert holds.released["failed"] == before["failed"] + 2  # the two made, freed at failure


def test_hold_survives_a_split(server, reference):
    client, engine = server
    prompt = _prompt(70, 60)
    body = _prefill(client, prompt, 4, "split")
    hold_id = body["kv_transfer_params"]["remote_request_id"]
    r = client.post("/v1/workers/split", headers=ADMIN, json={"worker_id": body["worker_id"]})
    assert r.status_code == 200, r.text
    wait_until(lambda: not engine.scheduler.reconfig.in_progress, timeout=120)
    assert engine.backend.handoff.holds.get(hold_id).worker_id is None  # offloaded to host
    _assert_kv_equal(_pull(client, hold_id), reference(prompt))


def test_fake_backend_refuses_holds():
    client, _ = make_client()
    with client:
        r = client.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": PROXY_KV})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        assert client.get("/v1/kv/x").status_code == 404


def test_kv_format_round_trip_bfloat16():
    import ml_dtypes
    from serving.kv_format import kv_to_safetensors
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 5, 2, 4)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((2, 5, 2, 4)).astype(ml_dtypes.bfloat16)
    k2, v2, meta = load_kv(kv_to_safetensors(k, v, {"request_id": "r"}))
    assert k2.dtype == ml_dtypes.bfloat16 and meta["num_tokens"] == "5"
    np.testing.assert_array_equal(k2.astype(np.float32), k.astype(np.float32))
    np.testing.assert_array_equal(v2.astype(np.float32), v.astype(np.float32))
    with pytest.raises(ValueError, match="safetensors"):
        load_kv(b"not safetensors")


def test_chat_request_holds_its_kv(server, reference):
    client, _ = server
    DegreeRouter.target = 2
    r = client.post("/v1/chat/completions", headers={"X-Request-Id": "chat-pd"}, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "kv_transfer_params": PROXY_KV})
    assert r.status_code == 200, r.text
    body = r.json()
    kv = body["choices"][0]["kv_transfer_params"]
    assert body["id"] == "chatcmpl-chat-pd" and kv["remote_request_id"] == "chatcmpl-chat-pd"
    prompt = chat_prompt_ids(ChatTemplate(CHATML_TEMPLATE), ByteTokenizer(256),
                             [{"role": "user", "content": "hi"}], True)
    k, v, meta = _pull(client, kv["remote_request_id"])
    assert int(meta["num_tokens"]) == body["usage"]["prompt_tokens"] == kv["num_tokens"]
    assert kv["num_tokens"] == len(prompt)
    _assert_kv_equal((k, v, meta), reference(prompt))
