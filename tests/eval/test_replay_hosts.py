"""`eval.replay` on hosts (issue 19): --gpus_per_host, --scaleout_gb_per_s, --fail_host."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

from eval.experiment import ReplayConfig, run_sweep
from eval.replay_config import parse_host_failures
from eval.sim.simulator import SimConfig
from eval.traces.workloads import tool_agent_workload

ROOT = pathlib.Path(__file__).resolve().parents[2]


def hosts(**kw):
    return SimConfig(**{"gpus_per_host": 8, **kw})


def test_host_settings_are_checked_naming_the_flag():
    with pytest.raises(ValueError, match="--gpus_per_host=8 must divide --num_gpus=12"):
        ReplayConfig(num_gpus=12, degrees=(4,), sim=hosts())
    with pytest.raises(ValueError, match=r"--degrees \[16\] would make workers span hosts of "
                                         r"--gpus_per_host=8"):
        ReplayConfig(num_gpus=32, degrees=(8, 16), sim=hosts())
    with pytest.raises(ValueError, match=r"--fail_host: host\(s\) \[5\] do not exist; the pool "
                                         r"has hosts 0..4"):
        ReplayConfig(num_gpus=40, degrees=(4,), sim=hosts(host_failures=((5, 1.0, None),)))
    assert parse_host_failures(["2@30", "0@1.5:60"]) == ((2, 30.0, None), (0, 1.5, 60.0))
    for bad in ("2", "x@3", "1@2:y"):
        with pytest.raises(ValueError, match="--fail_host must be H@T or H@T:B"):
            parse_host_failures([bad])


def test_forty_gpus_on_five_hosts_with_a_failure_report_it():
    work = tool_agent_workload(duration_s=60.0, seed=2)
    base = ReplayConfig(num_gpus=40, degrees=(2, 8), systems=("homogeneous", "vertumnus"),
                        load_factors=(1.2,))
    plain, _ = run_sweep(work, "t", base)
    assert not any("num_hosts" in r or "host_events" in r for r in plain)  # one host: as before
    cfg = dataclasses.replace(base, sim=hosts(host_failures=((1, 10.0, 30.0),)))
    results, _ = run_sweep(work, "t", cfg)
    for r in results:
        assert r["num_hosts"] == 5 and r["gpus_per_host"] == 8 and r["scaleout_gb_per_s"] == 25.0
        assert [e["kind"] for e in r["host_events"]] == ["lost", "added"]
        assert r["host_events"][0]["hosts"] == [1] and r["host_events"][0]["gpus"] == 8
        assert r["completed"] + r["failed"] == len(work)
        assert r["failed"] == r["requests_failed_by_host_loss"]


def test_cli_flags(tmp_path):
    cmd = [sys.executable, "-m", "eval.replay", "--workload_duration=30", "--num_gpus=16",
           "--degrees=2,4", "--systems=homogeneous", "--rates=20", "--gpus_per_host=8",
           "--scaleout_gb_per_s=12.5", "--fail_host=1@5:10", f"--output_dir={tmp_path}",
           "--progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = json.loads((tmp_path / "toolagent__homogeneous-cp4__rate20.json").read_text())
    assert run["num_hosts"] == 2 and run["scaleout_gb_per_s"] == 12.5
    assert [e["kind"] for e in run["host_events"]] == ["lost", "added"]
    bad = subprocess.run(cmd[:-3] + ["--degrees=16", "--num_gpus=32", f"--output_dir={tmp_path}",
                                     "--progress=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--gpus_per_host=8" in bad.stderr
