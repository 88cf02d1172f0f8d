"""Tables and plots of replay results.

A result is the flat dict that `eval.replay` writes per (system, trace, rate): the keys of
`eval.metrics.summarize` plus `system`, `trace`, `request_rate`, `composition`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

TABLE_COLUMNS = (
    ("system", "system", "{}"),
    ("request_rate", "rate (req/s)", "{:.2f}"),
    ("completed", "done", "{}"),
    ("failed", "failed", "{}"),
    ("mean_ttft_ms", "mean TTFT (ms)", "{:.0f}"),
    ("p90_ttft_ms", "P90 TTFT (ms)", "{:.0f}"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "{:.0f}"),
    ("slo_attainment", "SLO att.", "{:.3f}"),
    ("token_weighted_slo_attainment", "tok-w SLO att.", "{:.3f}"),
    ("prefix_hit_rate", "prefix hit", "{:.3f}"),
    ("gpu_seconds", "GPU-s", "{:.0f}"),
)


def markdown_table(results: Sequence[dict]) -> str:
    """A GitHub-markdown table of `results`, one row each, columns `TABLE_COLUMNS`."""
    header = "| " + " | ".join(title for _, title, _ in TABLE_COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"
    rows = [header, rule]
    for r in results:
        cells = []
        for key, _, fmt in TABLE_COLUMNS:
            v = r.get(key)
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


PLOTS = (  # (result key, axis label, scale, log y)
    ("mean_ttft_ms", "mean TTFT (s)", 1e-3, True),
    ("p90_ttft_ms", "P90 TTFT (s)", 1e-3, True),
    ("token_weighted_slo_attainment", "token-weighted SLO attainment", 1.0, False),
)
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p")
LINESTYLES = ("-", "--", "-.", ":")


def initial_choice_lines(results: Sequence[dict], shown: int = 3) -> list[str]:
    """One line per result whose starting composition a replay chose (`System.initial_choice`,
    copied into results by `eval.experiment.run_sweep`): the choice and its first `shown`
    candidates (the choice first) with their predicted mean TTFT (ms), so the choice can be
    checked."""
    out = []
    for r in results:
        choice = r.get("initial_choice") or {}
        if not choice.get("candidates"):
            continue
        ranked = "; ".join(
            f"{c['composition']} {c['router']} " + (
                "no request served" if c["predicted_mean_ttft_s"] is None
                else f"{c['predicted_mean_ttft_s'] * 1e3:.0f} ms")
            + (f" ({c['failed']} failed)" if c["failed"] else "")
            for c in choice["candidates"][:shown])
        out.append(f"{r['system']} at {r['request_rate']:.4g} req/s starts from "
                   f"{choice['composition']} with the {choice['router']} rule, chosen by "
                   f"{choice['method']} among {choice['compared']} options (best first: "
                   f"{ranked})")
    return out


def _x_axis(results: Sequence[dict]) -> tuple[str, str]:
    """(result key, label) of the x axis: the load factor when every run has one, else the
    session rate for closed-loop sessions, else the request rate."""
    if results and all(r.get("load_factor") is not None for r in results):
        return "load_factor", "load factor (x capacity rate)"
    if results and all(r.get("session_rate") is not None for r in results):
        return "session_rate", "session rate (sessions/s)"
    return "request_rate", "request rate (req/s)"


def _coinciding(series: dict[str, list[tuple[float, float]]]) -> list[list[str]]:
    """Groups of systems whose points are equal within 0.5 % (one line would hide another)."""
    groups: list[list[str]] = []
    for s, pts in series.items():
        for g in groups:
            ref = series[g[0]]
            if len(ref) == len(pts) and all(
                    x0 == x1 and abs(y0 - y1) <= 0.005 * max(abs(y0), abs(y1), 1e-12)
                    for (x0, y0), (x1, y1) in zip(ref, pts)):
                g.append(s)
                break
        else:
            groups.append([s])
    return [g for g in groups if len(g) > 1]


def _readable_log_axis(ax) -> None:
    """Labels at 1, 2 and 5 of every decade, in plain numbers (not only at 10^k)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def plot_vs_rate(results: Sequence[dict], path: str, title: str) -> None:
    """Writes a PNG with mean TTFT, P90 TTFT and token-weighted SLO attainment per system.

    x is the load factor when the runs used load factors (else the session or request rate);
    every system has its own marker and line style and a small horizontal offset, so a line
    that coincides with another still shows, and the coinciding systems are named under the
    plot. TTFT axes are logarithmic with labels at 1, 2, 5 of each decade; the mean TTFT SLO
    (`mean_ttft_slo_ms`, when the runs have SLOs) is drawn dashed. Runs at a single rate per
    system are drawn as bars instead of lines.
    """
    systems = sorted({r["system"] for r in results})
    xkey, xlabel = _x_axis(results)
    xs = sorted({r[xkey] for r in results})
    fig, axes = plt.subplots(1, len(PLOTS), figsize=(5.2 * len(PLOTS), 4.2), constrained_layout=True)
    notes = []
    for ax, (key, label, scale, log_y) in zip(axes, PLOTS):
        series = {s: sorted((r[xkey], r[key] * scale) for r in results
                            if r["system"] == s and r.get(key) is not None) for s in systems}
        if len(xs) == 1:  # one rate: bars, one per system
            vals = [series[s][0][1] if series[s] else 0.0 for s in systems]
            ax.bar(range(len(systems)), vals, color=[f"C{i % 10}" for i in range(len(systems))])
            ax.set_xticks(range(len(systems)), systems, rotation=45, ha="right", fontsize=7)
            ax.set_xlabel(f"{xlabel} = {xs[0]:.3g}")
        else:
            span = (xs[-1] - xs[0]) or 1.0
            for i, s in enumerate(systems):
                if not series[s]:
                    continue
                dx = (i - (len(systems) - 1) / 2) * 0.006 * span
                ax.plot([x + dx for x, _ in series[s]], [y for _, y in series[s]],
                        marker=MARKERS[i % len(MARKERS)],
                        linestyle=LINESTYLES[(i // len(MARKERS)) % len(LINESTYLES)],
                        markersize=5, linewidth=1.2, alpha=0.85, label=s, color=f"C{i % 10}")
            ax.set_xlabel(xlabel)
            for g in _coinciding({s: v for s, v in series.items() if v}):
                notes.append(f"{label}: {' = '.join(g)}")
        if key in ("mean_ttft_ms", "p90_ttft_ms"):
            slo = sorted({(r[xkey], r["mean_ttft_slo_ms"] * 1e-3) for r in results
                          if r.get("mean_ttft_slo_ms") is not None})
            if slo and len(xs) > 1:
                ax.plot([x for x, _ in slo], [y for _, y in slo], color="0.4", linestyle="--",
                        linewidth=1, label="mean TTFT SLO")
            elif slo:
                ax.axhline(slo[0][1], color="0.4", linestyle="--", linewidth=1,
                           label="mean TTFT SLO")
        if log_y:
            _readable_log_axis(ax)
        else:
            ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    if notes:  # name the lines drawn on top of each other
        fig.text(0.01, 0.005, "coinciding (offset to show): " + "; ".join(notes[:4]), fontsize=7)
        fig.set_constrained_layout_pads(h_pad=0.25)
    fig.savefig(path, dpi=120)
    plt.close(fig)
