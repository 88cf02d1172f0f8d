"""End-to-end replay: determinism, the CLI's outputs, capacity-rate definition."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from eval.experiment import ReplayConfig, ReplayEnv, run_sweep
from eval.traces.workloads import tool_agent_workload

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workload():
    return tool_agent_workload(duration_s=90.0, seed=3)


def test_same_seed_same_results_and_noise_changes_them(workload):
    cfg = ReplayConfig(num_gpus=16, degrees=(2, 4), load_factors=(0.8,), seed=11)
    a, _ = run_sweep(workload, "t", cfg)
    b, _ = run_sweep(workload, "t", cfg)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c, _ = run_sweep(workload, "t", ReplayConfig(num_gpus=16, degrees=(2, 4), load_factors=(0.8,),
                                                 seed=12))
    assert [r["mean_ttft_ms"] for r in a] != [r["mean_ttft_ms"] for r in c]
    assert [r["system"] for r in a] == ["homogeneous-cp2", "homogeneous-cp4"]
    assert [r["composition"] for r in a] == [[2] * 8, [4] * 4]
    for r in a:
        assert r["completed"] + r["failed"] == len(workload)


def test_capacity_rate_matches_definition(workload):
    cfg = ReplayConfig(num_gpus=8, degrees=(2,), noise_sigma=0.0)
    env = ReplayEnv.build(cfg, 512, {2})
    truth = env.ground_truth(cfg)
    gpu_seconds = sum(2 * truth.seconds(2, r.input_len, 0) for r in workload)
    assert env.capacity_rate(workload, 2) == pytest.approx(8 * len(workload) / gpu_seconds)
    # SLO reference: the largest degree of the run, cold, plus transfer and first token.
    assert env.isolated_ttft(8192) == pytest.approx(
        truth.seconds(2, 8192, 0) + env.sim.first_token_seconds
        + 8192 * env.sim.kv_bytes_per_token / (env.sim.kv_transfer_gb_per_s * 1e9))


def test_the_demand_sample_grows_with_the_pool(workload, monkeypatch):
    # 25 requests per GPU, never fewer than 4,000 (a trace's warm-up); a sweep samples that
    # many (the first ones, at the run's rate) for the replayed initial choice, at most half of
    # the run's requests (568 here: 284).
    assert [ReplayConfig(num_gpus=g).sample_size for g in (8, 40, 160, 161, 400)] == [
        4000, 4000, 4000, 4025, 10000]
    # closed-loop sessions keep theirs: 25 per GPU, at least 1,000
    assert [ReplayConfig(num_gpus=g).session_sample_size for g in (8, 40, 41, 80)] == [
        1000, 1000, 1025, 2000]
    seen = []
    real = ReplayEnv.demand

    def demand(self, requests, rate, sample_size=1000, sample=None):
        seen.append(sample_size)
        return real(self, requests, rate, sample_size, sample)

    monkeypatch.setattr(ReplayEnv, "demand", demand)
    cfg = ReplayConfig(num_gpus=168, degrees=(2, 4), load_factors=(0.8,), systems=("vertumnus",))
    run_sweep(workload, "t", cfg)
    assert len(workload) == 568 and seen == [284]
    monkeypatch.setattr("eval.replay_config.MIN_SAMPLE", 100)  # (so the config's size binds)
    run_sweep(workload, "t", dataclasses.replace(cfg, num_gpus=8))
    assert seen == [284, 200]  # 25 x 8 GPUs
    reqs = workload * 3  # (ids repeat: which requests, not their order, is checked)
    d = real(ReplayEnv.build(cfg, 512, {2, 4}), reqs, 5.0, 1200)  # (any size: the first ones)
    assert len(d.requests) == 1200 < len(reqs)
    assert sorted(r.request_id for r in d.requests) == sorted(r.request_id for r in reqs[:1200])


def test_open_loop_sample_is_the_config_size_at_most_half_the_run():
    cfg = ReplayConfig(num_gpus=40)  # sample_size 4,000
    assert [cfg.open_loop_sample_size(n) for n in (1, 2, 3, 5000, 8000, 8001, 10**6)] == [
        1, 1, 1, 2500, 4000, 4000, 4000]
    assert ReplayConfig(num_gpus=400).open_loop_sample_size(10**6) == 10000
    assert cfg.open_loop_sample_size(np.int64(5000)) == 2500
    for bad in (0, -3, 2.0, True, "10"):
        with pytest.raises(ValueError, match="run_requests"):
            cfg.open_loop_sample_size(bad)


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="gpu='a100x'"):
        ReplayConfig(gpu="a100x")
    with pytest.raises(ValueError, match="rates"):
        ReplayConfig(rates=(1.0, -2.0))
    with pytest.raises(ValueError, match="slo="):
        ReplayConfig(slo="scale:-1")
    with pytest.raises(ValueError, match="unknown system 'nope'"):
        run_sweep(tool_agent_workload(duration_s=10.0), "t", ReplayConfig(systems=("nope",)))
    with pytest.raises(ValueError, match="num_devices=6 must be a positive multiple of cp_degree=4"):
        run_sweep(tool_agent_workload(duration_s=10.0), "t", ReplayConfig(num_gpus=6, degrees=(4,)))


def test_cli_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "eval.replay", "--workload_duration=60", "--num_gpus=8",
           "--degrees=2,4", "--rates=3,6", f"--output_dir={out}", "--progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| homogeneous-cp4 | 6.00 |" in proc.stdout
    files = sorted(p.name for p in out.iterdir())
    assert {"toolagent__summary.md", "toolagent__summary.json", "toolagent.png"} <= set(files)
    run = json.loads((out / "toolagent__homogeneous-cp2__rate3.json").read_text())
    for key in ("completed", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                "request_goodput", "slo_attainment", "token_weighted_slo_attainment",
                "total_cached_tokens", "composition"):
        assert key in run
    assert run["request_rate"] == 3.0 and run["composition"] == [2, 2, 2, 2]


def test_cli_rejects_bad_flag_values(tmp_path):
    cmd = [sys.executable, "-m", "eval.replay", "--workload_duration=10", "--slo=fast",
           f"--output_dir={tmp_path}", "--progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "error: slo='fast'" in proc.stderr
    assert "USAGE" not in proc.stderr  # the message, not a page of usage text


def test_cli_native_rate_keeps_arrival_times(tmp_path):
    cmd = [sys.executable, "-m", "eval.replay", "--workload_duration=60", "--num_gpus=8",
           "--degrees=4", "--rates=native", "--systems=homogeneous", f"--output_dir={tmp_path}",
           "--progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [result] = json.loads((tmp_path / "toolagent__summary.json").read_text())
    native = tool_agent_workload(duration_s=60.0, seed=0)
    assert result["request_rate"] == pytest.approx((len(native) - 1) / (
        native[-1].arrival_time - native[0].arrival_time))


def test_slo_reference_is_the_largest_listed_degree_whatever_the_systems(workload):
    alone = ReplayEnv.build(ReplayConfig(num_gpus=8, degrees=(2, 4)), 512, {2})
    both = ReplayEnv.build(ReplayConfig(num_gpus=8, degrees=(2, 4)), 512, {2, 4})
    assert alone.reference_degree == both.reference_degree == 4
    assert alone.isolated_ttft(5000) == pytest.approx(both.isolated_ttft(5000))


def test_a_measured_profile_that_stops_at_90_percent_warns_naming_rows(tmp_path):
    from serving.policy.profiles import generate_profile, write_profile_csv
    path = tmp_path / "p.csv"
    write_profile_csv(generate_profile("h20", "qwen3-30b-a3b", (2,), (1024, 8192, 65536),
                                       (0.0, 0.5, 0.9), edge=False), path)
    cfg = ReplayConfig(num_gpus=8, degrees=(2,), profile_csv=str(path))
    # L = 1024: 0.9 L is within 1 % + 512 tokens of L (a block's rounding): covered.
    with pytest.warns(UserWarning, match=r"2 profile rows stop below a 99% cached fraction: "
                                         r"C=2 L=8192 \(to 89.99%\), C=2 L=65536 \(to 90.00%\)"):
        ReplayEnv.build(cfg, 512, {2})
    # measured as vertumnus_jax.profile does (0.99, rounded down to 512-token blocks): no warning
    from serving.policy.profiles import ProfileTable
    rows = [(2, L, h, 0.1 + L * 1e-6 - h * 1e-6) for L in (8192, 65536)
            for h in (0, (int(0.5 * L) // 512) * 512, (int(0.99 * L) // 512) * 512)]
    import numpy as np
    write_profile_csv(ProfileTable(*(np.asarray(c) for c in zip(*rows))), path)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReplayEnv.build(cfg, 512, {2})


def test_cli_replays_agent_sessions_closed_loop(tmp_path):
    # Two sessions of three requests; the replay starts session instances at load factors of
    # the session capacity rate and reports sessions/s, the closed-loop mode and the pool load.
    folder = tmp_path / "agents"
    folder.mkdir()
    for k in range(2):
        ids = list(range(1, 81))
        reqs = [{"t": 10.0 * j, "type": "n", "in": 64 * (40 + 20 * j), "out": 50,
                 "hash_ids": ids[:40 + 20 * j], "think_time": 5.0} for j in range(3)]
        (folder / f"s{k}.json").write_text(json.dumps(
            {"id": f"s{k}", "block_size": 64, "tool_tokens": 640, "system_tokens": 0,
             "requests": reqs}))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "eval.replay", f"--trace={folder}", "--num_gpus=8",
           "--degrees=2,4", "--load_factors=0.1,0.5", "--session_window_s=600",
           "--systems=homogeneous", f"--output_dir={out}", "--progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "2 sessions" in proc.stdout and "closed-loop" in proc.stdout
    runs = json.loads((out / "agents__summary.json").read_text())
    assert len(runs) == 4
    for r in runs:
        assert r["replay"] == "closed-loop" and r["session_window_s"] == 600.0
        assert r["request_rate"] == pytest.approx(3 * r["session_rate"])
        assert r["failed"] == 0 and r["num_requests"] % 3 == 0 and 0 < r["gpu_busy_fraction"] < 1
    low, high = runs[0], runs[1]
    assert high["session_rate"] == pytest.approx(5 * low["session_rate"])
    assert high["num_requests"] > 2 * low["num_requests"]
    bad = subprocess.run(cmd + ["--rates=native"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "native does not apply to agent sessions" in bad.stderr


def _replay(tmp_path, *flags):
    cmd = [sys.executable, "-m", "eval.replay", "--num_gpus=8", "--degrees=2",
           "--systems=homogeneous", f"--output_dir={tmp_path / 'out'}", "--progress=false", *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _line(ms: int) -> str:
    return json.dumps({"timestamp": ms, "input_length": 600, "output_length": 5,
                       "hash_ids": [1, 2]})


def test_cli_native_rate_needs_two_arrivals(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(_line(0) + "\n")
    proc = _replay(tmp_path, f"--trace={one}", "--rates=native")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "nan" not in proc.stderr
    assert proc.stderr == (f"error: --rates=native: the trace {one} has 1 arrival; it needs at "
                           f"least two arrivals at different times to have a native rate (give "
                           f"--rates in req/s, or --load_factors)\n")
    same = tmp_path / "same.jsonl"
    same.write_text(_line(5) + "\n" + _line(5) + "\n")
    proc = _replay(tmp_path, f"--trace={same}", "--rates=native")
    assert proc.returncode == 1
    assert f"the trace {same} has 2 arrivals, all at the same time;" in proc.stderr


def test_cli_reports_deep_fifo_and_device_traces_without_a_traceback(tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text("\n".join([_line(0), "[" * 1200 + "]" * 1200, _line(1000)]) + "\n")
    proc = _replay(tmp_path, f"--trace={deep}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"error: {deep}, line 2, field 'json': arrays and objects nested more "
                           f"than 100 levels deep (eval.traces.parsing.MAX_JSON_DEPTH)\n")
    proc = _replay(tmp_path, f"--trace={deep}", "--skip_malformed", "--rates=1")
    assert proc.returncode == 0, proc.stderr
    assert f"skipped 1 malformed lines of {deep}" in proc.stdout
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    proc = _replay(tmp_path, f"--trace={fifo}")  # used to block forever in open()
    assert (proc.returncode, proc.stderr) == (
        1, f"error: {fifo}: is a FIFO: a trace must be a regular file\n")
    proc = _replay(tmp_path, "--trace=mooncake:/dev/zero")  # used to end in MemoryError
    assert (proc.returncode, proc.stderr) == (
        1, "error: /dev/zero: is a character device: a trace must be a regular file\n")
