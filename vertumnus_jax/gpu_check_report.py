"""The reports of `python -m vertumnus_jax.gpu_check`: targets, markdown, the printed summary.

Plain Python over the run's record (the dict `results.json` holds); no jax.

Targets: every kernel case within the bf16 tolerance; >= 400 TFLOP/s for causal
prefill of 16K tokens; the kernel at most 1.25x the fastest `jax.nn.dot_product_attention` on
every timed case; the profile CSV written (then committed; eval.replay --profile_csv reads it).
On a GPU run a kernel error, a kernel time missing where a reference ran, or a missing 16K case
is a FAIL with its reason. Only interpret mode (a dry run) leaves the performance targets unjudged
(n/a); there the largest causal case stands in for 16K and says so.
"""

from __future__ import annotations

import os

TFLOPS_TARGET = 400.0
TFLOPS_TARGET_LEN = 16384
RATIO_TARGET = 1.25
_IMPLS = ("pallas", "cudnn", "xla")


def _f(x, spec=".3g") -> str:
    return "n/a" if x is None or isinstance(x, str) else format(x, spec)


def environment_lines(env: dict, cfg) -> str:
    v = env.get("versions", {})
    kinds = sorted({d["kind"] for d in env.get("devices", [])})
    plugin = next((f"{k} {v[k]}" for k in v if k.startswith("jax-cuda")), "no CUDA plugin")
    mem = env.get("memory_bytes_limit")
    return "\n".join([
        f"gpu_check{' (dry run)' if cfg.dry_run else ''}: python {v.get('python')}, jax "
        f"{v.get('jax')}, jaxlib {v.get('jaxlib')}, {plugin}, flax {v.get('flax')}, "
        f"numpy {v.get('numpy')}",
        f"backend {env.get('backend')}: {env.get('device_count')} x {', '.join(kinds)}"
        + (f", {mem / 2**30:.1f} GiB usable" if mem else ""),
        f"parts {','.join(cfg.parts)}, budget {cfg.budget_s:.0f} s, out_dir {cfg.out_dir}"])


def _first_line(text) -> str:
    lines = str(text).splitlines()
    return (lines[0] if lines else str(text))[:160]


def _why_missing(part: dict) -> str:
    """Why a part has no result for an item: its error, interruption or budget skip."""
    if "error" in part:
        return f"part failed: {_first_line(part['error'])}"
    if part.get("status") == "interrupted":
        return f"interrupted ({part.get('interrupted', 'signal')})"
    if part.get("skipped"):
        return "skipped: out of budget"
    return "not in this run's cases"


def _judged(data: dict, part: dict) -> bool:
    """Performance is judged only on a compiled kernel (not interpret mode, not a dry run)."""
    cfg = data.get("config", {})
    return not (part.get("interpret", cfg.get("interpret", False)) or cfg.get("dry_run", False))


def _kernel_target(data: dict) -> dict:
    name = "kernel max error within bf16 tolerance"
    kernel = data.get("parts", {}).get("kernel")
    if kernel is None:
        return {"name": name, "value": "not run", "pass": None}
    cases = kernel.get("cases", [])
    npass = sum(bool(c.get("pass")) for c in cases)
    value = f"{npass}/{len(cases)} cases"
    bad = [c for c in cases if not c.get("pass")]
    if bad:
        c = bad[0]
        value += f"; {c['name']}: " + (_first_line(c["error"]) if "error" in c else
                                        "interrupted" if c.get("interrupted") else
                                        f"worst/tol {_f(c.get('worst_ratio'))}, lse err "
                                        f"{_f(c.get('lse_max_abs_err'))}")
    if "error" in kernel or kernel.get("status") == "interrupted" or kernel.get("skipped"):
        value += f" ({_why_missing(kernel)})"
    if "error" in kernel or bad:
        return {"name": name, "value": value, "pass": False}
    if not cases or kernel.get("skipped") or kernel.get("status") == "interrupted":
        # nothing (or not everything) measured: a failure on the GPU, not judged in a dry run
        return {"name": name, "value": value, "pass": False if _judged(data, kernel) else None}
    return {"name": name, "value": value, "pass": kernel.get("pass", False)}


def _tflops_target(data: dict) -> dict:
    name = f"pallas >= {TFLOPS_TARGET:.0f} TFLOP/s, causal {TFLOPS_TARGET_LEN}"
    timing = data.get("parts", {}).get("timing")
    if timing is None:
        return {"name": name, "value": "not run", "pass": None}
    causal = [r for r in timing.get("cases", []) if r.get("cached") == 0]
    exact = [r for r in causal if r.get("new") == TFLOPS_TARGET_LEN]
    if not _judged(data, timing):  # interpret mode times the interpreter: shown, never judged
        row = exact[0] if exact else max(causal, key=lambda r: r["new"], default=None)
        note = f" (stand-in: causal {row['new']})" if row and not exact else ""
        t = (row or {}).get("impls", {}).get("pallas", {})
        return {"name": name + note + " (interpret mode: not judged)",
                "value": _f(t.get("tflops"), ".4g"), "pass": None}
    if not exact:
        return {"name": name, "value": f"not measured ({_why_missing(timing)})", "pass": False}
    row = exact[0]
    t = row.get("impls", {}).get("pallas", {})
    if "tflops" in t:
        return {"name": name, "value": _f(t["tflops"], ".4g"), "pass": t["tflops"] >= TFLOPS_TARGET}
    why = (_first_line(t["error"]) if "error" in t else _first_line(row["error"])
           if "error" in row else "interrupted" if row.get("interrupted") else
           _why_missing(timing))
    return {"name": name, "value": f"not measured: {why}", "pass": False}


def _ratio_target(data: dict) -> dict:
    name = f"pallas <= {RATIO_TARGET}x fastest jax.nn.dot_product_attention"
    timing = data.get("parts", {}).get("timing")
    if timing is None:
        return {"name": name, "value": "not run", "pass": None}
    judged = _judged(data, timing)
    name += "" if judged else " (interpret mode: not judged)"
    cases = timing.get("cases", [])
    ratios = [r["ratio"] for r in cases if "ratio" in r]
    failed = []  # cases where a reference ran but the kernel has no time, or the case failed
    for r in cases:
        impls = r.get("impls", {})
        refs_ran = any("ms" in impls.get(x, {}) for x in _IMPLS if x != "pallas")
        p = impls.get("pallas", {})
        if "error" in r:
            failed.append(f"{r['case']}: {_first_line(r['error'])}")
        elif refs_ran and "ms" not in p:
            failed.append(f"{r['case']}: pallas " + (_first_line(p["error"]) if "error" in p
                                                     else "not measured"))
    parts = [f"worst {max(ratios):.2f} over {len(ratios)} cases"] if ratios else []
    if failed:
        parts.append(f"pallas failed on {len(failed)} case(s), first {failed[0]}")
    if "error" in timing:
        parts.append(_why_missing(timing))
    if not parts:
        parts = ["no reference ran" if cases else f"no case measured ({_why_missing(timing)})"]
    value = "; ".join(parts)
    if not judged:
        return {"name": name, "value": value, "pass": None}
    if failed or "error" in timing or (not cases and timing.get("status") != "done"):
        return {"name": name, "value": value, "pass": False}
    return {"name": name, "value": value,
            "pass": max(ratios) <= RATIO_TARGET if ratios else None}


def targets(data: dict) -> list[dict]:
    """The issue's targets: name, value, pass (True / False / None when not judged). On a GPU
    run a failing or missing kernel measurement is a FAIL with its reason; only interpret mode
    (a dry run) leaves the performance targets unjudged."""
    out = [_kernel_target(data), _tflops_target(data), _ratio_target(data)]
    prof = data.get("parts", {}).get("profile", {})
    rows = [p for p in prof.get("points", []) if "seconds" in p]
    grid = len(rows) + len(prof.get("skipped", [])) + sum(
        "error" in p for p in prof.get("points", []))
    out.append({"name": "profile CSV written (commit it; replay on it with eval.replay --profile_csv)",
                "value": (f"{len(rows)}/{grid} grid points"
                          + (f" ({_why_missing(prof)})" if "error" in prof or prof.get(
                              "status") == "interrupted" else "")) if prof else "not run",
                "pass": (len(rows) == grid and grid > 0 and "error" not in prof)
                if prof else None})
    return out


def _errors(data: dict) -> list[str]:
    lines = []
    for name, part in data.get("parts", {}).items():
        if "error" in part:
            lines.append(f"{name}: {part['error']}")
        for c in part.get("cases", []):
            if "error" in c:
                lines.append(f"{name} {c.get('name', c.get('case'))}: {c['error']}")
            for impl, t in c.get("impls", {}).items():
                if "error" in t:
                    lines.append(f"{name} {c['case']} {impl}: {t['error']}")
        for p in part.get("points", []):
            if "error" in p:
                lines.append(f"{name} L={p['input_len']} h={p['cached_len']}: {p['error']}")
        for cp, p in part.get("probe", {}).items():
            if "error" in p:
                lines.append(f"{name} probe cp={cp}: {p['error']}")
    return [ln.splitlines()[0] if ln.splitlines() else ln for ln in lines]


def _profile_matrix(prof: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: scaled milliseconds per (input length, cached fraction) at the
    smallest CP degree measured ("-": not measured, "n/a": failed)."""
    fracs = prof.get("cached_fractions", [])
    header = ["L \\ cached"] + [f"{f:.0%}" for f in fracs]
    points = prof.get("points", [])
    cp = min((p["cp"] for p in points), default=1)
    rows = []
    for length in prof.get("input_lens", []):
        cells = []
        for f in fracs:
            hit = [p for p in points if p["cp"] == cp and p["input_len"] == length
                   and f in p.get("fractions", [])]
            ms = hit[0]["scaled_seconds"] * 1e3 if hit and "scaled_seconds" in hit[0] else None
            cells.append(_f(ms, ".1f") if hit else "-")
        rows.append([str(length)] + cells)
    return header, rows


def _timing_rows(timing: dict) -> list[list[str]]:
    rows = []
    for r in timing.get("cases", []):
        cells = [r["case"]]
        for impl in _IMPLS:
            t = r.get("impls", {}).get(impl)
            if t is None:
                continue
            cells.append(f"{t['ms']:.3f} / {t['tflops']:.4g}" if "ms" in t else "failed")
        cells.append(_f(r.get("ratio"), ".2f"))
        rows.append(cells)
    return rows


def _table(header, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else \
        [len(h) for h in header]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header)] + [fmt.format(*r) for r in rows]


def _md(header, rows) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(x) for x in r) + " |" for r in rows] + [""])


def _impls_run(timing: dict) -> list[str]:
    seen = {i for r in timing.get("cases", []) for i in r.get("impls", {})}
    return [i for i in _IMPLS if i in seen]


def summary(data: dict, out_dir: str) -> str:
    """The screenful printed at the end (also summary.txt)."""
    parts, lines = data.get("parts", {}), []
    env = data.get("environment", {})
    kinds = sorted({d["kind"] for d in env.get("devices", [])})
    lines.append(f"==== gpu_check summary: {env.get('backend')} {', '.join(kinds)}, jax "
                 f"{env.get('versions', {}).get('jax')}, {data.get('wall_s', 0):.0f} s")
    for name, part in parts.items():
        lines.append(f"{name}: {part.get('status')} in {part.get('seconds', 0):.0f} s")
        if name == "kernel" and part.get("cases"):
            tol = part.get("tolerance", [None] * 3)
            lines.append(f"  tolerance |out-ref| <= {tol[0]} + {tol[1]}|ref|, |lse-ref| <= "
                         f"{tol[2]}")
            lines += ["  " + x for x in _table(
                ["case", "max_abs", "max_rel", "lse_err", "pass"],
                [[c["name"], _f(c.get("max_abs_err")), _f(c.get("max_rel_err")),
                  _f(c.get("lse_max_abs_err")), "PASS" if c.get("pass") else "FAIL"]
                 for c in part["cases"]])]
        if name == "timing" and part.get("cases"):
            impls = _impls_run(part)
            lines.append("  ms / TFLOP/s; ratio = pallas time / fastest reference")
            lines += ["  " + x for x in _table(["case"] + impls + ["ratio"], _timing_rows(part))]
        if name == "profile" and part.get("points"):
            fx = next(iter(part.get("fixed_overhead", {}).values()), {})
            lines.append(f"  {part['model']} measured at {part['measured_layers']} layers, "
                         f"scaled to {part['target_layers']} ({part.get('scaling')}"
                         + (f"; F {fx['fixed_s'] * 1e3:.2f} ms, {fx['per_layer_s'] * 1e3:.2f} "
                            "ms/layer" if fx else "") + "); ms at full depth, CP 1:")
            lines += ["  " + x for x in _table(*_profile_matrix(part))]
    lines.append("targets:")
    for t in data.get("targets", []):
        mark = "n/a " if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        lines.append(f"  [{mark}] {t['name']}: {t['value']}")
    errors = _errors(data)
    if errors:
        lines.append(f"errors ({len(errors)}; tracebacks in results.json):")
        lines += [f"  {e[:150]}" for e in errors[:6]]
    if data.get("interrupted"):
        lines.append(f"INTERRUPTED by {data['interrupted']}; not run: "
                     f"{', '.join(data.get('not_run', [])) or 'nothing'}")
    wrote = bool(parts.get("profile", {}).get("points"))  # this run wrote them
    csvs = [c for c in ("profile.csv", "profile_measured.csv")
            if wrote and os.path.isfile(os.path.join(out_dir, c))]
    lines.append(f"files: {out_dir}/ results.json results.md summary.txt"
                 + "".join(" " + c for c in csvs))
    return "\n".join(lines)


def markdown(data: dict) -> str:
    """results.md: every table of the run."""
    env, parts = data.get("environment", {}), data.get("parts", {})
    out = [f"# gpu_check, {data.get('started_utc')}", ""]
    out += _md(["item", "value"], [[k, v] for k, v in env.get("versions", {}).items()]
               + [["backend", env.get("backend")], ["devices", ", ".join(
                   f"{d['id']}: {d['kind']}" for d in env.get("devices", []))],
                  ["wall s", f"{data.get('wall_s', 0):.1f}"]])
    out += ["## Targets", ""] + _md(["target", "value", "result"], [
        [t["name"], t["value"], "n/a" if t["pass"] is None else "pass" if t["pass"] else "FAIL"]
        for t in data.get("targets", [])])
    kernel = parts.get("kernel", {})
    if kernel.get("cases"):
        out += ["## Kernel vs reference", "", f"dtype {kernel.get('dtype')}, tolerance (atol, "
                f"rtol, lse atol) = {kernel.get('tolerance')}", ""]
        out += _md(["case", "what", "q shape", "kv shape", "max abs", "max rel", "worst/tol",
                    "lse err", "pass"],
                   [[c["name"], c["what"], c["q_shape"], c["kv_shape"], _f(c.get("max_abs_err")),
                     _f(c.get("max_rel_err")), _f(c.get("worst_ratio")),
                     _f(c.get("lse_max_abs_err")), c.get("pass")] for c in kernel["cases"]])
    timing = parts.get("timing", {})
    if timing.get("cases"):
        out += ["## Timing vs jax.nn.dot_product_attention", "",
                f"heads {timing.get('heads')}, batch 1, {timing.get('dtype')}, median of "
                f"{timing.get('iters')} after {timing.get('warmup')} warm-up calls", ""]
        rows = []
        for r in timing["cases"]:
            for impl, t in r.get("impls", {}).items():
                rows.append([r["case"], f"{r.get('flops', 0):.3e}", impl, _f(t.get("ms"), ".3f"),
                             _f(t.get("tflops"), ".4g"), _f(t.get("compile_s"), ".1f"),
                             _f(r.get("ratio"), ".2f") if impl == "pallas" else "",
                             t.get("error", "").splitlines()[0][:120] if t.get("error") else ""])
        out += _md(["case", "FLOPs", "impl", "ms", "TFLOP/s", "compile s", "ratio", "error"],
                   rows)
    prof = parts.get("profile", {})
    if prof.get("points"):
        fixed = "; ".join(
            f"CP {cp}: F = {x['fixed_s'] * 1e3:.3f} ms, {x['per_layer_s'] * 1e3:.3f} ms per "
            f"layer (from L={x['at']['input_len']}, h={x['at']['cached_len']} at "
            f"{prof['measured_layers']} and {prof['probe_layers']} layers)"
            for cp, x in prof.get("fixed_overhead", {}).items()) or "not measured"
        out += ["## Prefill profile", "", f"{prof['model']} {prof['dtype']}, CP "
                f"{sorted({p['cp'] for p in prof['points']})}, measured at "
                f"{prof['measured_layers']} layers, scaled to {prof['target_layers']}: "
                f"{prof.get('scaling')}; {fixed}; block size {prof['block_size']}, median of "
                f"{prof['repeats']} after {prof['warmup']} warm-up run(s). Table: ms at "
                f"{prof['target_layers']} layers by input length and cached fraction.", ""]
        out += _md(*_profile_matrix(prof))
        out += _md(["cp", "input_len", "cached_len", "measured ms", "scaled ms", "wall s",
                    "setup s", "error"],
                   [[p["cp"], p["input_len"], p["cached_len"],
                     _f(p.get("seconds") and p["seconds"] * 1e3, ".2f"),
                     _f(p.get("scaled_seconds") and p["scaled_seconds"] * 1e3, ".2f"),
                     _f(p.get("wall_s"), ".1f"), _f(p.get("setup_s"), ".1f"),
                     p.get("error", "").splitlines()[0][:120] if p.get("error") else ""]
                    for p in prof["points"]])
    errors = _errors(data)
    if errors:
        out += ["## Errors", "", "Tracebacks are in results.json.", ""]
        out += [f"- {e[:300]}" for e in errors] + [""]
    return "\n".join(out)
