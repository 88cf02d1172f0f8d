"""`python -m eval.profile_check`: a measured prefill profile against the analytic one.

The simulator's ground truth and the router's cost model come from
`serving.policy.profiles.analytic_prefill_seconds` unless a measured profile CSV is given. This
script says how far that model is from a measured CSV (e.g. `vertumnus_jax.gpu_check`'s
`profile.csv`), row by row and by cached fraction, and how well the router's closed form
(`serving.policy.cost_model.PrefillCostModel`) fits each of the two tables over the same grid.

Usage:
  python -m eval.profile_check \
      --profile_csv=pallas_kernels/results/gpu_check-20261204T182549Z/profile.csv \
      --gpu=h200 --model=qwen3-8b --output=out/profile_check.json

Ratio = analytic / measured (below 1: the model predicts the prefill faster than it ran).
Fit error = |T_fit - T| / T over the rows, mean and max, per CP degree (`fit_error`); a table
the closed form cannot be fitted to (fewer than 4 distinct rows of a degree) gets its reason
instead, after the row and bucket tables. Prints tables; writes JSON (`--output`). Raises
ValueError for a malformed CSV (`read_profile_csv`) or an unknown gpu / model.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from serving.policy.cost_model import PrefillCostModel
from serving.policy.profiles import (
    GPUS,
    MODELS,
    ProfileTable,
    analytic_prefill_seconds,
    read_profile_csv,
)

F = flags.FLAGS  # flags defined only when run as a script (`_define_flags`)

# Cached-fraction buckets of the summary (lower edges).
BUCKETS = (0.0, 0.25, 0.75, 0.95)


def compare(measured: ProfileTable, gpu: str, model: str) -> dict:
    """Row-by-row comparison of `measured` with the analytic profile of (gpu, model).

    Returns {"rows": [{cp, input_len, cached_len, measured_s, analytic_s, ratio}] (seconds;
    ratio = analytic / measured), "buckets": [{from_fraction, rows, ratio_min, ratio_median,
    ratio_max}] (rows whose cached_len / input_len is at least `from_fraction` and below the
    next edge of `BUCKETS`), "fit": {"measured": {cp: [mean, max]} or {"error": reason},
    "analytic": likewise}} (relative errors), the analytic table built on the measured
    table's (cp, input_len, cached_len) grid. Raises ValueError for a gpu or model
    `analytic_prefill_seconds` does not know."""
    rows = []
    analytic = []
    for cp, L, h, s in zip(measured.cp, measured.input_len, measured.cached_len,
                           measured.seconds):
        a = analytic_prefill_seconds(gpu, model, int(cp), int(L), int(h))
        analytic.append(a)
        rows.append({"cp": int(cp), "input_len": int(L), "cached_len": int(h),
                     "measured_s": float(s), "analytic_s": float(a), "ratio": float(a / s)})
    fractions = np.array([r["cached_len"] / r["input_len"] for r in rows])
    ratios = np.array([r["ratio"] for r in rows])
    edges = list(BUCKETS) + [1.01]
    buckets = []
    for lo, hi in zip(edges, edges[1:]):
        sel = ratios[(fractions >= lo) & (fractions < hi)]
        if len(sel):
            buckets.append({"from_fraction": lo, "rows": int(len(sel)),
                            "ratio_min": float(sel.min()), "ratio_median": float(np.median(sel)),
                            "ratio_max": float(sel.max())})
    analytic_table = ProfileTable(measured.cp, measured.input_len, measured.cached_len,
                                  np.asarray(analytic))
    fit = {}
    for name, table in (("measured", measured), ("analytic", analytic_table)):
        try:
            fit[name] = {int(c): [float(e) for e in err]
                         for c, err in PrefillCostModel.fit(table).fit_error().items()}
        except ValueError as err:  # too few distinct rows of a degree: the tables still stand
            fit[name] = {"error": str(err)}
    return {"rows": rows, "buckets": buckets, "fit": fit}


def run(profile_csv: str, gpu: str, model: str, output: str) -> dict:
    """Compares `profile_csv` with the analytic (gpu, model) profile, prints the tables and
    writes `output` (JSON). Returns what `compare` returns, plus the arguments."""
    measured = read_profile_csv(profile_csv)
    result = compare(measured, gpu, model)
    print(f"{profile_csv} against analytic_prefill_seconds({gpu!r}, {model!r})\n")
    print("| cp | input_len | cached | measured ms | analytic ms | analytic / measured |")
    print("|---|---|---|---|---|---|")
    for r in sorted(result["rows"], key=lambda r: (r["cp"], r["input_len"], r["cached_len"])):
        print(f"| {r['cp']} | {r['input_len']} | {r['cached_len'] / r['input_len']:.0%} "
              f"| {1e3 * r['measured_s']:.1f} | {1e3 * r['analytic_s']:.1f} | {r['ratio']:.2f} |")
    print("\n| cached fraction from | rows | ratio min | median | max |")
    print("|---|---|---|---|---|")
    for b in result["buckets"]:
        print(f"| {b['from_fraction']:.0%} | {b['rows']} | {b['ratio_min']:.2f} "
              f"| {b['ratio_median']:.2f} | {b['ratio_max']:.2f} |")
    print("\nrouter cost model (PrefillCostModel.fit), relative fit error mean / max:")
    for name, per_cp in result["fit"].items():
        if "error" in per_cp:
            print(f"  {name:<9} not fitted: {per_cp['error']}")
            continue
        for c, (mean, mx) in per_cp.items():
            print(f"  {name:<9} CP-{c}: {mean:.1%} / {mx:.1%}")
    result.update(profile_csv=profile_csv, gpu=gpu, model=model)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {output}")
    return result


def main(argv):
    del argv
    run(F.profile_csv, F.gpu, F.model, F.output)


def _define_flags():
    flags.DEFINE_string("profile_csv", None, "Measured profile CSV (cp,input_len,cached_len,"
                        "seconds).", required=True)
    flags.DEFINE_enum("gpu", "h200", sorted(GPUS), "GPU of the analytic profile.")
    flags.DEFINE_enum("model", "qwen3-8b", sorted(MODELS), "Model of the analytic profile.")
    flags.DEFINE_string("output", "out/profile_check.json", "JSON path.")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
