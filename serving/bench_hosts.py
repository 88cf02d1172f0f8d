"""Benchmark of the multi-host pool on one machine: what Ray adds, and how a host death goes.

    python -m serving.bench_hosts [--requests=200] [--output_dir=out/bench_hosts]

Runs, in one process, side by side:
1. **Dispatch latency**: the same sequence of prompts through the embedded pool (8 CPU devices,
   four CP-2 workers) and through 2 local host agents x 4 CPU devices (two CP-2 workers each).
   Per prefill: `dispatch` = from the backend's `start_prefill` (the scheduler's routing
   decision) until the prefill starts on the worker's thread (embedded) or the agent's method
   starts (Ray); `return` = from the prefill's end until the result is back on the head
   (Ray; embedded it is a thread hop on the same loop, not measured). Wall-clock
   `time.time()` on one machine.
2. **Cross-host copy throughput**: a prefix of `--copy_tokens` tokens exported by a host-0
   worker and imported by a host-1 worker through Ray's object store
   (`HostAgent.export_prefix` -> `import_prefix`), against a device-to-device copy between two
   workers of one host (`HostAgent.replicate`); bytes of K and V over seconds.
3. **Host death**: a closed loop of `--load_threads` clients on the Ray pool; host 1's agent is
   killed (SIGKILL); reported: requests answered and failed, seconds until the head marks the
   host dead, the longest gap between two answers after the kill, and seconds until Ray's
   restarted agent has rejoined as new workers.
Prints a table and writes `bench_hosts.json`. Numbers are of this machine (CPU devices, a
shared 2-core VM here): read the ratios, not the absolute times.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time

import numpy as np
from absl import app, flags

_REQUESTS = flags.DEFINE_integer("requests", 200, "Prefills per pool for the dispatch latency.",
                                 lower_bound=10)
_COPY_TOKENS = flags.DEFINE_integer("copy_tokens", 2048, "Tokens of the copied prefix.",
                                    lower_bound=64)
_COPIES = flags.DEFINE_integer("copies", 5, "Copies timed per kind.", lower_bound=1)
_LOAD = flags.DEFINE_integer("load_threads", 4, "Clients in the host-death run.", lower_bound=1)
_OUT = flags.DEFINE_string("output_dir", "out/bench_hosts", "Where bench_hosts.json goes.")

BS = 16


def _pcts(xs) -> dict:
    ms = np.asarray(xs) * 1e3
    return {"n": len(xs), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean())}


def _config(composition, kv_blocks):
    from serving.engine import EngineConfig
    from serving.server import ServerConfig
    return ServerConfig(composition=composition, degrees=(1, 2, 4), admin_api_key="admin",
                        min_bucket=64, engine=EngineConfig(
                            block_size=BS, kv_blocks_per_device=kv_blocks, max_model_len=4096,
                            controller=False, cache_manager=False, tick_seconds=0.05))


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 48).tolist() for _ in range(n)]


def _run(client, prompts):
    for p in prompts:
        r = client.post("/v1/completions", json={"prompt": p})
        assert r.status_code == 200, r.text


def embedded_dispatch(n: int) -> dict:
    """Dispatch latency of the embedded pool (the live backend's executor hand-off)."""
    import jax
    from fastapi.testclient import TestClient

    import serving.live_backend as lb
    from serving.server import build_app

    log, sent = [], {}
    start, make_room = lb.LiveBackend.start_prefill, lb.LiveBackend._prefill_making_room

    def timed_start(self, worker_id, request, now):
        sent[request.request_id] = time.time()
        start(self, worker_id, request, now)

    def timed_run(self, worker_id, worker, request):
        entered = time.time()
        out = make_room(self, worker_id, worker, request)
        log.append((sent.pop(request.request_id), entered, time.time()))
        return out

    lb.LiveBackend.start_prefill, lb.LiveBackend._prefill_making_room = timed_start, timed_run
    try:
        with TestClient(build_app(_config((2, 2, 2, 2), 64), jax.devices()[:8])) as client:
            _run(client, _prompts(8, seed=99))  # compile
            log.clear()
            _run(client, _prompts(n))
    finally:
        lb.LiveBackend.start_prefill, lb.LiveBackend._prefill_making_room = start, make_room
    return {"dispatch": _pcts([e - s for s, e, _ in log]),
            "prefill_in_worker": _pcts([x - e for _, e, x in log])}


def _copy_bench(engine, copies: int, tokens: int) -> dict:
    """Cross-host (object store) against same-host (device to device) prefix copies."""
    import ray

    from serving.policy.replication import Replication
    from serving.policy.request import Request, prompt_block_hashes
    from vertumnus_jax import ModelConfig
    from vertumnus_jax.kv_move import block_bytes

    backend = engine.backend
    h0, h1 = backend.hosts[0], backend.hosts[1]
    w0a, w0b = sorted(h0.worker_ids)[:2]
    w1 = min(h1.worker_ids)
    toks = np.random.default_rng(5).integers(0, 256, tokens).tolist()
    chain = tuple(prompt_block_hashes(toks, BS)[:tokens // BS])
    out = ray.get(h0.agent.prefill.remote(w0a, Request("copy-src", 0.0, tokens, 1, chain, BS,
                                                       None, token_ids=toks)))
    assert out["ok"], out
    nbytes = len(chain) * block_bytes(ModelConfig.tiny(), BS)
    result = {"blocks": len(chain), "bytes": nbytes}
    for kind in ("cross_host_object_store", "same_host_device_put"):
        times = []
        for _ in range(copies + 1):  # the first of each kind compiles: dropped
            dst = w1 if kind.startswith("cross") else w0b
            agent = h1.agent if kind.startswith("cross") else h0.agent
            t0 = time.perf_counter()
            if kind.startswith("cross"):
                kv = h0.agent.export_prefix.remote(w0a, chain, 0)
                inserted, _ = ray.get(agent.import_prefix.remote(dst, chain, 0, kv))
            else:
                rep = Replication(w0a, dst, chain, 0, BS, 0.0, "inter-degree", None)
                inserted, _ = ray.get(agent.replicate.remote(rep))
            times.append(time.perf_counter() - t0)
            assert len(inserted) == len(chain), (kind, len(inserted))
            ray.get(agent.reclaim.remote(dst, chain))
        best = statistics.median(times[1:])
        result[kind] = {"median_s": best, "mb_per_s": nbytes / best / 1e6}
    return result


def _death_bench(client, engine, threads: int) -> dict:
    hosts = client.get("/v1/hosts").json()["hosts"]
    victim = hosts[1]
    stop, rows, lock = threading.Event(), [], threading.Lock()

    def loop(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            t0 = time.monotonic()
            r = client.post("/v1/completions", json={"prompt": rng.integers(0, 256, 48).tolist()})
            with lock:
                rows.append((t0, time.monotonic(), r.status_code))

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    time.sleep(3.0)
    killed = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    detected = rejoined = None
    while time.monotonic() - killed < 120 and rejoined is None:
        state = client.get("/v1/hosts").json()["hosts"][1]
        if detected is None and state["state"] != "alive":
            detected = time.monotonic() - killed
        if detected is not None and state["state"] == "alive":
            rejoined = time.monotonic() - killed
        time.sleep(0.05)
    time.sleep(2.0)
    stop.set()
    for t in workers:
        t.join(60)
    ends = sorted(e for s, e, code in rows if code == 200 and e > killed)
    gaps = np.diff([killed] + ends) if ends else [float("nan")]
    return {"requests": len(rows), "answered": sum(c == 200 for _, _, c in rows),
            "failed": sum(c != 200 for _, _, c in rows),
            "in_flight_at_kill": sum(s < killed < e for s, e, _ in rows),
            "seconds_to_mark_dead": detected, "longest_gap_between_answers_s": float(max(gaps)),
            "seconds_to_rejoin": rejoined}


def ray_pool(n: int, copies: int, copy_tokens: int, threads: int) -> dict:
    """Dispatch latency, copy throughput and host death on 2 local agents x 4 CPU devices."""
    import ray
    from fastapi.testclient import TestClient

    from serving.ray_pool import HostsConfig, build_ray_app

    app_ = build_ray_app(_config((2, 2), max(64, 2 * copy_tokens // BS // 2)),
                         HostsConfig(local_hosts=2, devices_per_host=4))
    try:
        with TestClient(app_) as client:
            engine = app_.state.engine
            _run(client, _prompts(8, seed=99))
            engine.backend.dispatch_log.clear()
            _run(client, _prompts(n))
            log = list(engine.backend.dispatch_log)
            out = {"dispatch": _pcts([e - s for s, e, _, _ in log]),
                   "prefill_in_agent": _pcts([x - e for _, e, x, _ in log]),
                   "return": _pcts([r - x for _, _, x, r in log])}
            out["copy"] = _copy_bench(engine, copies, copy_tokens)
            out["host_death"] = _death_bench(client, engine, threads)
    finally:
        ray.shutdown()
    return out


def main(argv):
    del argv
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    result = {"embedded": embedded_dispatch(_REQUESTS.value),
              "ray_2x4": ray_pool(_REQUESTS.value, _COPIES.value, _COPY_TOKENS.value,
                                  _LOAD.value)}
    e, r = result["embedded"], result["ray_2x4"]
    print("| measure | embedded (1 process) | Ray, 2 host agents x 4 |")
    print("|---|---|---|")
    print(f"| dispatch p50 / p99 (ms) | {e['dispatch']['p50_ms']:.2f} / "
          f"{e['dispatch']['p99_ms']:.2f} | {r['dispatch']['p50_ms']:.2f} / "
          f"{r['dispatch']['p99_ms']:.2f} |")
    print(f"| result back to the head p50 / p99 (ms) | (same loop) | "
          f"{r['return']['p50_ms']:.2f} / {r['return']['p99_ms']:.2f} |")
    print(f"| prefill itself p50 (ms) | {e['prefill_in_worker']['p50_ms']:.1f} | "
          f"{r['prefill_in_agent']['p50_ms']:.1f} |")
    c = r["copy"]
    print(f"| prefix copy, {c['blocks']} blocks, {c['bytes'] / 1e6:.1f} MB (MB/s) | "
          f"same host: {c['same_host_device_put']['mb_per_s']:.0f} | across hosts: "
          f"{c['cross_host_object_store']['mb_per_s']:.0f} |")
    d = r["host_death"]
    print(f"| host death under load | | {d['answered']} answered, {d['failed']} failed of "
          f"{d['requests']} ({d['in_flight_at_kill']} in flight at the kill); marked dead "
          f"after {d['seconds_to_mark_dead']:.2f} s; longest gap between answers "
          f"{d['longest_gap_between_answers_s']:.2f} s; rejoined after "
          f"{d['seconds_to_rejoin'] or float('nan'):.1f} s |")
    os.makedirs(_OUT.value, exist_ok=True)
    path = os.path.join(_OUT.value, "bench_hosts.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results in {path}")


if __name__ == "__main__":
    app.run(main)
