"""eval.paper.summary_tables: the headline and per-load tables from a hand-made sweep."""

from __future__ import annotations

import pytest

from eval.paper import headline, summary_tables
from eval.paper_setup import best_baseline


def _row(system, rate, lf, mean, p90, slo, comp=(4, 4), final=(4, 4), reconf=()):
    return {"system": system, "request_rate": rate, "load_factor": lf, "mean_ttft_ms": mean,
            "p90_ttft_ms": p90, "token_weighted_slo_attainment": slo, "composition": list(comp),
            "final_composition": list(final), "reconfigurations": list(reconf)}


def test_best_baseline_and_changes_hand_computed():
    results = [
        _row("homogeneous-cp4", 10.0, 0.6, 500.0, 900.0, 0.99),
        _row("mooncake-cp4", 10.0, 0.6, 400.0, 800.0, 0.995),   # best baseline at 10 req/s
        _row("vertumnus", 10.0, 0.6, 440.0, 700.0, 0.99, comp=(2, 2, 4), final=(4, 4),
             reconf=[{}]),
        _row("vertumnus-fetch", 10.0, 0.6, 380.0, 600.0, 0.999),  # ours: never a baseline
        _row("vertumnus-fcfs", 10.0, 0.6, 390.0, 650.0, 0.999),  # ours too
        _row("homogeneous-cp4", 20.0, 1.2, 2000.0, 4000.0, 0.5),  # best baseline at the top
        _row("mooncake-cp4", 20.0, 1.2, 9000.0, 9900.0, 0.1),
        _row("vertumnus", 20.0, 1.2, 1500.0, 5000.0, 0.6),
    ]
    head = {"rate": 20.0, "baseline": "homogeneous-cp4", "mean_ttft_reduction": 0.25,
            "p90_ttft_reduction": -0.25, "slo_gain_points": 10.0}
    md = summary_tables({"production/qwen3-30b-a3b/cp2-4": {"results": results,
                                                            "headline": head}})
    rows = [line for line in md if line.startswith("| production")]
    assert rows[0] == ("| production | qwen3-30b-a3b, {2, 4} | 20.00 | `homogeneous-cp4` | -25.0% | "
                       "+25.0% | +10.0 | 28.1 % lower |")
    # 440 / 400 - 1 = +10.0 %; the fetch and FCFS columns show vertumnus-fetch and
    # vertumnus-fcfs, the other variants are absent.
    assert rows[1] == ("| production | qwen3-30b-a3b, cp2-4 | 0.6 | 10.00 | `mooncake-cp4` | 400 | "
                       "440 | +10.0% | 0.995 | 0.990 | 3 -> 2, 1 | - | - | - | 380 | 390 |")
    assert rows[2] == ("| production | qwen3-30b-a3b, cp2-4 | 1.2 | 20.00 | `homogeneous-cp4` | 2000 | "
                       "1500 | -25.0% | 0.500 | 0.600 | 2 -> 2, 0 | - | - | - | - | - |")


def test_fetch_table_at_the_highest_load():
    results = [
        _row("homogeneous-cp4", 20.0, 1.2, 2000.0, 4000.0, 0.5),
        _row("vertumnus", 20.0, 1.2, 2500.0, 5000.0, 0.6),
        {**_row("vertumnus-fetch", 20.0, 1.2, 1500.0, 5000.0, 0.55), "replications": 7},
    ]
    head = {"rate": 20.0, "baseline": "homogeneous-cp4", "mean_ttft_reduction": -0.25,
            "p90_ttft_reduction": -0.25, "slo_gain_points": 10.0}
    md = summary_tables({"leval/qwen3-32b/cp4-8": {"results": results, "headline": head}})
    k = md.index("### `vertumnus-fetch` vs the strongest baseline at the highest swept load")
    # 1500 / 2000 - 1, 5000 / 4000 - 1, 100 * (0.55 - 0.5), 1500 / 2500 - 1, 7 copies
    assert md[k + 4] == ("| leval | qwen3-32b, {4, 8} | 20.00 | `homogeneous-cp4` | -25.0% | +25.0% "
                         "| +5.0 | -40.0% | 7 |")


def test_every_workload_has_its_loads_and_the_papers_reduction():
    # A workload missing from either table would fail only after minutes of simulation.
    from eval.paper import LOADS, PAPER_REDUCTION
    names = {"production", "leval", "leval-csv", "toolagent", "code", "agents"}
    assert set(PAPER_REDUCTION) == names
    assert set(LOADS) == names | {"synthetic", "synthetic-prefix"}  # (+ eval.robustness' own)
    assert all(len(loads) == 4 and list(loads) == sorted(loads) for loads in LOADS.values())


def test_the_best_baseline_failed_no_more_requests_than_ours():
    def r(system, mean, failed):
        return {"system": system, "mean_ttft_ms": mean, "failed": failed}

    cp4, cp8, st = r("homogeneous-cp4", 1208.0, 46), r("homogeneous-cp8", 21577.0, 0), \
        r("static-threshold", 115222.0, 0)
    cell = [cp4, cp8, st, r("vertumnus-paper", 10.0, 0), r("sglang-cp4", None, 6015),
            r("vertumnus-gated-sjf", 20.0, 0), r("vertumnus-static", 30.0, 0)]
    # like for like: cp4's mean leaves out the 46 prompts it refused; ours' are not baselines,
    # nor is a system without a mean
    assert best_baseline(cell, r("vertumnus", 2335.0, 0)) == (cp8, cp4)
    assert best_baseline(cell, r("vertumnus", 2335.0, 46)) == (cp4, None)
    assert best_baseline(cell) == (cp4, None)  # (no result to hold them against)
    # every baseline refused more than ours: those that refused fewest
    fewer = [r("homogeneous-cp4", 500.0, 5), r("mooncake-cp4", 700.0, 3),
             r("dynamo-cp4", 900.0, 3)]
    assert best_baseline(fewer, r("vertumnus", 800.0, 0)) == (fewer[1], fewer[0])
    assert best_baseline([r("vertumnus-fetch", 1.0, 0)], r("vertumnus", 1.0, 0)) == (None, None)
    assert best_baseline([], None) == (None, None)
    # a tie is not faster, in either order; a missing or None count is 0; a zero mean skipped
    tie = [r("homogeneous-cp4", 100.0, 5), r("mooncake-cp4", 100.0, 0)]
    for order in (tie, tie[::-1]):
        assert best_baseline(order, r("vertumnus", 90.0, 0)) == (tie[1], None)
    loose = [{"system": "homogeneous-cp4", "mean_ttft_ms": 80.0}, r("mooncake-cp4", 70.0, None),
             r("dynamo-cp4", 0.0, 0)]
    assert best_baseline(loose, r("vertumnus", 90.0, None)) == (loose[1], None)


def test_tables_name_a_faster_baseline_that_failed_more():
    results = [{**_row("homogeneous-cp4", 3.0, 1.1, 1208.0, 2430.0, 0.4), "failed": 46},
               {**_row("homogeneous-cp8", 3.0, 1.1, 21577.0, 33255.0, 0.1), "failed": 0},
               {**_row("vertumnus", 3.0, 1.1, 2335.0, 3531.0, 0.3), "failed": 0}]
    head = headline(results)
    assert head["baseline"] == "homogeneous-cp8"
    assert head["mean_ttft_reduction"] == pytest.approx(1 - 2335 / 21577)
    md = summary_tables({"production/qwen3-32b/cp4-8": {"results": results, "headline": head}})
    row = next(line for line in md if line.startswith("| production | qwen3-32b, cp4-8 | 1.1"))
    assert row.startswith("| production | qwen3-32b, cp4-8 | 1.1 | 3.00 | `homogeneous-cp8` "
                          "(faster: `homogeneous-cp4` 1208 ms, 46 failed) | 21577 | 2335 | "
                          "-89.2% |")
    # failing as many as the best baseline, nothing is said; failing more, the counts are
    results[2]["failed"], results[1]["failed"] = 46, 3
    md = summary_tables({"production/qwen3-32b/cp4-8": {"results": results, "headline": head}})
    row = next(line for line in md if line.startswith("| production | qwen3-32b, cp4-8 | 1.1"))
    assert row.startswith("| production | qwen3-32b, cp4-8 | 1.1 | 3.00 | `homogeneous-cp4` | "
                          "1208 | 2335 | +93.3% |")
    results[2]["failed"] = 50
    md = summary_tables({"production/qwen3-32b/cp4-8": {"results": results, "headline": head}})
    row = next(line for line in md if line.startswith("| production | qwen3-32b, cp4-8 | 1.1"))
    assert row.startswith("| production | qwen3-32b, cp4-8 | 1.1 | 3.00 | `homogeneous-cp4` "
                          "(failed: Vertumnus 50, it 46) | 1208 | 2335 | +93.3% |")
