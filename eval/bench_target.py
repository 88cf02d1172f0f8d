"""The composition controller's comparison "on equal terms", by pool size:
`python -m eval.bench_target`.

`serving.policy.whatif.target_composition` replays the controller's window through every
composition of the pool's GPUs up to `composition_search.EXHAUSTIVE_LIMIT` of them, and searches
larger pools (`composition_search.pattern_search`). This times both side by side, per pool of
`--gpus` GPUs of degrees `--degrees`, on one seeded window of `--requests` requests (1-3K
tokens, half of them with a cached prefix, Poisson at `--load` of what CP-8 workers of the pool
serve; the backlog spread 0.5 s), the full listing only where it has at most `--list_up_to`
compositions. Prints a table (median ms of `--repeats`, the ratio, and the searched TTFT over
the listed least) and writes JSON.
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np
from absl import app, flags

from serving.policy.composition_search import count_compositions
from serving.policy.cost_model import PrefillCostModel
from serving.policy.profiles import generate_profile
from serving.policy.whatif import Window, target_composition

F = flags.FLAGS  # flags defined only when run as a script (`_define_flags`)

def _median_ms(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times)), out


def main(argv):
    del argv
    degrees = tuple(sorted(int(d) for d in F.degrees))
    if not degrees or any(d < 1 or d & (d - 1) for d in degrees):
        raise app.UsageError(f"--degrees must be powers of two >= 1, got {list(degrees)}")
    gpus_list = [int(g) for g in F.gpus]
    bad = [g for g in gpus_list if g < 1 or g % max(degrees)]
    if bad:
        raise app.UsageError(f"--gpus must be multiples of the largest degree {max(degrees)}, "
                             f"got {bad}")
    cost = PrefillCostModel.fit(generate_profile("h20", "qwen3-30b-a3b", degrees))
    rows = []
    print("| GPUs | compositions | listed (ms) | searched (ms) | listed / searched "
          "| searched TTFT / least |\n|---|---|---|---|---|---|")
    for gpus in gpus_list:
        rng = np.random.default_rng(F.seed)
        n = F.requests
        lens = rng.integers(1000, 3000, n)
        hits = (rng.random(n) < 0.5) * (lens * rng.uniform(0, 0.9, n)).astype(int)
        mean_s = float(np.mean([cost.predict(8, int(L), int(h)) for L, h in zip(lens, hits)]))
        arrivals = np.cumsum(rng.exponential(mean_s * 8 / gpus / F.load, n))
        sample = [(float(t), int(L), int(h)) for t, L, h in zip(arrivals, lens, hits)]
        window = Window.of(sample, degrees, cost.predict, lambda c: 1 << 20)
        current = [max(degrees)] * (gpus // max(degrees))
        count = count_compositions(gpus, degrees)
        searched_ms, searched = _median_ms(lambda: target_composition(
            current, 0.5, window, 1.0, degrees, 1, exhaustive_limit=0), F.repeats)
        row = {"gpus": gpus, "compositions": count, "searched_ms": searched_ms,
               "searched_ttft_s": searched[1], "searched": list(searched[0])}
        if count <= F.list_up_to:
            listed_ms, listed = _median_ms(lambda: target_composition(
                current, 0.5, window, 1.0, degrees, 1, exhaustive_limit=count), F.repeats)
            row.update(listed_ms=listed_ms, listed_ttft_s=listed[1], listed=list(listed[0]))
        rows.append(row)
        listed_cell = (f"{row['listed_ms']:.1f} | {searched_ms:.1f} | "
                       f"{row['listed_ms'] / searched_ms:.0f}x | "
                       f"{searched[1] / row['listed_ttft_s']:.4f}") if "listed_ms" in row else (
            f"not run | {searched_ms:.1f} | n/a | n/a")
        print(f"| {gpus} | {count:,} | {listed_cell} |", flush=True)
    result = {"degrees": list(degrees), "requests": F.requests, "load": F.load,
              "repeats": F.repeats, "seed": F.seed, "python": platform.python_version(),
              "machine": platform.machine(), "cpu_count": os.cpu_count(), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(F.output_json)), exist_ok=True)
    with open(F.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {F.output_json}")


def _define_flags():
    flags.DEFINE_list("gpus", ["32", "64", "128", "256", "512"], "Pool sizes (GPUs).")
    flags.DEFINE_list("degrees", ["1", "2", "4", "8"], "CP degrees allowed.")
    flags.DEFINE_integer("requests", 400, "Window size.", lower_bound=10)
    flags.DEFINE_float("load", 1.2, "Window load on all-CP-8 workers.", lower_bound=0.01)
    flags.DEFINE_integer("repeats", 3, "Timed calls per cell (median).", lower_bound=1)
    flags.DEFINE_integer("list_up_to", 10_000, "Largest listing timed.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed.")
    flags.DEFINE_string("output_json", "out/bench_target.json", "Where the JSON goes.")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
