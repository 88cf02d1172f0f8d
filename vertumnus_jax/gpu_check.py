"""One prepared GPU check: `python -m vertumnus_jax.gpu_check`.

Meant to run once, unattended, on a lent NVIDIA GPU (an H200 with jax 0.11 and the CUDA plugin,
no network) in under 8 minutes, and to leave everything it measured in one folder to commit:

  kernel   the Pallas kernel (compiled, `interpret=False`) against `attention_reference` on bf16
           cases (causal, cached prefix, zigzag rank positions, GQA, padding): max abs / rel
           errors, pass/fail against the bf16 tolerance of `gpu_check_kernel.TOLERANCES`;
  timing   the kernel against `jax.nn.dot_product_attention` ("cudnn", "xla") for causal
           prefill of 4K, 16K, 32K tokens and 4K new tokens after 28K cached (Qwen3-8B heads:
           32 q / 8 kv, head_dim 128, batch 1): median ms, TFLOP/s over the visible (q, k)
           pairs, ratio to the fastest reference, compile time apart;
  profile  CP-1 prefill of a Qwen3-8B-shaped model (seeded random bf16 weights) over a grid of
           input lengths and cached fractions, measured at a reduced depth and scaled to 36
           layers (`gpu_check_profile`), written as the CSV `eval.replay --profile_csv` reads.

Outputs (`--out_dir`, default `pallas_kernels/results/gpu_check-<UTC time>/`): `results.json`
(everything, errors with tracebacks), `results.md` (tables), `summary.txt` (what is printed at
the end), `profile.csv` and `profile_measured.csv`. `results.json` and the CSVs are rewritten
after every measured item (a timing case after each implementation), so a run killed by an
outer `timeout` keeps what it had. SIGTERM (what `timeout` sends) and SIGINT stop the run: the part
in progress is recorded as "interrupted", the reports are written, and the exit status is 143 / 130.

Every part runs in try/except: an error is recorded (with its traceback) and the next part runs.
`--budget_s` is checked before every item (a compile in flight cannot be cut short, so leave a
margin); `--only=kernel,timing,profile` picks parts; `--dry_run` runs the same code paths on a
CPU in Pallas interpret mode with tiny shapes, a tiny model and a 2x2 grid (well under a minute).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import signal
import sys
import time
import traceback

import jax
import numpy as np

from vertumnus_jax import gpu_check_kernel, gpu_check_profile, gpu_check_report, gpu_check_timing

_T0 = time.monotonic()  # the budget counts from the import (jax's start-up included)
PARTS = ("kernel", "timing", "profile")
_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "jax-cuda12-pjrt", "flax", "orbax-checkpoint", "numpy", "absl-py", "scipy")


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    """Everything a run does; `gpu_config()` and `dry_run_config()` are the two presets."""

    out_dir: str
    budget_s: float = 400.0
    parts: tuple[str, ...] = PARTS
    dry_run: bool = False
    interpret: bool = False
    seed: int = 0
    dtype: str = "bfloat16"
    # A part may use at most this share of the whole budget from its start (what it leaves
    # goes to the parts after it; the profile takes whatever is left).
    kernel_share: float = 0.2
    timing_share: float = 0.35
    # kernel part
    kernel_len: int = 4096
    kernel_heads: tuple[int, int, int] = (32, 8, 128)  # q heads, kv heads, head_dim
    # timing part
    timing_causal: tuple[int, ...] = (4096, 16384, 32768)
    timing_prefix: tuple[tuple[int, int], ...] = ((4096, 28672),)  # (new, cached) tokens
    timing_heads: tuple[int, int, int] = (32, 8, 128)
    timing_impls: tuple[str, ...] = ("pallas", "cudnn", "xla")
    timing_iters: int = 10
    timing_warmup: int = 2
    # profile part
    profile_model: str = "qwen3-8b"
    profile_layers: int = 4
    profile_target_layers: int = 0  # 0: the model's own depth
    probe_layers: int = 1
    profile_cp: tuple[int, ...] = (1,)
    profile_lens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    profile_fracs: tuple[float, ...] = (0.0, 0.5, 0.9, 0.99)
    profile_block_size: int = 16
    profile_warmup: int = 2  # the second run after a compile can still be slow (CPU: 3-10x)
    profile_repeats: int = 5


def default_out_dir(dry_run: bool = False) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if dry_run:  # a dry run is not a result to commit
        return os.path.join("out", f"gpu_check-dry-{stamp}")
    return os.path.join("pallas_kernels", "results", f"gpu_check-{stamp}")


def gpu_config(**overrides) -> CheckConfig:
    """The real check: Qwen3-8B heads and model, 4K-32K tokens, a 400 s budget."""
    overrides.setdefault("out_dir", default_out_dir())
    return CheckConfig(**overrides)


def dry_run_config(**overrides) -> CheckConfig:
    """The same code paths on a CPU: interpret mode, tiny shapes, the tiny model (measured at
    2 layers, scaled to 4), a 2x2 grid."""
    base = dict(out_dir=default_out_dir(True), budget_s=120.0, dry_run=True, interpret=True,
                kernel_share=0.4, timing_share=0.4,
                kernel_len=256, kernel_heads=(4, 2, 64), timing_causal=(256,),
                timing_prefix=((128, 256),), timing_heads=(4, 2, 64), timing_iters=3,
                timing_warmup=1, profile_model="tiny", profile_layers=2,
                profile_target_layers=4, profile_lens=(32, 64), profile_fracs=(0.0, 0.5),
                profile_repeats=2)
    return CheckConfig(**{**base, **overrides})


class Deadline:
    """The run's time budget, counted from `start` (monotonic seconds; default now)."""

    def __init__(self, budget_s: float, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.budget_s = float(budget_s)
        self.end = self.start + self.budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self, end: float | None = None) -> float:
        return min(self.end, self.end if end is None else end) - time.monotonic()

    def part_end(self, share: float) -> float:
        """End of a part that may use `share` of the whole budget from now on."""
        return min(self.end, time.monotonic() + share * self.budget_s)


def environment() -> dict:
    """Versions and devices, as plain data."""
    versions = {"python": sys.version.split()[0]}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    devices = jax.devices()
    info = {"versions": versions, "platform": platform.platform(), "hostname": platform.node(),
            "backend": jax.default_backend(), "device_count": len(devices),
            "devices": [{"id": d.id, "kind": d.device_kind, "platform": d.platform}
                        for d in devices]}
    try:
        stats = devices[0].memory_stats() or {}
        info["memory_bytes_limit"] = stats.get("bytes_limit")
    except Exception as err:  # noqa: BLE001 - CPU devices may not report
        info["memory_stats_error"] = f"{type(err).__name__}: {err}"
    try:
        info["environment_info"] = jax.print_environment_info(return_string=True)
    except Exception as err:  # noqa: BLE001
        info["environment_info"] = f"unavailable: {type(err).__name__}: {err}"
    info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    return info


def _clean(x):
    """JSON-safe copy: numpy scalars to Python, non-finite floats to strings."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.integer, np.bool_)):
        return x.item()
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else str(x)
    return x


class Interrupted(KeyboardInterrupt):
    """Raised by `main`'s SIGTERM handler; like Ctrl-C, it passes every `except Exception`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The signal being delivered: raised by the handler, and again at the next `check_interrupted`
# when the handler's raise was swallowed (a signal that lands inside a GC callback or a
# `__del__` is printed as "Exception ignored" and lost). `delivered` once `main` has it.
_SIGNAL = {"signum": None, "delivered": False}


def install_signal_handlers() -> None:
    """SIGTERM and SIGINT raise `Interrupted`; once it has reached a handler that records it
    (`mark_delivered`), a second signal while the report is being written is ignored. Called by
    `main` only (importing the module changes nothing)."""

    def handler(signum, frame):  # noqa: ARG001
        if _SIGNAL["delivered"]:
            return
        _SIGNAL["signum"] = signum
        raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def check_interrupted() -> None:
    """Raises `Interrupted` again if a signal arrived whose raise was swallowed."""
    if _SIGNAL["signum"] is not None and not _SIGNAL["delivered"]:
        raise Interrupted(_SIGNAL["signum"])


def mark_delivered() -> None:
    """The interrupt reached the code that writes the report: later signals are ignored."""
    _SIGNAL["delivered"] = _SIGNAL["signum"] is not None or _SIGNAL["delivered"]


def write_text(path: str, text: str) -> None:
    """Writes `text` to `path` atomically (a temporary file, then os.replace)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Results:
    """The run's record; `save()` rewrites `results.json` atomically (called after each item)."""

    def __init__(self, out_dir: str, cfg: CheckConfig):
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.data = {"config": dataclasses.asdict(cfg), "started_utc": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"), "parts": {}}

    def path(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    def save(self) -> None:
        check_interrupted()  # after each item: a safe point for a swallowed signal
        tmp = self.path("results.json.tmp")
        with open(tmp, "w") as f:
            json.dump(_clean(self.data), f, indent=2)
        os.replace(tmp, self.path("results.json"))


def run_part(name: str, fn, cfg: CheckConfig, deadline: Deadline, results: Results,
             share: float = 1.0) -> dict:
    """Runs one part with `share` of the budget (from now, within what is left); any exception
    is recorded, not raised."""
    record = {"status": "running"}
    results.data["parts"][name] = record
    results.save()
    start = time.monotonic()
    part_end = deadline.part_end(share)
    print(f"== {name} (budget left {deadline.left():.0f} s, this part "
          f"{max(0.0, part_end - time.monotonic()):.0f} s)", flush=True)
    try:
        fn(cfg, deadline, part_end, record, results)
        record["status"] = "done" if not record.get("skipped") else "partial"
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM through `Interrupted`
        mark_delivered()
        record["status"] = "interrupted"
        record["interrupted"] = str(err) or "SIGINT"
        record["seconds"] = time.monotonic() - start
        results.save()
        print(f"   {name} interrupted ({record['interrupted']})", flush=True)
        raise
    except Exception as err:  # noqa: BLE001 - one part's failure must not stop the others
        record["status"] = "error"
        record["error"] = f"{type(err).__name__}: {err}"
        record["traceback"] = traceback.format_exc()
        print(f"   {name} failed: {record['error'].splitlines()[0][:200]}", flush=True)
    record["seconds"] = time.monotonic() - start
    results.save()
    return record


def run_check(cfg: CheckConfig, deadline: Deadline | None = None) -> dict:
    """Runs the parts of `cfg`, writes every file and prints the summary; returns the record."""
    deadline = deadline or Deadline(cfg.budget_s)
    unknown = [p for p in cfg.parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {PARTS}")
    results = Results(cfg.out_dir, cfg)
    env = environment()
    results.data["environment"] = env
    results.save()
    print(gpu_check_report.environment_lines(env, cfg), flush=True)
    fns = {"kernel": gpu_check_kernel.run, "timing": gpu_check_timing.run,
           "profile": gpu_check_profile.run}
    selected = [name for name in PARTS if name in cfg.parts]
    try:
        for name in selected:  # the last part selected gets all that is left
            share = 1.0 if name == selected[-1] else {"kernel": cfg.kernel_share,
                                                       "timing": cfg.timing_share}.get(name, 1.0)
            run_part(name, fns[name], cfg, deadline, results, share)
    except KeyboardInterrupt as err:  # the report is written, then the interrupt goes on
        results.data["interrupted"] = str(err) or "SIGINT"
        for part in results.data["parts"].values():  # a signal between two statements
            if part.get("status") == "running":
                part.update(status="interrupted", interrupted=results.data["interrupted"])
        results.data["not_run"] = [p for p in selected if p not in results.data["parts"]]
        _finish(cfg, deadline, results)
        raise
    _finish(cfg, deadline, results)
    return results.data


def _finish(cfg: CheckConfig, deadline: Deadline, results: Results) -> None:
    """Targets, wall time, results.json, results.md, summary.txt; prints the summary."""
    results.data["targets"] = gpu_check_report.targets(results.data)
    results.data["wall_s"] = deadline.elapsed()
    results.save()
    write_text(results.path("results.md"), gpu_check_report.markdown(results.data))
    summary = gpu_check_report.summary(results.data, cfg.out_dir)
    write_text(results.path("summary.txt"), summary + "\n")
    print(summary, flush=True)


def define_flags(fv=None):
    """Defines the CLI's flags on `fv` (default absl's global FLAGS). Called only when run as a
    program, so importing the module (tests) adds none to the global registry (`--out_dir` is
    also one of `eval.soak`'s)."""
    from absl import flags
    fv = flags.FLAGS if fv is None else fv
    for define, name, default, help_text in (
            (flags.DEFINE_string, "out_dir", None, "Folder for every output; default "
             "pallas_kernels/results/gpu_check-<UTC time> (dry run: out/gpu_check-dry-...)."),
            (flags.DEFINE_float, "budget_s", None, "Seconds from start after which no new item "
             "starts (default 400; dry run 120). Keep an outer `timeout` well above it."),
            (flags.DEFINE_list, "only", list(PARTS), "Parts to run: kernel, timing, profile."),
            (flags.DEFINE_bool, "dry_run", False, "CPU smoke run: Pallas interpret mode, tiny "
             "shapes, the tiny model, a 2x2 profile grid."),
            (flags.DEFINE_list, "timing_causal", None, "Causal prefill lengths to time "
             "(default 4096,16384,32768)."),
            (flags.DEFINE_integer, "timing_iters", None, "Timed calls per implementation "
             "(median; default 10)."),
            (flags.DEFINE_list, "profile_lens", None, "Profile input lengths (default "
             "1024,2048,4096,8192,16384,32768)."),
            (flags.DEFINE_list, "profile_fracs", None, "Profile cached fractions (default "
             "0,0.5,0.9,0.99)."),
            (flags.DEFINE_integer, "profile_layers", None, "Layers of the measured model "
             "(default 4; 0 = the full depth, no scaling)."),
            (flags.DEFINE_integer, "profile_repeats", None, "Timed prefills per grid point "
             "(median; default 5).")):
        define(name, default, help_text, flag_values=fv)
    # `--output_dir`, the name of the other tools (`eval.paper`, `eval.replay`, ...), too
    flags.DEFINE_alias("output_dir", "out_dir", flag_values=fv)


def config_from_flags(fv=None) -> CheckConfig:
    """The run's config from parsed flags: the preset (`--dry_run` or not) with every flag
    given overriding it."""
    from absl import flags
    f = flags.FLAGS if fv is None else fv
    if f["out_dir"].present > f["output_dir"].present > 0:
        raise SystemExit("error: give the output folder once: --out_dir or its alias "
                         "--output_dir")
    over = {"parts": tuple(p.strip() for p in f.only if p.strip())}
    for name, conv in (("out_dir", str), ("budget_s", float), ("timing_iters", int),
                       ("profile_repeats", int), ("profile_layers", int)):
        if f[name].value is not None:
            over[name] = conv(f[name].value)
    for name, conv in (("timing_causal", int), ("profile_lens", int), ("profile_fracs", float)):
        if f[name].value is not None:
            over[name] = tuple(conv(x) for x in f[name].value)
    return dry_run_config(**over) if f.dry_run else gpu_config(**over)


def main(argv):
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {argv[1:]}")
    cfg = config_from_flags()
    unknown = [p for p in cfg.parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"error: --only: unknown parts {unknown}; choose from {list(PARTS)}")
    install_signal_handlers()
    try:
        run_check(cfg, Deadline(cfg.budget_s, start=_T0))
    except KeyboardInterrupt as err:
        mark_delivered()
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"gpu_check: interrupted by {signal.Signals(signum).name}; the report above has "
              "what was measured", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Every file is written; skip the interpreter's teardown, which can crash in XLA's
        # when a computation was cut short (a segfault in 1 of several runs here).
        os._exit(128 + int(signum))


if __name__ == "__main__":
    from absl import app
    define_flags()
    app.run(main)
