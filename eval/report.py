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


def plot_vs_rate(results: Sequence[dict], path: str, title: str) -> None:
    """Writes a PNG with mean TTFT, P90 TTFT and SLO attainment against request rate.

    One line per system; x is `request_rate` (req/s); TTFT axes are logarithmic so that the
    region before saturation stays readable.
    """
    systems = sorted({r["system"] for r in results})
    fig, axes = plt.subplots(1, len(PLOTS), figsize=(5 * len(PLOTS), 3.8), constrained_layout=True)
    for ax, (key, label, scale, log_y) in zip(axes, PLOTS):
        for s in systems:
            pts = sorted((r["request_rate"], r[key]) for r in results
                         if r["system"] == s and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], marker="o", label=s)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
