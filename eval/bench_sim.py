"""Simulator throughput: simulated requests per wall-clock second, `python -m eval.bench_sim`.

Replays the full Mooncake conversation trace (12,031 requests) through each system at the
given load factor, times `eval.simulator.simulate` alone (loading, SLO assignment and metrics
excluded), takes the median of `--repeats`, prints a table and writes JSON. One process, one
core: the simulator is single-threaded Python.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import sys
import time

from absl import app, flags

from eval.experiment import ReplayConfig, ReplayEnv, run_degrees, simulate_system
from eval.traces import load_trace
from eval.workloads import scale_to_rate

# The public traces: $VERTUMNUS_TRACES_DIR, else ../shared/traces beside the repository.
_DEFAULT_TRACE = pathlib.Path(os.environ.get("VERTUMNUS_TRACES_DIR") or pathlib.Path(
    __file__).resolve().parents[1].parent / "shared" / "traces") / "mooncake" / "conversation_trace.jsonl"

_TRACE = flags.DEFINE_string("trace", str(_DEFAULT_TRACE), "Trace to replay.")
_SYSTEMS = flags.DEFINE_list("systems", ["leastwork-cp4", "homogeneous-cp2", "homogeneous-cp4",
                                         "vertumnus"], "Systems to time.")
_LOAD = flags.DEFINE_float("load_factor", 0.9, "Rate as a multiple of the cold capacity rate.",
                           lower_bound=1e-3)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (median reported).", lower_bound=1)
_OUT = flags.DEFINE_string("output_json", "out/bench_sim.json", "Where the JSON goes.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        run()
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


def run() -> None:
    """The benchmark (see the module docstring)."""
    if not os.path.isfile(_TRACE.value):
        sys.exit(f"error: trace {_TRACE.value} not found; pass --trace=PATH to the Mooncake "
                 "conversation trace (kvcache-ai/Mooncake, FAST25-release/traces/)")
    trace = load_trace(_TRACE.value)
    cfg = ReplayConfig(num_gpus=40, systems=tuple(_SYSTEMS.value))
    env = ReplayEnv.build(cfg, 512, run_degrees(cfg))
    rate = _LOAD.value * env.capacity_rate(trace.requests, min(run_degrees(cfg)))
    workload = scale_to_rate(trace.requests, rate)
    demand = env.demand(trace.requests, rate)
    rows = []
    for name in cfg.system_names:
        times = []
        for _ in range(_REPEATS.value):
            system = env.build_system(name, demand)
            t0 = time.perf_counter()
            records, _ = simulate_system(env, cfg, system, workload)
            times.append(time.perf_counter() - t0)
            assert len(records) == len(workload)
        wall = statistics.median(times)
        rows.append({"system": name, "requests": len(workload), "request_rate": rate,
                     "wall_s_median": wall, "wall_s_all": times,
                     "simulated_requests_per_s": len(workload) / wall})
    print(f"| system | requests | rate (req/s) | wall (s, median of {_REPEATS.value}) | sim req/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['requests']} | {r['request_rate']:.2f} | "
              f"{r['wall_s_median']:.3f} | {r['simulated_requests_per_s']:,.0f} |")
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
        json.dump({"trace": _TRACE.value, "python": platform.python_version(),
                   "machine": platform.machine(), "results": rows}, f, indent=1)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
