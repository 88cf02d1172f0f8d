"""Part "profile" of `python -m vertumnus_jax.gpu_check`: a measured prefill profile CSV.

CP-1 zigzag prefill (`vertumnus_jax.prefill`, the engine the server runs, with the compiled
Pallas kernel) of a Qwen3-8B-shaped model with seeded random bf16 weights, timed by
`vertumnus_jax.profile_timing.time_prefill` (the profiler's own routine: the prefix is prefilled and
cached once, then the whole prompt is prefilled over it `profile_warmup` times untimed,
compilation included, and `profile_repeats` times timed, host call to first token on the host;
the median is kept) over input lengths x cached fractions (`cached_length`: whole blocks, the
last token always recomputed).

Depth. The layers are unrolled in the jitted step, so compile time grows with depth and every
grid point (a new padded length or prefix bucket) compiles anew; 36 layers over a 24-point grid
does not fit the 8-minute run. The model is measured at `profile_layers` (4) layers and scaled to
the target depth (36) as `T = F + (T_m - F) * target / measured`, where the fixed part F (host
work, embedding, LM head of the last token, transfers) is `T_m - measured * per_layer` with
`per_layer = (T_m - T_p) / (measured - probe)` from the smallest grid point timed at the measured
depth and at `probe_layers` (1) layers. Every decoder layer has the same shapes and work, so the
per-layer time is the same for all 36 (only weights differ). `profile_measured.csv` keeps the
measured-depth times; `profile.csv` has the scaled ones (what `eval.replay --profile_csv` takes).
Without the probe (it failed or the budget ended) the scaling falls back to proportional (F = 0,
an over-estimate for short prompts) and the record says so.

Order: lengths coarse to fine (smallest, largest, then the middles), so a run cut short by the
budget still spans the range; the CSVs are rewritten after every point.
"""

from __future__ import annotations

import csv
import gc
import os
import time

import jax
import numpy as np

from mesh import worker_mesh
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import init_model
from vertumnus_jax.profile_timing import cached_length, time_prefill
from vertumnus_jax.worker import Worker

COLUMNS = ("cp", "input_len", "cached_len", "seconds")


def coarse_to_fine(values) -> list:
    """Sorted distinct `values` reordered: smallest, largest, then midpoints of the gaps."""
    vals = sorted(set(values))
    if len(vals) <= 2:
        return vals
    order, queue = [vals[0], vals[-1]], [(0, len(vals) - 1)]
    while queue:
        lo, hi = queue.pop(0)
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        order.append(vals[mid])
        queue += [(lo, mid), (mid, hi)]
    return order


def scale_seconds(measured_s: float, fixed_s: float | None, measured_layers: int,
                  target_layers: int) -> float:
    """`F + (T_m - F) * target / measured` (F = 0 when unknown)."""
    f = 0.0 if fixed_s is None else min(max(fixed_s, 0.0), measured_s)
    return f + (measured_s - f) * target_layers / measured_layers


def fixed_overhead(t_measured: float, t_probe: float, measured_layers: int,
                   probe_layers: int) -> tuple[float, float]:
    """(fixed seconds F, seconds per layer) from one point timed at two depths; F is clamped
    to [0, t_measured] (timing noise)."""
    per_layer = max(0.0, (t_measured - t_probe) / (measured_layers - probe_layers))
    return min(max(t_measured - measured_layers * per_layer, 0.0), t_measured), per_layer


def write_csv(path: str, rows) -> None:
    """`cp,input_len,cached_len,seconds` rows (sorted), seconds as repr floats; atomically
    (a temporary file, then os.replace), so a kill never leaves half a CSV."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for cp, length, h, s in sorted(rows):
            w.writerow((int(cp), int(length), int(h), repr(float(s))))
    os.replace(tmp, path)


def _worker(cfg, layers: int, cp: int, num_blocks: int) -> Worker:
    config = ModelConfig.named(cfg.profile_model, dtype=cfg.dtype, num_layers=layers)
    model = init_model(config, cfg.seed)
    return Worker(worker_mesh(jax.devices(), 0, cp), model, num_blocks=num_blocks,
                  block_size=cfg.profile_block_size, interpret=cfg.interpret)


def _point(worker, tokens, h, cfg) -> dict:
    start = time.monotonic()
    seconds = time_prefill(worker, tokens, h, cfg.profile_warmup, cfg.profile_repeats)
    wall = time.monotonic() - start
    worker.cache.evict(worker.cache.num_blocks * worker.cp_degree)  # next point starts cold
    return {"input_len": int(len(tokens)), "cached_len": int(h), "seconds": seconds,
            "wall_s": wall,
            "setup_s": max(0.0, wall - (cfg.profile_warmup + cfg.profile_repeats) * seconds)}


def run(cfg, deadline, part_end, record, results) -> None:
    """Measures the grid while the budget lasts; fills `record`, writes the two CSVs."""
    base = ModelConfig.named(cfg.profile_model, dtype=cfg.dtype)
    target = cfg.profile_target_layers or base.num_layers
    measured = min(cfg.profile_layers or target, target)
    probe = cfg.probe_layers if cfg.probe_layers < measured else None
    bs = cfg.profile_block_size
    lens = coarse_to_fine(cfg.profile_lens)
    record.update(model=cfg.profile_model, dtype=cfg.dtype, target_layers=target,
                  measured_layers=measured, probe_layers=probe, block_size=bs,
                  input_lens=sorted(lens), cached_fractions=list(cfg.profile_fracs),
                  warmup=cfg.profile_warmup, repeats=cfg.profile_repeats,
                  csv="profile.csv", measured_csv="profile_measured.csv", points=[], probe={})
    rng = np.random.default_rng(cfg.seed)
    tokens_by_len = {n: rng.integers(0, base.vocab_size, n) for n in lens}
    devices = jax.devices()
    for cp in sorted(set(cfg.profile_cp)):
        if cp > len(devices):
            record.setdefault("skipped_cp", []).append(cp)
            continue
        num_blocks = 2 * (-(-max(lens) // bs) // cp + 1)  # as vertumnus_jax.profile
        small_len = min(lens)
        small_h = cached_length(small_len, max(cfg.profile_fracs), bs)
        if probe is not None and _out_of_time(deadline, part_end):
            record["probe"][str(cp)] = {"skipped": "out of budget before building the probe"}
        elif probe is not None:
            w = None
            try:
                w = _worker(cfg, probe, cp, num_blocks)
                if _out_of_time(deadline, part_end):
                    raise _OutOfTime("out of budget after building the probe model")
                p = _point(w, tokens_by_len[small_len], small_h, cfg)
                record["probe"][str(cp)] = {"layers": probe, **p}
                print(f"   probe cp={cp} {probe} layer(s) L={small_len} h={small_h}: "
                      f"{p['seconds'] * 1e3:.2f} ms", flush=True)
            except _OutOfTime as err:
                record["probe"][str(cp)] = {"skipped": str(err)}
            except Exception as err:  # noqa: BLE001 - fall back to proportional scaling
                record["probe"][str(cp)] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            finally:
                w = None
                gc.collect()
        if _out_of_time(deadline, part_end):
            fracs = sorted(set(cfg.profile_fracs))
            record.setdefault("skipped", []).extend(
                {"cp": cp, "input_len": n, "cached_len": h,
                 "reason": "out of budget before building the measured model"}
                for n in lens for h in sorted({cached_length(n, f, bs) for f in fracs}))
            print(f"   budget: profile cp={cp} skipped before building the model", flush=True)
            continue
        worker = _worker(cfg, measured, cp, num_blocks)
        _grid(cfg, worker, cp, lens, tokens_by_len, deadline, part_end, record, results,
              target, measured, probe)
        worker = None
        gc.collect()


class _OutOfTime(Exception):
    pass


def _out_of_time(deadline, part_end, need_s: float = 5.0) -> bool:
    """Whether less than `need_s` of the part's time is left (checked before each model
    build and the probe)."""
    return deadline.left(part_end) < need_s


def _grid(cfg, worker, cp, lens, tokens_by_len, deadline, part_end, record, results,
          target, measured, probe) -> None:
    bs = worker.block_size
    fracs = sorted(set(cfg.profile_fracs))
    grid = [(n, h) for n in lens for h in sorted({cached_length(n, f, bs) for f in fracs})]
    longest = 0.0
    for i, (n, h) in enumerate(grid):
        if deadline.left(part_end) < 1.5 * longest + 5.0:
            record.setdefault("skipped", []).extend(
                {"cp": cp, "input_len": a, "cached_len": b, "reason": "out of budget"}
                for a, b in grid[i:])
            print(f"   budget: {len(grid) - i} grid points left unmeasured", flush=True)
            break
        start = time.monotonic()
        try:
            p = {"cp": cp, **_point(worker, tokens_by_len[n], h, cfg),
                 "fractions": [f for f in fracs if cached_length(n, f, bs) == h]}
        except Exception as err:  # noqa: BLE001 - a failing point is recorded, the rest go on
            p = {"cp": cp, "input_len": n, "cached_len": h,
                 "fractions": [f for f in fracs if cached_length(n, f, bs) == h],
                 "error": f"{type(err).__name__}: {err}"[:2000]}
            try:  # leave the cache empty for the next point
                worker.cache.evict(worker.cache.num_blocks * cp)
            except Exception as evict_err:  # noqa: BLE001
                p["evict_error"] = f"{type(evict_err).__name__}: {evict_err}"[:500]
        longest = max(longest, time.monotonic() - start)
        record["points"].append(p)
        _rescale(record, cp, measured, target, probe)
        _write(record, results)
        if "seconds" in p:
            print(f"   cp={cp} L={n:<6d} h={h:<6d} {p['seconds'] * 1e3:9.2f} ms measured, "
                  f"{p['scaled_seconds'] * 1e3:9.2f} ms at {target} layers "
                  f"(wall {p['wall_s']:.1f} s)", flush=True)
        else:
            print(f"   cp={cp} L={n} h={h} failed: {p['error'].splitlines()[0][:160]}",
                  flush=True)
        results.save()


def _rescale(record, cp, measured, target, probe) -> None:
    """Fills the fixed overhead of `cp` (when its probe and smallest point are measured) and
    every point's `scaled_seconds`."""
    fixed = record.setdefault("fixed_overhead", {})
    pr = record["probe"].get(str(cp), {})
    if probe is not None and "seconds" in pr and str(cp) not in fixed:
        same = [p for p in record["points"] if p["cp"] == cp and "seconds" in p
                and p["input_len"] == pr["input_len"] and p["cached_len"] == pr["cached_len"]]
        if same:
            f, per_layer = fixed_overhead(same[0]["seconds"], pr["seconds"], measured, probe)
            fixed[str(cp)] = {"fixed_s": f, "per_layer_s": per_layer,
                              "at": {"input_len": pr["input_len"],
                                     "cached_len": pr["cached_len"]}}
    f = fixed.get(str(cp), {}).get("fixed_s")
    record["scaling"] = ("none (measured at full depth)" if measured == target else
                         "F + (T - F) * target / measured" if f is not None else
                         "proportional (no fixed-overhead probe)")
    for p in record["points"]:
        if p["cp"] == cp and "seconds" in p:
            p["scaled_seconds"] = (p["seconds"] if measured == target
                                   else scale_seconds(p["seconds"], f, measured, target))


def _write(record, results) -> None:
    ok = [p for p in record["points"] if "seconds" in p]
    write_csv(results.path(record["measured_csv"]),
              [(p["cp"], p["input_len"], p["cached_len"], p["seconds"]) for p in ok])
    write_csv(results.path(record["csv"]),
              [(p["cp"], p["input_len"], p["cached_len"], p["scaled_seconds"]) for p in ok])
