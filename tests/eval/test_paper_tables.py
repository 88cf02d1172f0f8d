"""eval.paper.summary_tables: the headline and per-load tables from a hand-made sweep."""

from __future__ import annotations

from eval.paper import summary_tables


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
