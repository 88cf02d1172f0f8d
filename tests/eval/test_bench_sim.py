"""`python -m eval.bench_sim`: the timing rounds, the verdict, and the CLI on a seeded trace."""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys

import numpy as np
import pytest

from eval.bench_sim import TARGET_REQ_PER_S, check_output_path, time_rounds, verdict

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_warmup_rounds_come_first_and_building_is_not_timed():
    # A fake clock: building a system costs 100 s, simulating system s in round k costs
    # (k + 1) * {"a": 1, "b": 10}[s] seconds; so each recorded time names its round.
    now = [0.0]
    rounds = {"a": 0, "b": 0}

    def build(name):
        now[0] += 100.0
        return name

    def simulate(name):
        rounds[name] += 1
        now[0] += rounds[name] * {"a": 1.0, "b": 10.0}[name]
        return 1

    warmup, timed = time_rounds(["a", "b"], build, simulate, warmup_rounds=2, repeats=3,
                                clock=lambda: now[0])
    assert warmup == {"a": [1.0, 2.0], "b": [10.0, 20.0]}
    assert timed == {"a": [3.0, 4.0, 5.0], "b": [30.0, 40.0, 50.0]}
    warmup, timed = time_rounds(["a"], build, simulate, warmup_rounds=0, repeats=1,
                                clock=lambda: now[0])
    assert warmup == {"a": []} and timed == {"a": [6.0]}


def _row(best, median, requests=12_031):
    return {"requests": requests, "simulated_requests_per_s_best": best,
            "simulated_requests_per_s": median}


def test_verdict_judges_the_best_run_and_the_median_on_the_target_workload_only():
    trace = "/x/mooncake/conversation_trace.jsonl"
    line = verdict(_row(TARGET_REQ_PER_S, TARGET_REQ_PER_S - 1), trace, 0.9)
    assert line.startswith("vertumnus meets the target") and "best run (20,000)" in line
    assert line.endswith("median 19,999 (misses)")
    assert verdict(_row(19_999.5, 25_000.0), trace, 0.9).startswith("vertumnus misses")
    for args in ((_row(3e4, 3e4), "/x/other.jsonl", 0.9), (_row(3e4, 3e4, 500), trace, 0.9),
                 (_row(3e4, 3e4), trace, 1.6)):
        assert verdict(*args).startswith("no verdict")


def _write_trace(path: pathlib.Path, n: int = 200) -> None:
    """`n` Mooncake rows (seeded): requests sharing a first block, 512-token blocks."""
    rng = np.random.default_rng(11)
    rows = []
    for i in range(n):
        blocks = int(rng.integers(1, 9))
        own = list(range(1000 * i + 1, 1000 * i + blocks))  # this request's own blocks
        rows.append(json.dumps({"timestamp": 500 * i, "input_length": 512 * blocks - 7,
                                "output_length": 8, "hash_ids": [0, *own]}))
    path.write_text("\n".join(rows) + "\n")


def _bench(tmp_path, *flags):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "sub" / "bench.json"
    if not trace.exists():
        _write_trace(trace)
    cmd = [sys.executable, "-m", "eval.bench_sim", f"--trace={trace}", f"--output_json={out}",
           *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def _table(stdout: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in stdout.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]
            if cells[0] not in ("system", "---")}


def test_cli_table_and_json_agree(tmp_path):
    stdout, report = _bench(tmp_path, "--repeats=2", "--warmup_rounds=2",
                            "--systems=vertumnus,leastwork-cp4,vertumnus")
    assert report["repeats"] == 2 and report["warmup_rounds"] == 2
    assert [r["system"] for r in report["results"]] == ["vertumnus", "leastwork-cp4"]
    table = _table(stdout)
    rates = {r["request_rate"] for r in report["results"]}
    assert len(rates) == 1  # one workload for every system
    for r in report["results"]:
        assert r["requests"] == 200
        assert len(r["wall_s_all"]) == 2 and len(r["wall_s_warmup"]) == 2
        median, best = statistics.median(r["wall_s_all"]), min(r["wall_s_all"])
        assert r["wall_s_median"] == median
        assert r["simulated_requests_per_s"] == 200 / median
        assert r["simulated_requests_per_s_best"] == 200 / best
        assert table[r["system"]] == [
            "200", f"{r['request_rate']:.2f}", f"{median:.3f}", f"{200 / median:,.0f}",
            f"{200 / best:,.0f}", f"{200 / r['wall_s_warmup'][0]:,.0f}"]
    assert "no verdict: the 20,000 simulated req/s target" in stdout  # not the target trace
    assert report["verdict"].startswith("no verdict") and report["verdict"] in stdout


def test_cli_without_warmup_and_rate_independent_of_the_systems(tmp_path):
    stdout, report = _bench(tmp_path, "--repeats=1", "--warmup_rounds=0", "--systems=leastwork-cp4")
    (row,) = report["results"]
    assert row["wall_s_warmup"] == [] and len(row["wall_s_all"]) == 1
    assert _table(stdout)["leastwork-cp4"][-1] == "-"
    _, both = _bench(tmp_path, "--repeats=1", "--warmup_rounds=0",
                     "--systems=vertumnus,leastwork-cp4")
    assert row["request_rate"] == both["results"][1]["request_rate"]


@pytest.mark.parametrize("flag, message", [
    ("--load_factor=nan", "--load_factor must be finite"),
    ("--systems=", "--systems must name at least one system"),
])
def test_cli_rejects_bad_flags_before_timing(tmp_path, flag, message):
    cmd = [sys.executable, "-m", "eval.bench_sim", f"--trace={tmp_path / 'none.jsonl'}", flag]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unwritable_output_is_refused_before_timing(tmp_path):
    (tmp_path / "f").write_text("a file where the folder should be")
    for path, message in (("", "must name a file"), (str(tmp_path), "is a directory"),
                          (str(tmp_path / "f" / "o.json"), "cannot create its folder")):
        with pytest.raises(ValueError, match=message):
            check_output_path(path)
    check_output_path(str(tmp_path / "new" / "o.json"))  # a missing folder is made
    assert (tmp_path / "new").is_dir()


def test_cli_names_the_trace_in_its_errors(tmp_path):
    missing = [sys.executable, "-m", "eval.bench_sim", f"--trace={tmp_path / 'none.jsonl'}",
               f"--output_json={tmp_path / 'o.json'}"]
    proc = subprocess.run(missing, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "not found" in proc.stderr
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5,
                               "hash_ids": [1, 2]}) + "\n")
    proc = subprocess.run([*missing[:3], f"--trace={one}", missing[4]], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and f"--trace={one}:" in proc.stderr
