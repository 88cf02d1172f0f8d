"""The comparison on parts of the workloads, `python -m eval.robustness`.

A policy is also judged on traces we do not have, so a result that holds only on the shared
traces does not count. This runs `vertumnus` against the baselines of `eval.paper` on *parts*
of its workloads, each a workload the comparison never ran whole:

- the first and second half (by arrival) of the Mooncake conversation and synthetic traces and
  of the Azure code trace, each re-timed from 0 and swept at the comparison's load factors of
  its own capacity rate;
- the agent session files taken alternately in name order (first, third, ... and second,
  fourth, ...), 80 sessions each;
- Tool-Agent and the L-Eval CSV drawn with seed 1 (the comparison uses 0; `--draw_seed`);
- four synthetic stand-ins for production traffic we have no trace of
  (`eval.traces.synthetic.SYNTHETIC`, drawn with the same seed: one-off short prompts under Poisson
  and bursty arrivals, one system prompt before short questions, mid-length prompts), swept
  at the code trace's load factors (the system prompt, cached, at 2 to 8: `LOADS`);
- with `--extra_parts=KIND:PATH` (repeatable), the user's own traces: a trace file or a folder
  of agent sessions (any format `eval.traces.loaders.load_trace` reads), swept at the load
  factors of the workload `KIND` (`extra_part_loaders`; `--parts=extra` runs only them).

Per cell: `vertumnus`'s mean TTFT against the best baseline there (chosen in hindsight, as in
`eval.paper`, like for like: the fastest of the baselines that failed no more requests,
`eval.paper_setup.best_baseline`; a faster one that failed more is shown in the last column),
and whether it is within the 2 % of issue 15's target. `--gpu` runs every pool on another GPU
profile. A cell above the line is
run again under the seeds of `--seeds` (`ReplayConfig.seed`: the ground truth's per-request
noise and, for sessions, their start times) with the same systems, to tell a systematic loss
from the cell's own seed-to-seed spread. Prints a markdown table and writes
`<output_dir>/robustness.json` (the run's settings and its cells) and `robustness.md` (whose
first line says what the run was). About 15 minutes on one core (`--parts
stand-in`: only the parts whose name contains "stand-in"; `--quick`: about 2, short parts
whose cells are not the full run's).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Sequence

from absl import app, flags

from eval.experiment import ReplayConfig, run_sweep
from eval.paper_setup import (AGENT_WINDOW_S, DEFAULT_TRACES_DIR, LOADS,
                              QUICK_AGENT_WINDOW_S, SETUPS, best_baseline)
from eval.robustness_parts import (DRAW_SEED, extra_part_loaders, halves,  # noqa: F401
                                   part_loaders, select)
from serving.policy.specs import GPUS

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags (defined only when run as a program, so that importing this
    module beside `eval.paper`, which has flags of the same names, is fine)."""
    flags.DEFINE_string("traces_dir", DEFAULT_TRACES_DIR, "Folder of the public traces.")
    flags.DEFINE_string("output_dir", "out/robustness", "Where the JSON and table go.")
    flags.DEFINE_list("models", [m for m, _, _ in SETUPS],
                      f"Setups to run, among {[m for m, _, _ in SETUPS]}.")
    flags.DEFINE_list("seeds", ["1", "2"], "Seeds a cell above the line is re-run under "
                      "(integers; empty: none).")
    flags.DEFINE_bool("quick", False, "Short parts and two loads (smoke run).")
    flags.DEFINE_integer("num_gpus", NUM_GPUS, "GPUs of every pool (the comparison's 40; "
                         "another size is a workload the comparison never ran): a multiple of "
                         "the largest CP degree, at most 1024.", lower_bound=1)
    flags.DEFINE_integer("draw_seed", DRAW_SEED, "Seed of the parts drawn or generated "
                         "(Tool-Agent, the L-Eval CSV's order, the stand-ins); another one is "
                         "a workload no result was tuned on (0 is eval.paper's own draw).",
                         lower_bound=1)
    flags.DEFINE_enum("gpu", GPU, sorted(GPUS), "GPU profile of every pool (the comparison's "
                      "is h20; another one has other compute, memory bandwidth and capacity: "
                      "hardware the comparison never ran on).")
    flags.DEFINE_list("parts", [], "Run only the parts whose name contains one of these "
                      "strings (comma-separated, case-insensitive; empty: every part; one "
                      "that matches no part is refused, listing the part names).")
    flags.DEFINE_multi_string("extra_parts", [], "A part of your own, KIND:PATH (repeatable): "
                              "a trace file or a folder of agent sessions (the formats of "
                              "eval.traces.loaders.load_trace, Mooncake JSONL with 512-token "
                              "hash_ids; PATH may start with mooncake:, azure:, leval: or "
                              "sessions: where its name does not tell the format), "
                              "read before anything runs and swept at the load factors of "
                              f"the workload KIND, one of {sorted(LOADS)} (agent sessions: "
                              "agents; KIND leval is the Mooncake long-document trace's, an "
                              "L-Eval CSV's is leval-csv). Named 'extra KIND: PATH'; "
                              "--parts=extra runs only these.")


LINE = 0.02  # issue 15: at most 2 % above the best baseline
NUM_GPUS = 40  # the comparison's pool (`eval.paper`)
MAX_GPUS = 1024  # a bound on `--num_gpus` (a simulated pool of 1,024 GPUs runs in minutes)
GPU = "h20"  # the comparison's GPU profile (`ReplayConfig.gpu`)


def cells(results: list[dict], part: str, model: str) -> list[dict]:
    """Per load factor: `vertumnus` against the best baseline like for like
    (`eval.paper_setup.best_baseline`: the lowest mean TTFT among the systems not in `OURS`
    or `OTHER_OURS` that failed no more requests than `vertumnus`), from `run_sweep`'s
    results; `change` is None where either has no mean TTFT (every request failed, or the
    system did not run). The failed requests of both are kept, and a faster baseline that
    failed more requests is given apart (`faster`: its system, mean TTFT, failed requests and
    the change against it; None when there is none)."""
    out = []
    for lf in sorted({r["load_factor"] for r in results}):
        at = [r for r in results if r["load_factor"] == lf]
        ours = next((r for r in at if r["system"] == "vertumnus"), None)
        best, faster = best_baseline(at, ours)
        ok = ours is not None and ours["mean_ttft_ms"] is not None and best is not None
        out.append({"part": part, "model": model, "load_factor": lf,
                    "rate": ours["request_rate"] if ours else None,
                    "best_baseline": best["system"] if best else None,
                    "best_ms": best["mean_ttft_ms"] if best else None,
                    "vertumnus_ms": ours["mean_ttft_ms"] if ours else None,
                    "change": ours["mean_ttft_ms"] / best["mean_ttft_ms"] - 1 if ok else None,
                    "failed": [ours.get("failed", 0) if ours else None,
                               best.get("failed", 0) if best else None],
                    "vertumnus_workers": [len(ours["composition"]),
                                          len(ours["final_composition"])] if ours else None,
                    "reconfigurations": len(ours["reconfigurations"]) if ours else None,
                    "faster": None if faster is None else {
                        "system": faster["system"], "mean_ttft_ms": faster["mean_ttft_ms"],
                        "failed": faster.get("failed", 0),
                        "change": ours["mean_ttft_ms"] / faster["mean_ttft_ms"] - 1
                        if ok else None}})
    return out


def markdown(rows: list[dict]) -> list[str]:
    """The table: one line per cell, the re-seeded changes of those above the line."""
    md = ["| part | model | load factor | best baseline | its mean TTFT (ms) | `vertumnus` (ms) "
          "| change | failed (ours, its) | re-run under noise seed | faster, failing more: "
          "change (its failed) |",
          "|---|---|---|---|---|---|---|---|---|---|"]

    def ms(v):
        return "-" if v is None else f"{v:.0f}"

    for c in rows:
        seeds = ", ".join(f"{s}: {v:+.1%}" if v is not None else f"{s}: -"
                          for s, v in c.get("other_seeds", {}).items())
        change = "no result" if c["change"] is None else f"{c['change']:+.1%}"
        f = c.get("faster")
        faster = "-" if f is None else f"`{f['system']}`: " + (
            "-" if f["change"] is None else f"{f['change']:+.1%}") + f" ({f['failed']})"
        md.append(f"| {c['part']} | {c['model']} | {c['load_factor']} | "
                  f"`{c['best_baseline']}` | {ms(c['best_ms'])} | {ms(c['vertumnus_ms'])} | "
                  f"{change} | {c['failed'][0]}, {c['failed'][1]} | {seeds or '-'} | "
                  f"{faster} |")
    done = [c for c in rows if c["change"] is not None]
    within = sum(c["change"] <= LINE for c in done)
    md += ["", f"{within} of {len(rows)} cells within {LINE:.0%} of the best baseline, "
           f"{sum(c['change'] < 0 for c in done)} below it"
           + (f"; {len(rows) - len(done)} without a result" if len(done) < len(rows) else "")
           + _failed_line(rows) + "."]
    return md


def _failed_line(rows: list[dict]) -> str:
    """"; in N cells a faster baseline failed more requests (vertumnus within 2 % of it in
    M); in K vertumnus failed more than the best baseline", the parts that apply, or ""."""
    faster = [c["faster"] for c in rows if c.get("faster")]
    near = sum(f["change"] is not None and f["change"] <= LINE for f in faster)
    more = sum(None not in c["failed"] and c["failed"][0] > c["failed"][1] for c in rows)
    return ((f"; in {len(faster)} a faster baseline failed more requests (`vertumnus` within "
             f"{LINE:.0%} of it in {near})" if faster else "")
            + (f"; in {more} `vertumnus` failed more requests than the best baseline"
               if more else ""))


def settings_line(settings: dict) -> str:
    """The markdown's first line: what the run was (a `--quick` or `--parts` run is not the
    full one; the user's own parts, `--extra_parts`, are named)."""
    extra = [p for p in settings["parts"] if p.startswith("extra ")]
    builtin = [p for p in settings["parts"] if p not in extra]
    if settings["all_parts"]:
        parts_ = f"all {len(builtin)} parts"
    else:
        parts_ = "parts " + "; ".join(builtin) if builtin else ""
    if extra:
        parts_ += (" and " if parts_ else "parts ") + "; ".join(extra)
    gpus = settings.get("num_gpus", NUM_GPUS)
    size = f"pools of {gpus} GPUs (the comparison's: {NUM_GPUS}), " if gpus != NUM_GPUS else ""
    quick = "--quick (short parts, two loads), " if settings["quick"] else ""
    draw = settings.get("draw_seed", DRAW_SEED)
    size += f"drawn parts with seed {draw} (the committed run's: {DRAW_SEED}), " if (
        draw != DRAW_SEED) else ""
    gpu = settings.get("gpu", GPU)
    size += f"GPU profile {gpu} (the comparison's: {GPU}), " if gpu != GPU else ""
    return (f"Run: {quick}{size}models {', '.join(settings['models'])}; {parts_}; re-run "
            f"under noise seeds {', '.join(map(str, settings['seeds'])) or 'none'}.")


def write_json(out: pathlib.Path, settings: dict, rows: list[dict]) -> None:
    """`<out>/robustness.json`: `{"settings": ..., "cells": rows}`."""
    (out / "robustness.json").write_text(json.dumps({"settings": settings, "cells": rows},
                                                    indent=1))


def run(traces_dir: str, output_dir: str, models: Sequence[str], seeds: Sequence[str],
        quick: bool, only: Sequence[str] | None = (), num_gpus: int = NUM_GPUS,
        draw_seed: int = DRAW_SEED, gpu: str = GPU, extra: Sequence[str] = ()) -> list[dict]:
    """Runs every part (`part_loaders`, and those of `extra`: `extra_part_loaders`) for each
    setup in `models` on pools of `num_gpus`
    GPUs of the profile `gpu`; returns the cells and writes them. With `only`, just the parts
    `select` picks (reading only what they need). `draw_seed`: the drawn parts' seed
    (`part_loaders`).

    Raises:
      ValueError: an unknown model, a seed that is not an integer, a bad `only` (`select`) or
        `extra` (`extra_part_loaders`; the chosen extra parts are read before any output, so
        a malformed trace of one's own fails then too),
        or `num_gpus` not a multiple of the setups' largest CP degree in [it, MAX_GPUS], or
        `draw_seed` not an integer in [1, 2**63), or `gpu` not a name of
        `serving.policy.specs.GPUS` (all checked before any output is written or
        trace read).
      OSError: a trace cannot be read, or the output cannot be written.
    """
    setups = {m: (d, b) for m, d, b in SETUPS}
    unknown = [m for m in models if m not in setups]
    if unknown or not models:
        raise ValueError(f"--models must name one or more of {sorted(setups)}, got "
                         f"{list(models)}")
    models = list(dict.fromkeys(models))  # (repeats dropped)
    try:
        seeds = [int(s) for s in seeds]
    except ValueError:
        raise ValueError(f"--seeds must be integers, got {list(seeds)}") from None
    largest = max(max(setups[m][0]) for m in models)  # (every degree divides the largest)
    if not (isinstance(num_gpus, int) and 0 < num_gpus <= MAX_GPUS
            and num_gpus % largest == 0):
        raise ValueError(f"--num_gpus must be a multiple of {largest} (the largest CP degree "
                         f"of the setups run) in [{largest}, {MAX_GPUS}], got {num_gpus}")
    if isinstance(draw_seed, bool) or not isinstance(draw_seed, int) or not (
            1 <= draw_seed < 2 ** 63):  # (0 draws `eval.paper`'s own workloads)
        raise ValueError(f"--draw_seed must be an integer in [1, 2**63), got {draw_seed!r}")
    if not isinstance(gpu, str) or gpu not in GPUS:  # (the flag is an enum; callers too)
        raise ValueError(f"--gpu must be one of {sorted(GPUS)}, got {gpu!r}")
    loaders = part_loaders(traces_dir, quick, draw_seed)
    builtin = list(loaders)
    extras = extra_part_loaders(extra, quick, draw_seed)
    loaders.update(extras)
    chosen = select(loaders, only)
    for name in [n for n in chosen if n in extras]:  # (read now: a bad trace fails first)
        chosen[name][1]()
    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)  # (before the sweeps: a bad folder fails first)
    settings = {"models": models, "seeds": seeds, "quick": bool(quick),  # (what the files
                "parts": list(chosen), "all_parts": set(builtin) <= chosen.keys(),  # record)
                "num_gpus": num_gpus, "draw_seed": draw_seed, "gpu": gpu}
    rows: list[dict] = []
    for part, (wname, load) in chosen.items():
        reqs = load()
        for model in models:
            degrees, baselines = setups[model]

            def sweep(loads, seed):
                cfg = ReplayConfig(gpu=gpu, model=model, degrees=degrees,
                                   load_factors=tuple(loads), num_gpus=num_gpus,
                                   systems=baselines + ("vertumnus",), seed=seed,
                                   session_window_s=QUICK_AGENT_WINDOW_S if quick
                                   else AGENT_WINDOW_S)
                return cells(run_sweep(reqs, wname, cfg)[0], part, model)

            t0 = time.perf_counter()
            got = sweep(LOADS[wname][1::2] if quick else LOADS[wname], 0)
            for c in got:
                if c["change"] is not None and c["change"] > LINE and seeds:
                    c["other_seeds"] = {s: sweep([c["load_factor"]], s)[0]["change"]
                                        for s in seeds}
                print(f"{part}, {model}, load {c['load_factor']}: "
                      + ("no result" if c["change"] is None else
                         f"{c['change']:+.1%} against `{c['best_baseline']}`")
                      + "".join(f"; noise seed {s} {v:+.1%}" for s, v in
                                c.get("other_seeds", {}).items() if v is not None), flush=True)
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            rows += got
            write_json(out, settings, rows)  # (as it goes)
    md = [settings_line(settings), ""] + markdown(rows)
    print("\n".join(md))
    write_json(out, settings, rows)
    (out / "robustness.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'robustness.json'} and robustness.md")
    return rows


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        run(FLAGS.traces_dir, FLAGS.output_dir, FLAGS.models, FLAGS.seeds, FLAGS.quick,
            FLAGS.parts, FLAGS.num_gpus, FLAGS.draw_seed, FLAGS.gpu, FLAGS.extra_parts)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
