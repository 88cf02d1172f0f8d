"""The HTTP API over an engine with a fake backend (no JAX): status codes, messages, metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.engine import ShuttingDown
from tests.serving.api_fixtures import BS, make_client, wait_until


@pytest.fixture()
def client():
    c, engine = make_client()
    with c:
        yield c


def test_completion_fields(client):
    prompt = "hello world " * 5
    r = client.post("/v1/completions", json={"prompt": prompt, "model": "tiny"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = list(prompt.encode())
    assert body["choices"][0]["token_ids"] == [sum(ids) % 256]
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["worker_id"] in (0, 1, 2) and body["cp_degree"] in (2, 4)
    t = body["timings"]
    assert t["ttft_seconds"] >= t["prefill_seconds"] > 0 and t["queue_seconds"] >= 0
    # repeated prompt: its full blocks except the last token's are cached on that worker
    again = client.post("/v1/completions", json={"prompt": ids}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // BS * BS


def test_batch_prompts(client):
    r = client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4, 5, 6, 7]]})
    assert r.status_code == 200
    body = r.json()
    assert [c["token_ids"][0] for c in body["choices"]] == [6, 22]
    assert body["usage"]["prompt_tokens"] == 7


@pytest.mark.parametrize("payload, status, field", [
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 256]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": [[1], []]}, 400, "prompt[1]"),
    ({"prompt": "x" * 1025}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 2}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "1"}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1.5]}, 400, "prompt"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "top_p": "x"}, 400, "top_p"),
    ({"max_tokens": 1}, 400, "prompt"),
    ({"prompt": "hi", "model": "other"}, 404, "model"),
])
def test_bad_inputs(client, payload, status, field):
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(field.split("[")[0]), err
    assert field.split("[")[0] in err["message"] or field == "model"


def test_unknown_fields_are_ignored_as_vllm_does(client, caplog):
    r = client.post("/v1/completions", json={"prompt": [1, 2], "top_k": 5, "ignore_eos": True,
                                             "min_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [3]
    assert "'ignore_eos', 'min_tokens', 'top_k'" in caplog.text


def test_malformed_json(client):
    r = client.post("/v1/completions", content=b'{"prompt": "a"', headers={
        "content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_models_health_workers(client):
    m = client.get("/v1/models").json()["data"][0]
    assert (m["id"], m["max_model_len"], m["vocab_size"], m["block_size"]) == ("tiny", 1024, 256, BS)
    assert client.get("/health").status_code == 200
    w = client.get("/v1/workers").json()
    assert w["composition"] == [4, 2, 2]
    assert [x["kv_blocks_total"] for x in w["workers"]] == [256, 128, 128]


def test_health_without_a_worker_left():
    # Every worker lost (hosts dead, failed re-carves): no prompt can be served, so the
    # health check says so (503), as a load balancer wants it.
    client, engine = make_client()
    with client:
        ids = sorted(engine.scheduler.workers)
        engine.scheduler.lose_workers(ids[:2], engine.now(), "lost for the test")
        assert client.get("/health").status_code == 200  # (one left)
        engine.scheduler.lose_workers(ids[2:], engine.now(), "lost for the test")
        r = client.get("/health")
        assert r.status_code == 503 and "no worker left" in r.json()["error"]["message"]


def test_metrics_parse_and_count(client):
    cached = 0
    for i in range(3):
        r = client.post("/v1/completions", json={"prompt": [7] * 40})
        assert r.status_code == 200
        cached += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    ttft = fams["vertumnus:time_to_first_token_seconds"]
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count == 3
    queries = fams["vertumnus:prefix_cache_queries"].samples[0].value
    hits = fams["vertumnus:prefix_cache_hits"].samples[0].value
    assert queries == 120
    assert hits == cached and hits >= 32  # a repeat hits (40 - 1) // 16 = 2 blocks
    workers = {s.labels["cp_degree"]: s.value for s in fams["vertumnus:workers"].samples}
    assert workers == {"2": 2, "4": 1}
    assert "vertumnus:num_requests_waiting" in fams and "vertumnus:reconfigurations" in fams
    blocks = {s.labels["worker_id"]: s.value
              for s in fams["vertumnus:worker_kv_cache_usage_blocks"].samples}
    perc = {s.labels["worker_id"]: s.value
            for s in fams["vertumnus:worker_kv_cache_usage_perc"].samples}
    totals = {str(w["worker_id"]): w["kv_blocks_total"] for w in client.get("/v1/workers").json()[
        "workers"]}
    assert perc == {w: blocks[w] / totals[w] for w in blocks} and max(perc.values()) > 0
    assert "process_resident_memory_bytes" in fams or "process_cpu_seconds" in fams
    assert "python_info" in fams


def test_api_key_everywhere():
    c, _ = make_client(api_key="secret")
    with c:
        assert c.get("/health").status_code == 401
        assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 401
        ok = {"Authorization": "Bearer secret"}
        assert c.get("/health", headers=ok).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "a"}, headers=ok).status_code == 200
        assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_admin_disabled_without_key():
    c, _ = make_client(admin_api_key=None)
    with c:
        r = c.post("/v1/workers/split", json={"worker_id": 0})
        assert r.status_code == 403 and "--admin_api_key" in r.json()["error"]["message"]


def test_admin_split_merge():
    c, engine = make_client()
    with c:
        assert c.post("/v1/workers/split", json={"worker_id": 0}).status_code == 401
        bad = {"Authorization": "Bearer nope"}
        assert c.post("/v1/workers/split", json={"worker_id": 0}, headers=bad).status_code == 401
        assert c.post("/v1/workers/split", content=b"x=1", headers=bad).status_code == 401
        admin = {"Authorization": "Bearer admin"}
        r = c.post("/v1/workers/split", json={"worker_id": 99}, headers=admin)
        assert r.status_code == 400 and "99" in r.json()["error"]["message"]
        r = c.post("/v1/workers/merge", json={"worker_ids": [0, 1]}, headers=admin)
        assert r.status_code == 400 and "not buddies" in r.json()["error"]["message"]
        before = {x["worker_id"] for x in c.get("/v1/workers").json()["workers"]}
        r = c.post("/v1/workers/split", json={"worker_id": 0}, headers=admin)
        split = r.json()
        assert r.status_code == 200 and split["status"] == "draining" and split["old"] == [0]
        assert len(split["new"]) == 2 and not set(split["new"]) & before  # fresh ids
        wait_until(lambda: c.get("/v1/workers").json()["composition"] == [2, 2, 2, 2])
        w = c.get("/v1/workers").json()
        assert w["reconfigurations"][0]["kind"] == "split"
        assert w["reconfigurations"][0]["origin"] == "admin"
        assert w["reconfigurations"][0]["epoch"] == split["epoch"]
        ids = [x["worker_id"] for x in w["workers"]]
        assert set(split["new"]) <= set(ids) and 0 not in ids  # the halves named in the answer
        other = next(i for i in ids if i not in split["new"])  # a CP-2 of another group
        r = c.post("/v1/workers/merge", json={"worker_ids": [split["new"][1], other]},
                   headers=admin)
        assert r.status_code == 400 and "not buddies" in r.json()["error"]["message"]
        r = c.post("/v1/workers/merge", json={"worker_ids": split["new"]}, headers=admin)
        assert r.status_code == 200, r.text
        # the refused merge took no id: the merged worker's is the next after the halves'
        assert sorted(r.json()["old"]) == sorted(split["new"])
        assert r.json()["new"] == [max(split["new"]) + 1]
        wait_until(lambda: c.get("/v1/workers").json()["composition"] == [4, 2, 2])


def test_admin_split_into_parts():
    # A CP-4 worker into [1, 1, 2] in one re-carve: one change, three fresh workers on its
    # devices 0, 1 and 2-3; parts halving does not make, or a degree without a profile, are a
    # 400 naming `parts`, and nothing changes.
    c, engine = make_client(degrees=(1, 2, 4))
    with c:
        admin = {"Authorization": "Bearer admin"}
        for bad, why in (([2, 1, 1, 0], "not a split"), ([1, 2, 1], "not a split"),
                         ([2, 2, 2], "not a split"), ([4], None),
                         ([2, 2.5], "parts[1]: Input should be a valid integer")):
            r = c.post("/v1/workers/split", json={"worker_id": 0, "parts": bad}, headers=admin)
            assert r.status_code == 400 and r.json()["error"]["param"] == "parts", (bad, r.text)
            assert why is None or why in r.json()["error"]["message"], r.text
        assert engine.scheduler.composition == [4, 2, 2] and not engine.scheduler.reconfig.log
        r = c.post("/v1/workers/split", json={"worker_id": 0, "parts": [1, 1, 2]}, headers=admin)
        assert r.status_code == 200 and r.json()["old"] == [0] and len(r.json()["new"]) == 3
        wait_until(lambda: c.get("/v1/workers").json()["composition"] == [1, 1, 2, 2, 2])
        w = c.get("/v1/workers").json()
        assert [x["kind"] for x in w["reconfigurations"]] == ["split"]
        new = {x["worker_id"]: (x["first_device"], x["cp_degree"]) for x in w["workers"]
               if x["worker_id"] in r.json()["new"]}
        assert sorted(new.values()) == [(0, 1), (1, 1), (2, 2)], w["workers"]
        assert c.post("/v1/completions", json={"prompt": "ok"}).status_code == 200
    c, engine = make_client(degrees=(2, 4))
    with c:
        r = c.post("/v1/workers/split", json={"worker_id": 0, "parts": [1, 1, 2]},
                   headers={"Authorization": "Bearer admin"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "parts"
        assert "CP degree 1" in r.json()["error"]["message"]
        assert engine.scheduler.composition == [4, 2, 2]


def test_reset_prefix_cache(client):
    ids = [3] * 40
    assert client.post("/v1/completions", json={"prompt": ids}).status_code == 200
    assert client.post("/reset_prefix_cache").status_code == 401
    r = client.post("/reset_prefix_cache", headers={"Authorization": "Bearer admin"})
    assert r.status_code == 200 and r.json()["freed_blocks"] == 2  # 40 tokens: 2 full blocks
    again = client.post("/v1/completions", json={"prompt": ids}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_split_to_a_degree_without_profile_is_refused():
    c, engine = make_client(degrees=(2, 4))
    with c:
        admin = {"Authorization": "Bearer admin"}
        r = c.post("/v1/workers/split", json={"worker_id": 1}, headers=admin)
        assert r.status_code == 400 and "CP degree 1" in r.json()["error"]["message"]
        assert engine.scheduler.composition == [4, 2, 2]
        assert c.post("/v1/completions", json={"prompt": "ok"}).status_code == 200
    c, engine = make_client(degrees=(4,), composition=(4, 4))
    with c:
        r = c.post("/v1/workers/merge", json={"worker_ids": [0, 1]},
                   headers={"Authorization": "Bearer admin"})
        assert r.status_code == 400 and "CP degree 8" in r.json()["error"]["message"]


def test_batch_admitted_whole_or_not_at_all():
    c, engine = make_client(seconds=0.3, max_in_flight=5)
    with c, concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(c.post, "/v1/completions",
                               json={"prompt": [[i, j + 1] for j in range(4)]}) for i in range(6)]
        codes = [f.result().status_code for f in futures]
        r = c.post("/v1/completions", json={"prompt": [[1]] * 6})
    assert sorted(codes)[0] == 200 and set(codes) <= {200, 429}
    # every admitted batch ran whole, no prompt of a refused batch ran
    assert engine.scheduler.num_completed == 4 * codes.count(200)
    assert r.status_code == 400 and "max_in_flight=5" in r.json()["error"]["message"]


def test_odd_text_and_big_bodies():
    c, _ = make_client()
    with c:
        r = c.post("/v1/completions", content=rb'{"prompt": "\ud800"}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = c.post("/v1/completions", content=b"x" * (17 << 20),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = c.post("/v1/completions", json={"prompt": "a", "temperature": "0.5"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_overload_429_with_retry_after():
    c, _ = make_client(seconds=0.3, max_in_flight=2)
    with c, concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(c.post, "/v1/completions", json={"prompt": f"p{i}"})
                   for i in range(8)]
        codes = [f.result() for f in futures]
    statuses = sorted(r.status_code for r in codes)
    assert statuses.count(200) >= 2 and 429 in statuses
    r429 = next(r for r in codes if r.status_code == 429)
    assert int(r429.headers["Retry-After"]) >= 1
    assert "limit 2 (max_in_flight)" in r429.json()["error"]["message"]


def test_failed_prefill_is_500_and_service_goes_on():
    c, _ = make_client(fail_token=255)
    with c:
        r = c.post("/v1/completions", json={"prompt": [1, 255]})
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 200


def test_shutdown_deadline_answers_unfinished_with_503():
    _, engine = make_client(seconds=2.0)

    async def run():
        await engine.start()
        task = asyncio.create_task(engine.prefill([5, 6]))
        await asyncio.sleep(0.05)
        assert not await engine.shutdown(timeout=0.2)
        with pytest.raises(ShuttingDown, match="shutdown timeout"):
            await task

    asyncio.run(run())


def test_request_answered_at_the_deadline_is_not_counted_again_when_it_ends():
    _, engine = make_client(seconds=0.5)
    seen = []

    async def run():
        await engine.start()
        engine.record_hooks.append(seen.append)  # as the metrics' `observe`
        task = asyncio.create_task(engine.prefill([5, 6]))
        await asyncio.sleep(0.05)
        engine.begin_shutdown(timeout=0.05)
        with pytest.raises(ShuttingDown, match="shutdown timeout"):
            await task
        for _ in range(100):  # the prefill itself runs on and completes
            if engine.scheduler.num_completed:
                break
            await asyncio.sleep(0.02)
        await engine.shutdown()

    asyncio.run(run())
    assert engine.scheduler.num_completed == 1 and seen == []


def test_shutdown_finishes_in_flight_then_refuses():
    _, engine = make_client(seconds=0.3)

    async def run():
        await engine.start()
        tasks = [asyncio.create_task(engine.prefill([i + 1, 2, 3])) for i in range(4)]
        await asyncio.sleep(0.05)
        assert engine.scheduler.num_in_flight == 4
        assert await engine.shutdown(timeout=10)
        done = [t.result() for t in tasks]
        with pytest.raises(ShuttingDown):
            await engine.prefill([1])
        return done

    done = asyncio.run(run())
    assert [c.record.first_token for c in done] == [(i + 1 + 5) % 256 for i in range(4)]
    assert engine.scheduler.num_completed == 4 and engine.scheduler.num_in_flight == 0


def test_the_whatif_controller_serves_live():
    from serving.engine import EngineConfig
    from serving.policy.composition import CompositionController
    with pytest.raises(ValueError, match="controller_policy"):
        EngineConfig(controller_policy="thresholds")
    client, engine = make_client(controller_policy="whatif")
    with client:
        assert isinstance(engine.controller, CompositionController)
        assert (engine.controller.config.min_degree, engine.controller.config.max_degree) == (1, 8)
        for i in range(4):
            r = client.post("/v1/completions", json={"prompt": f"what-if {i} " * 8, "max_tokens": 1})
            assert r.status_code == 200, r.text
        assert engine.controller._samples  # placements reach the controller
