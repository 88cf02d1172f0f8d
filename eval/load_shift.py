"""A load shift the initial choice cannot see: `python -m eval.load_shift`.

Issue 15's overload case (1-3K-token prompts at 90 req/s on 16 GPUs, which two CP-8 workers
cannot serve; the issue measured the paper's controller leaving them there) arrives here after
a quiet phase that favours large degrees, so the controller, not the starting point, must
react:

1. `long-light`: 24K-token prompts (lognormal, sigma 0.3, 12K-48K) at `--light_rate` req/s for
   `--light_s` seconds: large degrees serve these fastest, so the replayed initial choice
   (sampled from this phase, as `eval.paper`'s reconfiguration part does) and the controller
   keep or make large workers;
2. `short-heavy`: 2K-token prompts (sigma 0.3, 1K-3K) at each of `--heavy_rates` req/s for
   `--heavy_s` seconds: CP-8 workers serve about 63 a second, CP-4 82, CP-2 96 (16 GPUs,
   Qwen3-30B-A3B on H20, the analytic profile), so the pool must split, and fast.

Every prompt is new content (`eval.traces.synthetic`, seeds 1 and 2); 16 GPUs, degrees {2, 4,
8}. Prints one table per heavy rate (mean and P90 TTFT per phase, the reconfigurations) and
writes it beside the JSON (`.md`; the JSON also holds, per system with the what-if
controller, each evaluation that made a change with the candidates it compared and their
figures, `controller_changes`: null for the other systems); about 20 s. Shapes and rates
were chosen once to reproduce the issue's case; no constant of the policy was tuned on it
(the controller's overload rule was changed after a first run of it: eval/RESULTS.md, "What
changed in the policy", item 11).
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import app, flags

from eval.experiment import ReplayConfig, ReplayEnv, run_parallel_degrees, simulate_system
from eval.metrics import summarize
from eval.slo import SloSpec, assign_slos
from eval.traces.scenarios import Phase, phase_of, phased_workload, summarize_phases
from eval.traces.synthetic import SyntheticConfig, synthetic_workload
from serving.policy.composition import CompositionController

SYSTEMS = ("homogeneous-cp2", "homogeneous-cp4", "homogeneous-cp8", "leastwork-cp2",
           "mooncake-cp4", "static-threshold", "vertumnus-paper", "vertumnus")
LONG = SyntheticConfig(num_requests=4000, median_input_len=24_000, sigma=0.3,
                       min_input_len=12_000, max_input_len=48_000)
SHORT = SyntheticConfig(num_requests=40_000, median_input_len=2000, sigma=0.3,
                        min_input_len=1000, max_input_len=3000)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags (defined only when run as a program, so that importing this
    module beside `eval.bench_sim` or `eval.paper`, which have flags of the same names, is
    fine)."""
    flags.DEFINE_list("heavy_rates", ["70", "90", "110"], "Rates of the heavy phase (req/s).")
    flags.DEFINE_float("light_rate", 1.0, "Rate of the light phase (req/s), > 0.")
    flags.DEFINE_float("light_s", 900.0, "Light phase length (s), > 0.")
    flags.DEFINE_float("heavy_s", 180.0, "Heavy phase length (s), > 0.")
    flags.DEFINE_list("systems", list(SYSTEMS), "Systems to compare.")
    flags.DEFINE_string("output_json", "out/load_shift.json", "Where the JSON goes.")


def controller_changes(system) -> list[dict] | None:
    """The evaluations of `system`'s what-if controller (`CompositionController.decisions`)
    that made a change (one evaluation may make several: `further`): time (s), the first
    change's `kind`, `old`, `new`, `epoch`, the others in `further`, what was chosen, why, and
    the candidates compared with their figures (`[label, value]`; None where the log has NaN
    or an infinity); None for a system without that controller (`vertumnus-paper`'s threshold
    controller logs its changes in `reconfigurations` only)."""
    ctl = next((f.__self__ for f in system.setup
                if isinstance(getattr(f, "__self__", None), CompositionController)), None)
    if ctl is None:
        return None
    keys = ("time", "kind", "old", "new", "epoch", "further", "chosen", "reason", "candidates")
    return [{k: d[k] for k in keys} for d in ctl.log(changes_only=True)]


def run(heavy_rates, light_rate: float, light_s: float, heavy_s: float,
        systems=SYSTEMS) -> tuple[dict, list[str]]:
    """Simulates every system at every heavy rate; returns `(JSON data, markdown lines)`.

    Raises:
      ValueError: a rate or length not finite and > 0, or an unknown system.
    """
    if not heavy_rates or not systems:
        raise ValueError(f"--heavy_rates and --systems must name at least one value, got "
                         f"{list(heavy_rates)}, {list(systems)}")
    for name, v in [("light_rate", light_rate), ("light_s", light_s), ("heavy_s", heavy_s)] + [
            ("heavy_rates", r) for r in heavy_rates]:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{name} must be finite and > 0, got {v}")
    # the phases draw from fixed pools of prompts: refuse what would run them dry (a phase
    # cut short without a word)
    if light_rate * light_s > LONG.num_requests:
        raise ValueError(f"--light_rate x --light_s must be <= {LONG.num_requests} requests, "
                         f"got {light_rate * light_s:g}")
    if max(heavy_rates) * heavy_s > SHORT.num_requests:
        raise ValueError(f"--heavy_rates x --heavy_s must be <= {SHORT.num_requests} requests, "
                         f"got {max(heavy_rates) * heavy_s:g}")
    heavy_rates = list(dict.fromkeys(heavy_rates))  # (repeats dropped)
    systems = list(dict.fromkeys(systems))
    cfg = ReplayConfig(num_gpus=16, degrees=(2, 4, 8), systems=tuple(systems))
    try:
        run_parallel_degrees(cfg)  # builds each system once on a probe pool
    except ValueError as e:
        raise ValueError(f"--systems: {e}") from None
    env = ReplayEnv.build(cfg, 512, {2, 4, 8})
    long, short = synthetic_workload(LONG, seed=1), synthetic_workload(SHORT, seed=2)
    data, md = {}, []
    for rate in heavy_rates:
        phases = [Phase("long-light", long, light_rate, light_s),
                  Phase("short-heavy", short, rate, heavy_s)]
        reqs = assign_slos(phased_workload(phases), SloSpec.parse(cfg.slo), env.isolated_ttft)
        first = [r for r in reqs if phase_of(r.request_id) == "long-light"]
        md += [f"### heavy phase at {rate:g} req/s", "",
               "| system | long-light mean / P90 (ms) | short-heavy mean / P90 (ms) | overall "
               "mean (ms) | composition: start -> end | reconfigurations |",
               "|---|---|---|---|---|---|"]
        at = data[f"{rate:g}"] = {}
        for name in systems:
            system = env.build_system(name, env.demand(
                first, light_rate, cfg.open_loop_sample_size(len(reqs))))
            records, sched = simulate_system(env, cfg, system, reqs)
            per = summarize_phases(records, phases)
            overall = summarize(records)
            log = [{k: x[k] for k in ("kind", "started", "finished", "composition")}
                   for x in sched.reconfig.log]
            at[name] = {"phases": per, "overall": overall, "composition": system.composition,
                        "final_composition": sched.composition, "reconfigurations": log,
                        "controller_changes": controller_changes(system)}
            a, b = per["long-light"], per["short-heavy"]
            md.append(f"| {name} | {a['mean_ttft_ms']:.0f} / {a['p90_ttft_ms']:.0f} | "
                      f"{b['mean_ttft_ms']:.0f} / {b['p90_ttft_ms']:.0f} | "
                      f"{overall['mean_ttft_ms']:.0f} | {system.composition} -> "
                      f"{sched.composition} | " + ", ".join(
                          f"{x['kind']} {x['started']:.0f} s" for x in log[:10])
                      + (" ..." if len(log) > 10 else "") + " |")
        md.append("")
    return data, md


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        try:
            rates = [float(r) for r in FLAGS.heavy_rates]
        except ValueError:
            raise ValueError(f"--heavy_rates must be numbers (req/s), got "
                             f"{FLAGS.heavy_rates}") from None
        data, md = run(rates, FLAGS.light_rate, FLAGS.light_s, FLAGS.heavy_s, FLAGS.systems)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print("\n".join(md))
    out = FLAGS.output_json
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"settings": {"heavy_rates": rates, "light_rate": FLAGS.light_rate,
                                "light_s": FLAGS.light_s, "heavy_s": FLAGS.heavy_s},
                   "results": data}, f, indent=1, allow_nan=False)
    md_path = os.path.splitext(out)[0] + ".md"
    with open(md_path, "w") as f:
        f.write("\n".join(["# Load shift (generated by `python -m eval.load_shift`)", ""] + md))
    print(f"wrote {out} and {md_path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
