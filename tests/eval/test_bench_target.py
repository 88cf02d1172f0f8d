"""`python -m eval.bench_target`: its rows against the listing, and a bad pool size refused."""

from __future__ import annotations

import json
import subprocess
import sys

from serving.policy.controller import compositions


def test_rows_count_the_compositions_and_the_listing_is_never_beaten(tmp_path):
    out = tmp_path / "b.json"
    run = subprocess.run([sys.executable, "-m", "eval.bench_target", "--gpus=16,32",
                          "--requests=60", "--repeats=1", "--list_up_to=100",
                          f"--output_json={out}"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["gpus"], r["compositions"]) for r in rows] == [
        (g, len(compositions(g, (1, 2, 4, 8)))) for g in (16, 32)]
    assert "listed_ms" in rows[0] and "listed_ms" not in rows[1]  # 35 listed, 165 not
    assert rows[0]["listed_ttft_s"] <= rows[0]["searched_ttft_s"]
    assert all(sum(r["searched"]) == r["gpus"] for r in rows)
    assert "| 16 | 35 |" in run.stdout and "| 32 | 165 | not run |" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "eval.bench_target", "--gpus=12",
                          f"--output_json={out}"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "multiples of the largest degree 8" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "eval.bench_target", "--degrees=0,3",
                          f"--output_json={out}"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--degrees must be powers of two >= 1" in bad.stderr
