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
    assert "| p | m | 1.0 | `homogeneous-cp4` | 200 | 210 | +5.0% | 0, 0 | 1: -1.0% | - |" in md
    assert [c["faster"] for c in got] == [None, None]


def test_a_baseline_failing_more_requests_is_not_the_best_but_is_shown():
    # issue 15's cells are like for like: on H100 homogeneous-cp4 refuses the 46 prompts of
    # 98K tokens and more that no CP-4 worker holds (its mean leaves them out)
    def r(system, ms, failed):
        return {"system": system, "load_factor": 1.1, "mean_ttft_ms": ms, "failed": failed,
                "request_rate": 3.0, "composition": [8] * 5, "final_composition": [8] * 5,
                "reconfigurations": []}

    results = [r("homogeneous-cp4", 1208.0, 46), r("homogeneous-cp8", 21577.0, 0),
               r("static-threshold", 115222.0, 0), r("vertumnus", 2335.0, 0)]
    (got,) = cells(results, "p", "m")
    assert (got["best_baseline"], got["best_ms"], got["failed"]) == ("homogeneous-cp8", 21577.0,
                                                                     [0, 0])
    assert got["change"] == pytest.approx(2335 / 21577 - 1)
    assert got["faster"] == {"system": "homogeneous-cp4", "mean_ttft_ms": 1208.0, "failed": 46,
                             "change": pytest.approx(2335 / 1208 - 1)}
    md = markdown([got])
    assert md[2].endswith("| -89.2% | 0, 0 | - | `homogeneous-cp4`: +93.3% (46) |")
    assert md[-1] == ("1 of 1 cells within 2% of the best baseline, 1 below it; in 1 a faster "
                      "baseline failed more requests (`vertumnus` within 2% of it in 0).")
    # vertumnus failing more than the best baseline is counted too
    results[-1]["failed"] = 50
    (got,) = cells(results, "p", "m")
    assert got["best_baseline"] == "homogeneous-cp4" and got["faster"] is None
    assert markdown([got])[-1] == ("0 of 1 cells within 2% of the best baseline, 0 below it; "
                                   "in 1 `vertumnus` failed more requests than the best "
                                   "baseline.")


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
                                 "2 without a result; in 1 `vertumnus` failed more requests "
                                 "than the best baseline.")


def test_parts_filter_runs_only_the_named_parts(tmp_path, monkeypatch):
    import eval.robustness as rb

    ran, loaded = [], []
    loaders = {"code (Azure code), first half": ("code", lambda: loaded.append("code") or []),
               "stand-in: short prompts (Poisson)": (
                   "synthetic", lambda: loaded.append("short") or [])}
    monkeypatch.setattr(rb, "part_loaders", lambda d, q, s=1: loaders)

    def fake_sweep(reqs, wname, cfg):
        ran.append((wname, cfg.load_factors, cfg.num_gpus, cfg.gpu))
        return [{"system": s, "load_factor": lf, "mean_ttft_ms": 100.0, "request_rate": 1.0,
                 "composition": [4], "final_composition": [4], "reconfigurations": []}
                for lf in cfg.load_factors for s in cfg.systems], None

    monkeypatch.setattr(rb, "run_sweep", fake_sweep)
    rows = rb.run(str(tmp_path), str(tmp_path / "out"), ["qwen3-32b"], [], False, [" STAND-IN "])
    assert ran == [("synthetic", (0.6, 0.9, 1.2, 1.5), 40, "h20")] and loaded == ["short"]
    assert {r["part"] for r in rows} == {"stand-in: short prompts (Poisson)"}
    assert all(r["change"] == 0.0 for r in rows)
    # the files say what the run was
    saved = json.loads((tmp_path / "out" / "robustness.json").read_text())
    assert saved["cells"] == rows and saved["settings"] == {
        "models": ["qwen3-32b"], "seeds": [], "quick": False,
        "parts": ["stand-in: short prompts (Poisson)"], "all_parts": False, "num_gpus": 40,
        "draw_seed": 1, "gpu": "h20"}
    assert (tmp_path / "out" / "robustness.md").read_text().splitlines()[0] == (
        "Run: models qwen3-32b; parts stand-in: short prompts (Poisson); re-run under noise "
        "seeds none.")
    # another pool size: every sweep on it, and the files say so
    ran.clear()
    rb.run(str(tmp_path), str(tmp_path / "out16"), ["qwen3-32b"], [], False, ["stand-in"], 16)
    assert ran == [("synthetic", (0.6, 0.9, 1.2, 1.5), 16, "h20")]
    assert (tmp_path / "out16" / "robustness.md").read_text().startswith(
        "Run: pools of 16 GPUs (the comparison's: 40), models qwen3-32b;")
    for gpus, models in ((4, ["qwen3-32b"]), (0, ["qwen3-32b"]), (12, ["qwen3-32b"]),
                         (12, ["qwen3-30b-a3b", "qwen3-32b"]), (6, ["qwen3-30b-a3b"]),
                         (2048, ["qwen3-30b-a3b"]), (10**20, ["qwen3-30b-a3b"])):
        with pytest.raises(ValueError, match=r"--num_gpus must be a multiple of [48] "):
            rb.run(str(tmp_path), str(tmp_path / "bad"), models, [], False, [], gpus)
    assert not (tmp_path / "bad").exists()  # refused before the output folder is made
    for seed in (0, -1, 2 ** 63, True, 1.5, "2"):  # (0: eval.paper's own draw)
        with pytest.raises(ValueError, match=r"--draw_seed must be an integer in \[1, 2\*\*63\)"):
            rb.run(str(tmp_path), str(tmp_path / "bad"), ["qwen3-32b"], [], False, [], 40, seed)
    assert not (tmp_path / "bad").exists()
    # another draw: the sweeps get the seed's parts, and the files say so
    seen = []
    monkeypatch.setattr(rb, "part_loaders", lambda d, q, s=1: seen.append(s) or loaders)
    rb.run(str(tmp_path), str(tmp_path / "out2"), ["qwen3-32b"], [], False, ["stand-in"], 40, 2)
    assert seen == [2] and json.loads((tmp_path / "out2" / "robustness.json").read_text())[
        "settings"]["draw_seed"] == 2
    assert (tmp_path / "out2" / "robustness.md").read_text().startswith(
        "Run: drawn parts with seed 2 (the committed run's: 1), models qwen3-32b;")
    # another GPU profile: every sweep on it, and the files say so
    ran.clear()
    rb.run(str(tmp_path), str(tmp_path / "outh"), ["qwen3-32b"], [], False, ["stand-in"], 40, 1,
           "h100")
    assert ran == [("synthetic", (0.6, 0.9, 1.2, 1.5), 40, "h100")]
    assert json.loads((tmp_path / "outh" / "robustness.json").read_text())["settings"][
        "gpu"] == "h100"
    assert (tmp_path / "outh" / "robustness.md").read_text().startswith(
        "Run: GPU profile h100 (the comparison's: h20), models qwen3-32b;")
    for gpu in ("H100", "a100", "", None, 100):
        with pytest.raises(ValueError, match=r"--gpu must be one of \['h100', 'h20', "):
            rb.run(str(tmp_path), str(tmp_path / "bad"), ["qwen3-32b"], [], False, [], 40, 1, gpu)
    assert not (tmp_path / "bad").exists()
    for bad, message in ((["nothing"], r"--parts \['nothing'\] matches none of the parts: \["),
                         (["stand-in", "stnad-in"], r"matches no part for \['stnad-in'\]: \["),
                         ([" ", ""], r"has only blank entries"),
                         ("stand-in", r"only must be a sequence of strings, not the string")):
        with pytest.raises(ValueError, match=message):
            rb.run(str(tmp_path), str(tmp_path / "bad"), ["qwen3-32b"], [], False, bad)
    assert not (tmp_path / "bad").exists()  # refused before the output folder is made
    assert rb.select(loaders, None) == rb.select(loaders, []) == loaders


def test_every_part_has_load_factors_and_reads_nothing_until_built(tmp_path):
    from eval.paper_setup import LOADS
    from eval.robustness import part_loaders

    loaders = part_loaders(str(tmp_path / "no traces here"), quick=True)  # (no file is read)
    assert len(loaders) == 14 and all(w in LOADS for w, _ in loaders.values())
    assert loaders["stand-in: one system prompt"][0] == "synthetic-prefix"
    assert len(loaders["stand-in: mid-length prompts"][1]()) == 1500  # --quick: QUICK_REQUESTS
    # another draw seed: the drawn parts' names say it, and their requests differ
    other = part_loaders(str(tmp_path / "no traces here"), quick=True, draw_seed=2)
    assert "toolagent, generated with seed 2" in other and "toolagent, generated with seed 1" \
        not in other and len(other) == 14
    a = loaders["stand-in: short prompts (Poisson)"][1]()
    b = other["stand-in: short prompts (Poisson)"][1]()
    assert [r.input_len for r in a] != [r.input_len for r in b]
