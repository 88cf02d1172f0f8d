"""Tests for `python -m vertumnus_jax.gpu_check`: its dry run on the CPU (interpret mode, tiny
shapes, tiny model, 2x2 grid) writes every file, the profile CSV reads back with the cost
model's reader, and the pieces a GPU run depends on (FLOP count, tolerance check, scaling,
budget, error recording, flags) hold on hand-made cases."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from vertumnus_jax import (gpu_check, gpu_check_kernel, gpu_check_profile, gpu_check_report,
                           gpu_check_timing)
from serving.policy.profiles import read_profile_csv

FILES = ("results.json", "results.md", "summary.txt", "profile.csv", "profile_measured.csv")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run for the module; a generous budget so a loaded machine skips nothing."""
    out = tmp_path_factory.mktemp("gpu_check")
    data = gpu_check.run_check(gpu_check.dry_run_config(out_dir=str(out), budget_s=900.0))
    return out, data


def test_dry_run_writes_every_file(dry_run, capsys):
    out, data = dry_run
    for name in FILES:
        assert (out / name).is_file(), name
    on_disk = json.loads((out / "results.json").read_text())
    assert set(on_disk["parts"]) == {"kernel", "timing", "profile"}
    assert on_disk["environment"]["backend"] == "cpu"
    assert "jax" in on_disk["environment"]["versions"]
    for name, part in on_disk["parts"].items():
        assert part["status"] == "done", (name, part.get("error"))
    summary = (out / "summary.txt").read_text()
    assert "targets:" in summary and len(summary.splitlines()) <= 50
    assert "## Kernel vs reference" in (out / "results.md").read_text()


def test_dry_run_kernel_cases_pass(dry_run):
    kernel = dry_run[1]["parts"]["kernel"]
    names = [c["name"] for c in kernel["cases"]]
    assert names == ["causal", "cached_prefix", "zigzag", "gqa_d64", "padding"]
    assert all(c["pass"] for c in kernel["cases"]), kernel["cases"]
    padding = kernel["cases"][-1]
    assert padding["empty_rows"] > 0 and padding["empty_rows_ok"]
    assert dry_run[1]["targets"][0]["pass"] is True


def test_dry_run_timing_reports_a_failing_implementation(dry_run):
    cases = dry_run[1]["parts"]["timing"]["cases"]
    assert [c["case"] for c in cases] == ["causal 256", "128 after 256"]
    for c in cases:
        assert c["impls"]["pallas"]["ms"] > 0 and c["impls"]["xla"]["ms"] > 0
        assert c["impls"]["pallas"]["compile_s"] > 0
        assert "error" in c["impls"]["cudnn"]  # no cuDNN on a CPU: reported, not fatal
        assert c["fastest_reference"] == "xla" and c["ratio"] > 0
        assert c["max_abs_diff_vs_xla"] < 0.05
    assert cases[1]["flops"] == 4 * 64 * 4 * (128 * 256 + 128 * 129 // 2)


def test_dry_run_profile_csv_reads_back(dry_run):
    out, data = dry_run
    prof = data["parts"]["profile"]
    measured = read_profile_csv(out / "profile_measured.csv")
    scaled = read_profile_csv(out / "profile.csv")
    assert len(scaled.seconds) == len(measured.seconds) == 4  # the 2x2 grid
    assert set(np.asarray(scaled.cp).tolist()) == {1}
    assert sorted(set(np.asarray(scaled.input_len).tolist())) == [32, 64]
    assert set(np.asarray(scaled.cached_len).tolist()) == {0, 16, 32}
    # Measured at 2 layers, scaled to 4: more time, at most twice as much.
    assert np.all(np.asarray(scaled.seconds) >= np.asarray(measured.seconds))
    assert np.all(np.asarray(scaled.seconds) <= 2 * np.asarray(measured.seconds) + 1e-12)
    assert prof["measured_layers"] == 2 and prof["target_layers"] == 4
    assert prof["probe"]["1"]["layers"] == 1 and "1" in prof["fixed_overhead"]


def test_flop_counter_hand_computed():
    n = 300
    pos = np.arange(n)[None]
    assert gpu_check_timing.causal_pairs(pos, pos) == n * (n + 1) // 2
    # 4 new tokens after 28 cached: each sees the 28 cached keys and 1..4 new ones.
    q_pos, kv_pos = np.arange(28, 32)[None], np.arange(32)[None]
    assert gpu_check_timing.causal_pairs(q_pos, kv_pos) == 4 * 28 + 10
    assert gpu_check_timing.attention_flops(q_pos, kv_pos, 32, 128) == 4 * 128 * 32 * 122
    # Padding on both sides: queries 5, 7 and a padding row; key 3 padded: 5 + 7 + 0 pairs.
    assert gpu_check_timing.causal_pairs([[5, 7, -1]], [[0, 1, 2, -1, 4, 5, 6, 7]]) == 12
    # Causal 16K at Qwen3-8B heads: 4 * 128 * 32 * 16384 * 16385 / 2 = 2.2e12 FLOPs.
    assert gpu_check_timing.attention_flops(
        np.arange(16384)[None], np.arange(16384)[None], 32, 128) == 2 * 128 * 32 * 16384 * 16385


def _reference_case():
    """A reference-like (out, lse) pair: bf16-representable outputs, LSEs, and two rows that see
    nothing (LSE -inf, output zero)."""
    rng = np.random.default_rng(3)
    out = rng.standard_normal((2, 8, 2, 16)).astype(np.float32)
    out = np.asarray(jnp.asarray(out, jnp.bfloat16), np.float32)
    lse = (rng.standard_normal((2, 8, 2)) + 3.0).astype(np.float32)
    lse[0, 5, :] = -np.inf
    out[0, 5] = 0.0
    return out, lse


def test_tolerance_check_catches_a_wrong_kernel_output():
    out, lse = _reference_case()
    good = gpu_check_kernel.check_tolerance(out, lse, out, lse, "bfloat16")
    assert good["pass"] and good["max_abs_err"] == 0.0 and good["empty_rows_ok"]
    finite = np.argwhere(np.isfinite(lse))[0]
    wrong = out.copy()
    wrong[tuple(finite)][0] += 0.25  # one element off by far more than bf16 rounding
    res = gpu_check_kernel.check_tolerance(wrong, lse, out, lse, "bfloat16")
    assert not res["pass"] and res["max_abs_err"] == pytest.approx(0.25, rel=1e-3)
    assert res["worst_ratio"] > 1
    nan = out.copy()
    nan[tuple(finite)][0] = np.nan
    assert not gpu_check_kernel.check_tolerance(nan, lse, out, lse, "bfloat16")["pass"]
    shifted = lse.copy()
    shifted[tuple(finite)] += 0.05  # the softmax normaliser off by 5 %
    assert not gpu_check_kernel.check_tolerance(out, shifted, out, lse, "bfloat16")["pass"]
    empty = tuple(np.argwhere(np.isneginf(lse))[0])
    filled = lse.copy()
    filled[empty] = 0.0  # a row that sees nothing got a finite LSE
    res = gpu_check_kernel.check_tolerance(out, filled, out, lse, "bfloat16")
    assert not res["pass"] and not res["empty_rows_ok"]
    leaked = out.copy()
    leaked[empty][0] = 1e-3  # ... or a nonzero output
    assert not gpu_check_kernel.check_tolerance(leaked, lse, out, lse, "bfloat16")["pass"]
    # Within tolerance: every element off by a bf16 rounding step passes.
    assert gpu_check_kernel.check_tolerance(out * (1 + 2 ** -8), lse, out, lse,
                                            "bfloat16")["pass"]
    # ... but an output scaled by 1.02 fails (wherever |ref| > 2), and so does an LSE off by 5e-3
    assert np.abs(out).max() > 2.5
    assert not gpu_check_kernel.check_tolerance(out * 1.02, lse, out, lse, "bfloat16")["pass"]
    assert not gpu_check_kernel.check_tolerance(out, lse + 5e-3, out, lse, "bfloat16")["pass"]
    # One bf16 step of the output (2^-7 |ref| at a power of two) uses at most ~half the bound.
    ref = np.asarray([2.0, 4.0, 8.0, 0.5], np.float32)[None, :, None, None]
    res = gpu_check_kernel.check_tolerance(ref * (1 + 2 ** -7), np.zeros((1, 4, 1)), ref,
                                           np.zeros((1, 4, 1)), "bfloat16")
    assert res["pass"] and res["worst_ratio"] < 0.53


def test_scaling_to_full_depth():
    assert gpu_check_profile.coarse_to_fine([4, 1, 2, 8, 16, 32]) == [1, 32, 4, 2, 8, 16]
    # T(1 layer) = 3 ms, T(4 layers) = 9 ms: 2 ms per layer, F = 1 ms; 36 layers: 73 ms.
    f, per_layer = gpu_check_profile.fixed_overhead(9e-3, 3e-3, 4, 1)
    assert f == pytest.approx(1e-3) and per_layer == pytest.approx(2e-3)
    assert gpu_check_profile.scale_seconds(9e-3, f, 4, 36) == pytest.approx(73e-3)
    assert gpu_check_profile.scale_seconds(9e-3, None, 4, 36) == pytest.approx(81e-3)
    assert gpu_check_profile.fixed_overhead(9e-3, 9.5e-3, 4, 1)[0] == pytest.approx(9e-3)


def test_a_failing_part_is_recorded_and_the_budget_stops_items(tmp_path):
    cfg = gpu_check.dry_run_config(out_dir=str(tmp_path), parts=("kernel", "profile"),
                                   profile_model="no-such-model", budget_s=0.0)
    data = gpu_check.run_check(cfg)
    kernel, prof = data["parts"]["kernel"], data["parts"]["profile"]
    assert kernel["status"] == "partial" and len(kernel["skipped"]) == 5  # out of budget
    assert prof["status"] == "error" and "no-such-model" in prof["error"]
    assert "Traceback" in prof["traceback"]
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["parts"]["profile"]["status"] == "error"
    assert "profile: ValueError" in (tmp_path / "summary.txt").read_text()
    with pytest.raises(ValueError, match="unknown parts"):
        gpu_check.run_check(gpu_check.dry_run_config(out_dir=str(tmp_path), parts=("bogus",)))


def test_a_part_run_alone_gets_the_whole_budget(tmp_path, capsys):
    # kernel's share is 40 % in a dry run; alone, it may use all 30 s of the budget
    cfg = gpu_check.dry_run_config(out_dir=str(tmp_path), parts=("kernel",), budget_s=30.0)
    gpu_check.run_check(cfg, gpu_check.Deadline(30.0))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("== kernel"))
    left, part = (int(x) for x in re.findall(r"(\d+) s", line))
    assert part == left >= 29


def test_flags_build_the_config():
    fv = flags.FlagValues()
    gpu_check.define_flags(fv)
    fv(["gpu_check", "--dry_run", "--only=kernel,profile", "--profile_lens=32,64",
        "--profile_fracs=0,0.5", "--budget_s=30", "--out_dir=/tmp/x"])
    cfg = gpu_check.config_from_flags(fv)
    assert cfg.dry_run and cfg.interpret and cfg.parts == ("kernel", "profile")
    assert cfg.profile_lens == (32, 64) and cfg.profile_fracs == (0.0, 0.5)
    assert cfg.budget_s == 30.0 and cfg.out_dir == "/tmp/x"
    fv = flags.FlagValues()
    gpu_check.define_flags(fv)
    fv(["gpu_check"])
    cfg = gpu_check.config_from_flags(fv)
    assert not cfg.interpret and cfg.profile_model == "qwen3-8b" and cfg.profile_layers == 4
    assert cfg.timing_causal == (4096, 16384, 32768) and cfg.timing_prefix == ((4096, 28672),)
    assert cfg.timing_heads == (32, 8, 128) and cfg.budget_s < 480
    assert cfg.out_dir.startswith("pallas_kernels/results/gpu_check-")
    fv = flags.FlagValues()
    gpu_check.define_flags(fv)
    fv(["gpu_check", "--dry_run", "--output_dir=/tmp/y"])  # the other tools' name for it
    assert gpu_check.config_from_flags(fv).out_dir == "/tmp/y"
    fv = flags.FlagValues()
    gpu_check.define_flags(fv)
    fv(["gpu_check", "--out_dir=/tmp/x", "--output_dir=/tmp/y"])  # which one? refused
    with pytest.raises(SystemExit, match="once: --out_dir or its alias --output_dir"):
        gpu_check.config_from_flags(fv)


def test_gpu_targets_fail_on_a_failing_kernel():
    err = {"error": "XlaRuntimeError: INTERNAL: Triton compilation failed: out of resource"}
    timing = {"interpret": False, "status": "done", "cases": [
        {"case": "causal 16384", "new": 16384, "cached": 0, "impls": {
            "pallas": err, "cudnn": {"ms": 10.0, "tflops": 220.0}, "xla": {"ms": 30.0}}},
        {"case": "causal 4096", "new": 4096, "cached": 0, "impls": {
            "pallas": {"ms": 1.0, "tflops": 300.0}, "cudnn": {"ms": 1.0}}, "ratio": 1.0}]}
    data = {"config": {"dry_run": False, "interpret": False}, "parts": {
        "kernel": {"status": "error", "error": "RuntimeError: boom"}, "timing": timing}}
    kernel, tflops, ratio, prof = gpu_check_report.targets(data)
    assert kernel["pass"] is False and "boom" in kernel["value"]
    assert tflops["pass"] is False and "Triton" in tflops["value"]
    assert ratio["pass"] is False and "pallas failed on 1 case" in ratio["value"]
    assert "no reference ran" not in ratio["value"] and prof["pass"] is None
    # No 16K case on a GPU run: FAIL "not measured", never judged on a smaller stand-in.
    timing["cases"] = timing["cases"][1:]
    _, tflops, ratio, _ = gpu_check_report.targets(data)
    assert tflops["pass"] is False and "not measured" in tflops["value"]
    assert "stand-in" not in tflops["name"] and ratio["pass"] is True
    # The timing part failing before its first case is a FAIL too ...
    data["parts"]["timing"] = {"status": "error", "error": "MemoryError: inputs"}
    _, tflops, ratio, _ = gpu_check_report.targets(data)
    assert tflops["pass"] is False and ratio["pass"] is False and "MemoryError" in ratio["value"]
    # ... and in a dry run (interpret mode) the performance targets are only shown.
    data["config"] = {"dry_run": True, "interpret": True}
    data["parts"]["timing"] = dict(timing, interpret=True)
    _, tflops, ratio, _ = gpu_check_report.targets(data)
    assert tflops["pass"] is None and ratio["pass"] is None and "stand-in" in tflops["name"]


def test_zero_budget_skips_the_profile_before_building_anything(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(gpu_check_profile, "_worker", lambda *a: built.append(a))
    cfg = gpu_check.dry_run_config(out_dir=str(tmp_path), parts=("profile",), budget_s=0.0)
    data = gpu_check.run_check(cfg)
    prof = data["parts"]["profile"]
    assert built == [] and prof["status"] == "partial" and prof["points"] == []
    assert "out of budget" in prof["probe"]["1"]["skipped"]
    assert len(prof["skipped"]) == 4 and all("reason" in p for p in prof["skipped"])
    summary = (tmp_path / "summary.txt").read_text()
    assert "profile.csv" not in summary and not (tmp_path / "profile.csv").exists()


def test_sigterm_writes_the_report_and_exits_nonzero(tmp_path):
    out = tmp_path / "run"
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "vertumnus_jax.gpu_check", "--dry_run",
                             f"--out_dir={out}"], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the kernel part is under way
            try:
                parts = json.loads((out / "results.json").read_text())["parts"]
            except (OSError, ValueError, KeyError):
                parts = {}
            if parts.get("kernel", {}).get("cases"):
                break
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, log
    data = json.loads((out / "results.json").read_text())
    assert data["interrupted"] == "SIGTERM" and "targets" in data, log
    statuses = {name: p["status"] for name, p in data["parts"].items()}
    assert "interrupted" in statuses.values() and "running" not in statuses.values(), statuses
    summary = (out / "summary.txt").read_text()
    assert "INTERRUPTED by SIGTERM" in summary and "targets:" in summary
    assert (out / "results.md").is_file()
