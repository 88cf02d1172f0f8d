"""Baseline systems, the `module:attribute` plug-in point, TP charging and an all-systems sweep."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import pytest

from eval.experiment import ReplayConfig, run_sweep
from eval.systems import PoolConfig, System, build_system, mixed_degrees
from eval.traces.workloads import tool_agent_workload
from serving.baselines import (DynamoKvRouter, MooncakeConductorRouter, SglangCacheAwareRouter,
                               StaticThresholdRouter, VllmPrefixAwareRouter)
from serving.policy.plugins import PluginError, guard_callable, router_from_spec
from serving.policy.prefix_index import PrefixIndex
from serving.policy.queue_order import FCFS, SJF, QueueOrder
from serving.policy.profiles import analytic_prefill_seconds
from serving.policy.request import Request, chain_block_hashes
from serving.policy.router import LeastWorkRouter
from serving.policy.specs import GPUS, MODELS
from tests.eval.plugin_example import ExampleRouter

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLUGIN = "tests.eval.plugin_example"
POOL = PoolConfig(16, 100, lambda c: 65536, None, (2, 4), kv_bytes_per_token=98304,
                  kv_transfer_gb_per_s=25.0)
ALL_SYSTEMS = ("homogeneous", "leastwork-cp4", "vertumnus", "static-threshold", "vllm-tp4",
               "sglang-cp4", "dynamo-cp4", "mooncake-cp4", f"{PLUGIN}:ExampleRouter")


@pytest.mark.parametrize("name, composition, router, parallelism", [
    ("static-threshold", [4, 4, 2, 2, 2, 2], StaticThresholdRouter, "cp"),
    ("vllm-tp4", [4] * 4, VllmPrefixAwareRouter, "tp"),
    ("sglang-cp4", [4] * 4, SglangCacheAwareRouter, "cp"),
    ("dynamo-cp4", [4] * 4, DynamoKvRouter, "cp"),
    ("mooncake-cp4", [4] * 4, MooncakeConductorRouter, "cp"),
])
def test_baseline_systems_fill_the_gpu_budget(name, composition, router, parallelism):
    s = build_system(name, POOL)
    assert s.name == name and s.composition == composition and sum(s.composition) == 16
    assert isinstance(s.router, router) and s.parallelism == parallelism
    assert all(w.max_input_len == 65536 and w.kv_capacity_blocks == 100 * w.cp_degree
               for w in s.workers)
    assert build_system(name, POOL).router is not s.router      # a fresh router per build


@pytest.mark.parametrize("name, order", [
    ("vertumnus", SJF), ("vertumnus-fetch", SJF), ("vertumnus-fcfs", FCFS),
    ("vertumnus-gated-sjf", QueueOrder("gated-sjf")), ("vertumnus-paper", FCFS),
    ("homogeneous-cp4", FCFS),
])
def test_queue_order_of_each_system(name, order):
    # the default starts the shortest predicted prefill first; its FCFS ablation, the paper's
    # policy and the baselines first come, first served (serving.policy.queue_order)
    assert getattr(build_system(name, POOL).router, "queue_order", FCFS) == order


def test_mooncake_system_prices_copies_with_the_pool_kv_size():
    r = build_system("mooncake-cp4", POOL).router
    assert (r.kv_bytes_per_token, r.transfer_gb_per_s) == (98304, 25.0)
    assert r.transfer_seconds(10, 512) == pytest.approx(10 * 512 * 98304 / 25e9)


def test_plugin_router_class_and_factory():
    s = build_system(f"{PLUGIN}:ExampleRouter", POOL)
    assert s.name == f"{PLUGIN}:ExampleRouter" and isinstance(s.router, ExampleRouter)
    assert s.composition == mixed_degrees(16, (2, 4)) == [4, 4, 2, 2, 2, 2]
    assert build_system(f"{PLUGIN}:ExampleRouter", POOL).router is not s.router
    f = build_system(f"{PLUGIN}:example_system", POOL)
    assert f.name == "example-smallest" and f.composition == [2] * 8
    assert isinstance(f.router, ExampleRouter)


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:Router", "system 'no_such_module_xyz:Router': cannot import module"),
    (f"{PLUGIN}:Missing", "has no attribute 'Missing'"),
    (f"{PLUGIN}:NOT_A_SYSTEM", "neither a router class nor a factory"),
    (f"{PLUGIN}:bad_factory", "returned str, not eval.systems.System"),
    (f"{PLUGIN}:ROUTER_INSTANCE", "is a router instance"),
    (f"{PLUGIN}:", "must be named 'module:attribute'"),
    ("nope", "unknown system 'nope'"),
])
def test_bad_plugin_specs_name_the_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        build_system(spec, POOL)


@pytest.mark.parametrize("spec, cause, message", [
    (f"{PLUGIN}:CrashingRouter", KeyError,
     r"system 'tests.eval.plugin_example:CrashingRouter': router class 'CrashingRouter' raised "
     r"KeyError: 'missing' \(at .*plugin_example\.py:\d+ in __init__\)$"),
    (f"{PLUGIN}:crashing_factory", ZeroDivisionError,
     r"system 'tests.eval.plugin_example:crashing_factory': factory 'crashing_factory' raised "
     r"ZeroDivisionError: division by zero \(at .*plugin_example\.py:\d+ in crashing_factory\)$"),
    (f"{PLUGIN}:no_arg_factory", type(None),
     r"factory 'no_arg_factory' must be callable with 1 positional argument\(s\) \(too many "
     r"positional arguments\)$"),
])
def test_plugins_raising_anything_are_reported_naming_spec_and_exception(spec, cause, message):
    with pytest.raises(ValueError, match=message) as e:
        build_system(spec, POOL)
    assert type(e.value.__cause__) is cause  # the programming error stays chained


def test_plugin_module_failing_at_import_and_router_specs(tmp_path, monkeypatch):
    (tmp_path / "h4_boom_plugin.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^system 'h4_boom_plugin:R': importing module "
                                         r"'h4_boom_plugin' raised RuntimeError: no GPU here "
                                         r"\(at .*h4_boom_plugin\.py:1 in <module>\)$"):
        build_system("h4_boom_plugin:R", POOL)
    with pytest.raises(ValueError, match=r"^router 'tests.eval.plugin_example:CrashingRouter': "
                                         r"router class 'CrashingRouter' raised KeyError"):
        router_from_spec(f"{PLUGIN}:CrashingRouter")


def test_cli_reports_a_crashing_plugin_without_a_traceback(tmp_path):
    cmd = [sys.executable, "-m", "eval.replay", "--workload_duration=10", "--num_gpus=8",
           f"--systems={PLUGIN}:crashing_factory", f"--output_dir={tmp_path}", "--progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: system '{PLUGIN}:crashing_factory': factory "
                                  f"'crashing_factory' raised ZeroDivisionError: division by zero")


AT = r" \(at .*plugin_example\.py:\d+ in {}\)$"


@pytest.mark.parametrize("attr, message", [
    ("exiting_factory", r"SystemExit\(0\)"),
    ("base_exception_factory", r"Boom: custom BaseException"),
    ("json_factory", r"JSONDecodeError: Expecting property name enclosed in double quotes: "
                     r"line 1 column 2 \(char 1\)"),  # the plug-in's line, not json's
    ("bad_str_factory", r"BadStr: <cannot be shown: str\(\) raised RuntimeError>"),
])
def test_plugins_ending_in_any_exception_are_one_line_errors(attr, message):
    with pytest.raises(PluginError, match=rf"^system '{re.escape(PLUGIN)}:{attr}': factory "
                                          rf"'{attr}' raised {message}" + AT.format(attr)) as e:
        build_system(f"{PLUGIN}:{attr}", POOL)
    assert "\n" not in str(e.value)


def test_plain_value_errors_pass_and_ctrl_c_stops():
    with pytest.raises(ValueError) as e:
        build_system(f"{PLUGIN}:value_error_factory", POOL)
    assert type(e.value) is ValueError and str(e.value) == "this plug-in needs --degrees=2,4"
    with pytest.raises(KeyboardInterrupt):
        build_system(f"{PLUGIN}:interrupted_factory", POOL)


@pytest.mark.parametrize("attr, message", [
    ("ChooseCrashRouter", r"router ChooseCrashRouter\.choose raised KeyError: 'x'"
                          + AT.format("choose")),
    ("OutOfRangeRouter", r"router OutOfRangeRouter\.choose returned (\d+), not an index into "
                         r"its \1 candidates \(0 to \d+\)$"),
    ("TickCrashRouter", r"tick hook TickCrashRouter\.on_tick raised ValueError: tick failed"
                        + AT.format("on_tick")),
    ("SlotsCrashRouter", r"router SlotsCrashRouter\.choose raised RuntimeError: slots choose "
                         r"failed" + AT.format("choose")),
    ("setup_crash_system", r"setup setup_crash_system\.<locals>\.setup raised RuntimeError: "
                           r"setup failed" + AT.format("setup")),
])
def test_plugin_code_failing_during_the_replay_names_the_system(attr, message):
    cfg = ReplayConfig(num_gpus=8, degrees=(2, 4), systems=(f"{PLUGIN}:{attr}",), rates=(2.0,))
    with pytest.raises(PluginError, match=rf"^system '{re.escape(PLUGIN)}:{attr}': {message}"):
        run_sweep(tool_agent_workload(duration_s=10.0, seed=1), "t", cfg)


def test_every_hook_a_plugin_adds_to_the_scheduler_is_guarded():
    # A plug-in's setup adds a hook to each of the scheduler's hook lists; each one that fails
    # is a one-line PluginError naming the system and the hook (the re-carve hook included).
    names = ("tick_hooks", "submit_hooks", "placement_hooks", "dispatch_hooks", "refused_hooks",
             "reconfigured_hooks")
    sched = type("Sched", (), {n: None for n in names})()
    for n in names:
        setattr(sched, n, [])

    def fails(*args):
        raise RuntimeError("hook failed")

    def setup(scheduler):
        for n in names:
            getattr(scheduler, n).append(fails)

    guard_callable("pkg:sys", "system", "setup", setup, binds=True)(sched)
    for n in names:
        [hook] = getattr(sched, n)
        with pytest.raises(PluginError, match=rf"^system 'pkg:sys': {n[:-1].replace('_', ' ')} "
                                              r".*fails raised RuntimeError: hook failed"):
            hook(sched, 0.0)


def test_guards_keep_the_plugin_router_and_leave_our_code_alone():
    s = build_system(f"{PLUGIN}:ExampleRouter", POOL)
    assert type(s.router) is ExampleRouter and "choose" in vars(s.router)  # guarded in place
    t = build_system(f"{PLUGIN}:setup_crash_system", POOL)  # a built-in router: not guarded
    assert type(t.router) is LeastWorkRouter and "choose" not in vars(t.router)
    assert t.make_prefix_index is PrefixIndex
    assert guard_callable("x:y", "system", "hook", mixed_degrees) is mixed_degrees
    assert build_system(f"{PLUGIN}:SlotsCrashRouter", POOL).router.name == "slots"  # a proxy


@pytest.mark.parametrize("attr, message", [
    ("exiting_factory", "factory 'exiting_factory' raised SystemExit(0) (at "),  # was exit 0
    ("ChooseCrashRouter", "router ChooseCrashRouter.choose raised KeyError: 'x' (at "),
])
def test_cli_reports_plugin_failures_in_one_line(tmp_path, attr, message):
    cmd = [sys.executable, "-m", "eval.replay", "--workload_duration=10", "--num_gpus=8",
           "--rates=2", f"--systems={PLUGIN}:{attr}", f"--output_dir={tmp_path}",
           "--progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: system '{PLUGIN}:{attr}': {message}")


def test_system_rejects_unknown_parallelism():
    with pytest.raises(ValueError, match="parallelism='pp'"):
        System("x", [], ExampleRouter(), parallelism="pp")


def test_tp_system_is_charged_and_sized_as_tp():
    # Two cold 8192-token requests 100 s apart: each runs alone on an idle worker.
    two = [Request(f"r{i}", 100.0 * i, 8192, 1, chain_block_hashes(range(100 * i, 100 * i + 16)),
                   512) for i in range(2)]
    cfg = ReplayConfig(num_gpus=8, degrees=(4,), systems=("vllm-tp4", "homogeneous-cp4"),
                       rates=(0.01,), noise_sigma=0.0)
    results, env = run_sweep(two, "two", cfg)
    tp, cp = (analytic_prefill_seconds("h20", "qwen3-30b-a3b", 4, 8192, 0, p) for p in ("tp", "cp"))
    assert abs(tp - cp) > 0.01 * cp                   # the two profiles really differ here
    by = {r["system"]: r for r in results}
    assert by["vllm-tp4"]["mean_prefill_ms"] == pytest.approx(tp * 1e3, rel=1e-12)
    assert by["homogeneous-cp4"]["mean_prefill_ms"] == pytest.approx(cp * 1e3, rel=1e-12)
    assert (by["vllm-tp4"]["parallelism"], by["homogeneous-cp4"]["parallelism"]) == ("tp", "cp")
    assert by["vllm-tp4"]["profile"] == "analytic-tp"
    assert env.cost_model_for("tp").predict(4, 8192, 0) == pytest.approx(tp, rel=0.05)
    # TP-4 shards the weights 4 ways: a worker holds (HBM * 0.9 - W / 4) * min(4, kv_heads)
    # / kv_bytes_per_token tokens, against HBM * 0.9 - W for a CP rank.
    m, g = MODELS["qwen3-30b-a3b"], GPUS["h20"]
    tp_tokens = ((g.hbm_gb * 0.9e9 - m.weight_bytes / 4) * min(4, m.num_kv_heads)
                 / m.kv_bytes_per_token)
    assert env.pools["tp"].kv_blocks_per_gpu * 4 * 512 == pytest.approx(tp_tokens, abs=4 * 512)
    assert env.pools["tp"].kv_blocks_per_gpu > env.pools["cp"].kv_blocks_per_gpu


def test_sweep_over_every_system_ends_each_request_once():
    workload = tool_agent_workload(duration_s=60.0, seed=5)
    cfg = ReplayConfig(num_gpus=16, degrees=(2, 4), systems=ALL_SYSTEMS, load_factors=(0.9,))
    seen: dict[str, list] = {}
    results, _ = run_sweep(workload, "t", cfg,
                           on_records=lambda name, rate, recs: seen.setdefault(name, recs))
    names = cfg.system_names
    assert [r["system"] for r in results] == names and len(names) == 10
    ids = sorted(r.request_id for r in workload)
    for name in names:
        assert sorted(rec.request.request_id for rec in seen[name]) == ids, name
        assert all(rec.ok for rec in seen[name]), name
    assert len({r["mean_ttft_ms"] for r in results}) > 5   # the rules really differ


def test_replay_cli_accepts_a_plugin_router(tmp_path):
    cmd = [sys.executable, "-m", "eval.replay", "--workload_duration=30", "--num_gpus=8",
           "--degrees=2,4", "--rates=2", f"--systems={PLUGIN}:ExampleRouter,dynamo-cp4",
           f"--output_dir={tmp_path}", "--progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"| {PLUGIN}:ExampleRouter | 2.00 |" in proc.stdout
    assert list(tmp_path.glob(f"toolagent__{PLUGIN}_ExampleRouter__rate2*.json"))  # ":" -> "_"


def test_the_initial_choice_is_recorded_with_the_candidates_it_beat(monkeypatch):
    # A replay that scored five options (hand-made): the System keeps them ranked by failed
    # requests, then predicted mean TTFT, and the choice is the first.
    import eval.systems as systems
    from eval.system_types import Demand
    from eval.systems import vertumnus_system

    scores = {((4, 4, 4, 4), "cost"): (0, 0.30), ((4, 4, 4, 4), "fetch"): (0, 0.20),
              ((4, 4, 2, 2, 2, 2), "cost"): (1, 0.10), ((4, 4, 2, 2, 2, 2), "fetch"): (0, 0.25),
              ((4, 2, 2, 2, 2, 2, 2), "cost-degree"): (0, 0.20),
              ((2, 2, 2, 2, 2, 2, 2, 2), "cost"): (10, float("inf"))}  # nothing served
    monkeypatch.setattr(systems, "replay_choice",
                        lambda *a, **k: ([4, 4, 4, 4], "fetch", dict(scores)))
    sample = tuple(Request(f"r{i}", 0.1 * i, 600, 1, chain_block_hashes([i, 1000 + i]), 512)
                   for i in range(10))
    demand = Demand(1.0, lambda c: 0.1, 600, tuple((r.arrival_time, 600, 0) for r in sample),
                    sample)
    system = vertumnus_system(dataclasses.replace(POOL, demand=demand))
    choice = system.initial_choice
    assert system.composition == [4, 4, 4, 4] and type(system.router).__name__ == (
        "FetchingVertumnusRouter")
    assert (choice["method"], choice["composition"], choice["router"], choice["compared"]) == (
        "replay", [4, 4, 4, 4], "fetch", 6)
    assert [(c["composition"], c["router"], c["failed"], c["predicted_mean_ttft_s"])
            for c in choice["candidates"]] == [
        ([4, 4, 4, 4], "fetch", 0, 0.20), ([4, 2, 2, 2, 2, 2, 2], "cost-degree", 0, 0.20),
        ([4, 4, 2, 2, 2, 2], "fetch", 0, 0.25), ([4, 4, 4, 4], "cost", 0, 0.30),
        ([4, 4, 2, 2, 2, 2], "cost", 1, 0.10), ([2, 2, 2, 2, 2, 2, 2, 2], "cost", 10, None)]
    json.dumps(choice, allow_nan=False)  # as `eval.replay` writes it
    # The queueing replay ("whatif") counts no failures, and its choice (the first listed of
    # those within 0.1 % of the best) is listed first even when another predicts less.
    monkeypatch.setattr(systems, "choose_initial", lambda *a, **k: (
        [4, 4, 4, 4], {(4, 4, 4, 4): 0.2010, (4, 4, 2, 2, 2, 2): 0.2009, (4, 2, 2, 2, 2, 2, 2): 0.3}))
    model = type("Flat", (), {"predict": staticmethod(lambda c, n, h: 0.1)})()
    choice = vertumnus_system(dataclasses.replace(POOL, demand=demand, cost_model=model),
                              initial="whatif").initial_choice
    assert (choice["method"], choice["composition"], choice["compared"]) == (
        "whatif", [4, 4, 4, 4], 3)
    assert [(c["composition"], c["failed"], c["predicted_mean_ttft_s"])
            for c in choice["candidates"]] == [([4, 4, 4, 4], None, 0.2010),
                                               ([4, 4, 2, 2, 2, 2], None, 0.2009),
                                               ([4, 2, 2, 2, 2, 2, 2], None, 0.3)]


def test_a_sweep_reports_how_each_start_was_chosen():
    from eval.report import initial_choice_lines

    workload = tool_agent_workload(duration_s=30.0, seed=5)
    cfg = ReplayConfig(num_gpus=16, degrees=(2, 4), load_factors=(0.9,),
                       systems=("vertumnus", "vertumnus-paper", "homogeneous-cp4"))
    by = {r["system"]: r for r in run_sweep(workload, "t", cfg)[0]}
    ours, paper = by["vertumnus"]["initial_choice"], by["vertumnus-paper"]["initial_choice"]
    assert by["homogeneous-cp4"]["initial_choice"] is None  # a fixed pool: nothing chosen
    assert paper == {"method": "paper", "composition": by["vertumnus-paper"]["composition"],
                     "router": "cost"}
    first = ours["candidates"][0]
    assert (ours["method"], first["composition"], first["router"]) == (
        "replay", by["vertumnus"]["composition"], ours["router"])
    keys = [(c["failed"], c["predicted_mean_ttft_s"]) for c in ours["candidates"]]
    assert keys == sorted(keys) and ours["compared"] >= len(keys) > 1
    [line] = initial_choice_lines(list(by.values()))
    assert line.startswith(f"vertumnus at {by['vertumnus']['request_rate']:.4g} req/s starts "
                           f"from {first['composition']} with the {first['router']} rule, "
                           f"chosen by replay among {ours['compared']} options")
    assert f"{first['predicted_mean_ttft_s'] * 1e3:.0f} ms" in line
