"""Routing-decision latency: `python -m eval.bench_router`.

Builds a pool of `--workers` workers (mixed CP degrees) whose prefix index holds `--blocks`
cached blocks (chains of 64 blocks spread over the workers, some replicated), then times
`Scheduler.eligible` (prefix match over the index) plus the router's `choose` for requests that
hit a cached chain part-way, miss entirely, or hit fully. Routers: least work, the paper's
placement cost, and that cost with the live-context price of the default `vertumnus`
(`live_horizon_s=300`: every decision also prices evictions and records the placement in the
live working sets, which here outgrow the workers' KV, so the price is computed for every
candidate; and `congestion_price`, which counts the candidates' queues). Prints p50 / p99 / max
in microseconds per router and writes JSON. Target (issue "The Vertumnus policies"): p99 <= 100
us with 20 workers and a million blocks.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import time

import numpy as np
from absl import app, flags

from serving.policy.cost_model import PrefillCostModel
from serving.policy.cost_router import VertumnusRouter
from serving.policy.live_set import DEFAULT_HORIZON_S
from serving.policy.profiles import generate_profile
from serving.policy.request import Request, chain_block_hashes
from serving.policy.router import LeastWorkRouter
from serving.policy.scheduler import Scheduler
from serving.policy.worker import layout_workers

_WORKERS = flags.DEFINE_integer("workers", 20, "Workers in the pool.", lower_bound=1)
_BLOCKS = flags.DEFINE_integer("blocks", 1_000_000, "Cached blocks in the prefix index.",
                               lower_bound=64)
_REQUESTS = flags.DEFINE_integer("requests", 20_000, "Timed routing decisions.", lower_bound=100)
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")
_OUT = flags.DEFINE_string("output_json", "out/bench_router.json", "Where the JSON goes.")

_CHAIN = 64


class _NoBackend:
    def start_prefill(self, worker_id, request, now):
        pass


def _percentiles(ns: np.ndarray) -> dict:
    us = ns / 1e3
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "max_us": float(us.max()), "mean_us": float(us.mean())}


def main(argv):
    del argv
    rng = np.random.default_rng(_SEED.value)
    degrees = ([4, 2, 2, 1, 1] * (_WORKERS.value // 5 + 1))[:_WORKERS.value]
    workers = layout_workers(degrees, 100_000, 1 << 20)
    cost = PrefillCostModel.fit(generate_profile("h20", "qwen3-30b-a3b", degrees=(1, 2, 4)))
    chains = []
    t0 = time.perf_counter()
    index_holder = Scheduler(workers, cost, LeastWorkRouter(), _NoBackend())
    index = index_holder.prefix_index
    for c in range(_BLOCKS.value // _CHAIN):
        chain = chain_block_hashes(range(c * _CHAIN, (c + 1) * _CHAIN))
        chains.append(chain)
        for w in rng.choice(len(workers), size=1 + int(rng.random() < 0.2), replace=False):
            index.insert(int(w), chain)
    build_s = time.perf_counter() - t0
    gc.freeze()  # a long-lived index: keep the cyclic collector from re-walking it (as a server would)

    def requests():
        for i in range(_REQUESTS.value):
            kind = i % 3
            if kind == 2:  # a miss
                hashes = chain_block_hashes(range(-(i + 1) * _CHAIN, -i * _CHAIN))
            else:
                chain = chains[int(rng.integers(len(chains)))]
                k = _CHAIN if kind == 1 else int(rng.integers(1, _CHAIN))
                hashes = chain[:k] + chain_block_hashes(range(10**9 + i * _CHAIN, 10**9 + i * _CHAIN + _CHAIN - k), chain[k - 1])
            yield Request(i, 0.0, _CHAIN * 512, 1, hashes, 512)

    rows = []
    routers = [("least work", LeastWorkRouter()),
               ("vertumnus (the paper's cost)", VertumnusRouter()),
               (f"vertumnus, live sets of {DEFAULT_HORIZON_S:.0f} s, congestion price",
                VertumnusRouter(live_horizon_s=DEFAULT_HORIZON_S, congestion_price=True))]
    for label, router in routers:
        sched = Scheduler(workers, cost, router, _NoBackend(), prefix_index=index)
        for w, q in zip(sched.workers.values(), rng.uniform(0, 5, len(workers))):
            w.queued_seconds = float(q)
        reqs = list(requests())
        times = np.empty(len(reqs), dtype=np.int64)
        for j, r in enumerate(reqs):
            t = time.perf_counter_ns()
            cands, matched = sched.eligible(r)
            router.choose(r, cands, matched, 0.0)
            times[j] = time.perf_counter_ns() - t
        rows.append({"router": label, **_percentiles(times)})
    print(f"prefix index: {len(index):,} blocks over {len(workers)} workers (built in {build_s:.1f} s)")
    print("| router | p50 (us) | p99 (us) | max (us) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['router']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | {r['max_us']:.1f} |")
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
        json.dump({"workers": len(workers), "blocks": len(index), "requests": _REQUESTS.value,
                   "python": platform.python_version(), "results": rows}, f, indent=1)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
