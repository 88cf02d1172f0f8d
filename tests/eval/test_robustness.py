"""eval.robustness: the parts of the workloads and the per-cell verdicts."""

from __future__ import annotations

import json

import pytest

from eval.robustness import cells, halves, markdown
from eval.traces.sessions import load_sessions
from serving.policy.request import Request


def test_halves_split_by_arrival_and_start_each_at_zero():
    times = [5.0, 1.0, 3.0, 9.0, 7.0]
    reqs = [Request(f"r{i}", t, 64, 1, (i,), 64) for i, t in enumerate(times)]
    first, second = halves(reqs)
    assert [r.request_id for r in first] == ["r1", "r2"]  # arrivals 1, 3
    assert [r.request_id for r in second] == ["r0", "r4", "r3"]  # arrivals 5, 7, 9
    assert [r.arrival_time for r in first] == [0.0, 2.0]
    assert [r.arrival_time for r in second] == [0.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="at least 4"):
        halves(reqs[:3])


def test_session_subset_loads_every_other_file(tmp_path):
    for sid in ("a", "b", "c", "d", "e"):
        (tmp_path / f"{sid}.json").write_text(json.dumps({
            "id": sid, "block_size": 64, "hash_id_scope": "local",
            "requests": [{"t": 0.0, "type": "n", "in": 64, "out": 1, "hash_ids": [1]}]}))
    even = load_sessions(tmp_path, block_size=64, subset=slice(0, None, 2))
    odd = load_sessions(tmp_path, block_size=64, subset=slice(1, None, 2))
    assert [even.sessions[r].session_id for r in even.roots] == ["a", "c", "e"]
    assert [odd.sessions[r].session_id for r in odd.roots] == ["b", "d"]
    with pytest.raises(ValueError, match="selects none of the 5 session files"):
        load_sessions(tmp_path, block_size=64, subset=slice(5, None))
    with pytest.raises(ValueError, match="subset must be a slice"):
        load_sessions(tmp_path, block_size=64, subset=0)
    one = tmp_path / "a.json"
    assert len(load_sessions(one, block_size=64, subset=slice(0, None, 2)).roots) == 1
    with pytest.raises(ValueError, match="selects none of the 1 session files"):
        load_sessions(one, block_size=64, subset=slice(1, None, 2))


def test_cells_compare_with_the_best_baseline_per_load_and_count_the_line():
    def r(system, lf, ms):
        return {"system": system, "load_factor": lf, "mean_ttft_ms": ms, "request_rate": lf * 10,
                "composition": [4, 4], "final_composition": [4, 4], "reconfigurations": []}

    results = [r("homogeneous-cp4", 0.5, 100.0), r("sglang-cp4", 0.5, 90.0),
               r("vertumnus", 0.5, 91.0), r("vertumnus-paper", 0.5, 50.0),
               r("homogeneous-cp4", 1.0, 200.0), r("vertumnus", 1.0, 210.0)]
    got = cells(results, "p", "m")
    # vertumnus-paper is one of ours, not a baseline: the best baseline at 0.5 is sglang-cp4
    assert [(c["best_baseline"], c["best_ms"]) for c in got] == [("sglang-cp4", 90.0),
                                                                ("homogeneous-cp4", 200.0)]
    assert [c["change"] for c in got] == pytest.approx([91 / 90 - 1, 0.05])
    got[1]["other_seeds"] = {1: -0.01}
    md = markdown(got)
    assert md[-1] == "1 of 2 cells within 2% of the best baseline, 0 below it."
    assert "| p | m | 1.0 | `homogeneous-cp4` | 200 | 210 | +5.0% | 0, 0 | 1: -1.0% |" in md


def test_a_cell_without_a_mean_is_kept_without_a_verdict():
    # every vertumnus request failed at 0.5; no baseline has a mean at 1.0
    results = [{"system": "vertumnus", "load_factor": 0.5, "mean_ttft_ms": None, "failed": 7,
                "request_rate": 5.0, "composition": [4], "final_composition": [4],
                "reconfigurations": []},
               {"system": "homogeneous-cp4", "load_factor": 0.5, "mean_ttft_ms": 100.0,
                "failed": 0},
               {"system": "vertumnus", "load_factor": 1.0, "mean_ttft_ms": 80.0, "failed": 0,
                "request_rate": 10.0, "composition": [4], "final_composition": [4],
                "reconfigurations": []},
               {"system": "homogeneous-cp4", "load_factor": 1.0, "mean_ttft_ms": None,
                "failed": 9}]
    got = cells(results, "p", "m")
    assert [c["change"] for c in got] == [None, None]
    assert got[0]["failed"] == [7, 0] and got[1]["best_baseline"] is None
    assert markdown(got)[-1] == ("0 of 2 cells within 2% of the best baseline, 0 below it; "
                                 "2 without a result.")
