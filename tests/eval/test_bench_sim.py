"""`python -m eval.bench_sim` on a small seeded trace: its JSON agrees with its own timings."""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _write_trace(path: pathlib.Path, n: int = 200) -> None:
    """`n` Mooncake rows (seeded): conversations sharing a first block, 512-token blocks."""
    rng = np.random.default_rng(11)
    rows = []
    for i in range(n):
        blocks = int(rng.integers(1, 9))
        own = list(range(1000 * i + 1, 1000 * i + blocks))  # this request's own blocks
        rows.append(json.dumps({"timestamp": 500 * i, "input_length": 512 * blocks - 7,
                                "output_length": 8, "hash_ids": [0, *own]}))
    path.write_text("\n".join(rows) + "\n")


def test_cli_times_every_system_and_reports_warmup_apart(tmp_path):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "bench.json"
    _write_trace(trace)
    cmd = [sys.executable, "-m", "eval.bench_sim", f"--trace={trace}", "--repeats=2",
           "--warmup_runs=1", "--systems=vertumnus,leastwork-cp4", f"--output_json={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["repeats"] == 2 and report["warmup_runs"] == 1
    assert [r["system"] for r in report["results"]] == ["vertumnus", "leastwork-cp4"]
    for r in report["results"]:
        assert r["requests"] == 200
        assert len(r["wall_s_all"]) == 2 and len(r["wall_s_warmup"]) == 1
        assert r["wall_s_median"] == statistics.median(r["wall_s_all"])
        assert r["simulated_requests_per_s"] == 200 / r["wall_s_median"]
        assert r["simulated_requests_per_s_best"] == 200 / min(r["wall_s_all"])
        assert f"| {r['system']} | 200 |" in proc.stdout
    assert "the target of 20,000 simulated req/s" in proc.stdout


def test_cli_rejects_missing_trace_and_bad_counts(tmp_path):
    missing = [sys.executable, "-m", "eval.bench_sim", f"--trace={tmp_path / 'none.jsonl'}"]
    proc = subprocess.run(missing, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "not found" in proc.stderr
    bad = [sys.executable, "-m", "eval.bench_sim", "--warmup_runs=-1"]
    proc = subprocess.run(bad, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "warmup_runs" in proc.stderr
