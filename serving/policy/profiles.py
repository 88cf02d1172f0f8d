"""Prefill profile tables: CSV I/O and a built-in analytic generator for named (GPU, model) pairs.

A *profile table* lists measured or modelled prefill times, one row per (CP degree, input length,
cached length): columns `cp, input_len, cached_len, seconds`. The router's `PrefillCostModel` is
fitted to one; the simulator's `GroundTruthProfile` interpolates one. A measured profile (a later
issue times real JAX prefill) drops in as the same CSV.

The analytic generator (`analytic_prefill_seconds`) is a per-layer roofline. Every assumption:
  * FLOPs (`prefill_flops`): matmuls count 2*m*k*n; projections, MLP/MoE and the router only for
    the n = L - h new tokens; causal attention: new query at global position p (0-based) sees p+1
    keys, 4*d FLOPs per (query head, key) pair (QK^T and PV), so
    sum_{p=h}^{L-1} (p+1) = ((L^2 - h^2) + (L - h)) / 2 pairs and 2*Hq*d*((L^2-h^2) + (L-h))
    FLOPs per layer. LM head for the last token only (2*D*V). Norms, RoPE, softmax, SwiGLU's
    elementwise product and the embedding gather are ignored (< 1 % at these shapes).
  * Efficiency: achieved rate = peak * mfu_max * t / (t + mfu_half_tokens), t = new tokens per
    GPU (n / C). mfu_max = 0.6 from the 63 % FLOPS utilisation Meta reports for CP prefill on
    H100 (arXiv 2411.01783, abstract); mfu_half_tokens = 64 is an assumption (small GEMMs and
    short attention tiles waste tensor-core waves), to be replaced by a measured profile.
  * Memory floor per layer: weights touched read once from HBM (MoE: experts touched =
    min(E, t*k)), plus the layer's K/V of all L tokens read once; layer time = max(compute,
    memory) (roofline).
  * CP all-gather per layer: each rank receives (C-1)/C * L * kv_bytes_per_token_per_layer (the
    other ranks' new tokens and the cached prefix, striped block i -> rank i mod C), at half the
    bidirectional NVLink figure times `link_efficiency` (0.8, NCCL bus-bandwidth typical), plus
    `collective_latency_s` (20 us) per collective; added, not overlapped (conservative).
  * TP (degree T): projections and heads split T ways, two ring all-reduces of n*D*dtype bytes
    per layer (2*(T-1)/T of the bytes each). `tp_per_rank` combines both (CP over TP groups, as
    in Meta's CP paper: TP8 inside a host, CP across hosts over the scale-out NIC).
  * A fixed per-prefill overhead (`fixed_overhead_s`, 5 ms: host scheduling, launch gaps, first
    token sampling) is added once. Capacity (weights fitting in HBM) is *not* checked here.
GPU and model figures and their sources are on each registry entry.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os

import numpy as np

from serving.policy.specs import GPUS, MODELS, GpuSpec, ModelSpec, resolve_spec  # noqa: F401 (GPUS, MODELS re-exported)

_COLUMNS = ("cp", "input_len", "cached_len", "seconds")
# Integer columns pass through float64 in `ProfileTable`; beyond 2^53 it no longer holds every
# integer (and int64 overflows at 2^63), so larger magnitudes are rejected.
MAX_INT_MAGNITUDE = 2**53
DEFAULT_FIXED_OVERHEAD_S = 5e-3
# Up to 0.99 and the edge h = L - 1 (`generate_profile`): agent traffic lives at 95-99 % hits.
DEFAULT_CACHED_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
# A measured profile whose rows stop below this cached fraction is extrapolated above it.
FULL_COVERAGE_FRACTION = 0.99
DEFAULT_INPUT_LENS = tuple(int(x) for x in np.unique(np.round(np.geomspace(128, 262144, 23))))


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True, eq=False)
class ProfileTable:
    """Prefill times, one row per (CP degree, input length, cached length).

    Attributes (all 1-D numpy arrays of one length N):
      cp: int64 [N], worker degree (GPUs per worker), a power of two >= 1.
      input_len: int64 [N], prompt tokens L >= 1.
      cached_len: int64 [N], prefix-hit tokens h, 0 <= h < L.
      seconds: float64 [N], prefill time in seconds, finite and > 0.

    Raises:
      ValueError: naming the column and the first bad row index when a column is not 1-D, lengths
        differ, values are not integral/finite, an integer column exceeds 2^53 in magnitude, or a
        value is out of the range above.
    """

    cp: np.ndarray
    input_len: np.ndarray
    cached_len: np.ndarray
    seconds: np.ndarray

    def __post_init__(self):
        cols = {}
        for name in _COLUMNS:
            a = np.asarray(getattr(self, name), dtype=np.float64)
            if a.ndim != 1:
                raise ValueError(f"ProfileTable.{name} must be 1-D, got shape {a.shape}")
            bad = np.flatnonzero(~np.isfinite(a))
            if bad.size:
                raise ValueError(f"ProfileTable.{name}[{bad[0]}] = {a[bad[0]]} is not finite")
            if name != "seconds":
                bad = np.flatnonzero(a != np.round(a))
                if bad.size:
                    raise ValueError(
                        f"ProfileTable.{name}[{bad[0]}] = {a[bad[0]]} is not an integer")
                bad = np.flatnonzero(np.abs(a) > MAX_INT_MAGNITUDE)
                if bad.size:
                    raise ValueError(f"ProfileTable.{name}[{bad[0]}] = {a[bad[0]]} must be in "
                                     f"[-2^53, 2^53]")
                a = a.astype(np.int64)
            cols[name] = a
        n = {len(v) for v in cols.values()}
        if len(n) != 1:
            lens = {k: len(v) for k, v in cols.items()}
            raise ValueError(f"ProfileTable columns differ in length: {lens}")
        checks = (
            ("cp", (cols["cp"] < 1) | ((cols["cp"] & (cols["cp"] - 1)) != 0),
             "a power of two >= 1"),
            ("input_len", cols["input_len"] < 1, ">= 1"),
            ("cached_len", (cols["cached_len"] < 0) | (cols["cached_len"] >= cols["input_len"]),
             "in [0, input_len)"),
            ("seconds", cols["seconds"] <= 0, "> 0"),
        )
        for name, mask, allowed in checks:
            bad = np.flatnonzero(mask)
            if bad.size:
                raise ValueError(
                    f"ProfileTable.{name}[{bad[0]}] = {cols[name][bad[0]]} must be {allowed}")
        for name, a in cols.items():
            a.setflags(write=False)
            object.__setattr__(self, name, a)

    def __len__(self) -> int:
        return len(self.seconds)

    @property
    def degrees(self) -> tuple[int, ...]:
        """Sorted distinct CP degrees in the table."""
        return tuple(int(c) for c in np.unique(self.cp))

    def select(self, cp_degree: int) -> ProfileTable:
        """The rows of one degree; ValueError naming cp_degree when the table has none."""
        mask = self.cp == cp_degree
        if not mask.any():
            raise ValueError(f"cp_degree={cp_degree} not in the table; degrees {self.degrees}")
        return ProfileTable(*(getattr(self, c)[mask] for c in _COLUMNS))


def _parse_int(text: str, where: str) -> int:
    """An integer written as such ("1000") or as an integral float ("1e3"), |value| <= 2^53."""
    shown = repr(text) if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)"
    try:
        v = int(text)
    except ValueError:  # also a string past sys.get_int_max_str_digits() digits
        try:
            f = float(text)
        except ValueError:
            f = math.nan
        if math.isinf(f):  # "1e400", or more digits than int() converts
            raise ValueError(f"{where}: {shown} is out of range; integers must be in "
                             f"[-2^53, 2^53]") from None
        if not (math.isfinite(f) and f.is_integer()):
            raise ValueError(f"{where}: {shown} is not an integer") from None
        v = int(f)
    if abs(v) > MAX_INT_MAGNITUDE:
        raise ValueError(f"{where}: {shown} is out of range; integers must be in [-2^53, 2^53]")
    return v


def read_profile_csv(path: str | os.PathLike) -> ProfileTable:
    """Reads a profile CSV (UTF-8, a leading byte-order mark accepted; header naming at least
    cp,input_len,cached_len,seconds, each once; extra columns ignored; fully blank lines ignored).

    Integer columns accept "1000" or an integral float such as "1e3", at most 2^53 in magnitude
    (see `MAX_INT_MAGNITUDE`); seconds must be finite and > 0.

    Raises:
      ValueError: `<path>:<line>: column '<name>': ...` for a missing or repeated column, a wrong
        field count, an unparsable value or one out of range (ranges as in `ProfileTable`); also
        for no rows, or a file that is not UTF-8.
    """
    try:
        return _read_profile_csv(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start} of a "
                         f"{len(e.object)}-byte read)") from None


def _read_profile_csv(path: str | os.PathLike) -> ProfileTable:
    cols: dict[str, list] = {c: [] for c in _COLUMNS}
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}:1: empty file; expected header {','.join(_COLUMNS)}")
        header = [h.strip() for h in header]
        missing = [c for c in _COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}:1: header lacks column(s) {missing}; "
                             f"required: {','.join(_COLUMNS)}")
        repeated = [c for c in _COLUMNS if header.count(c) > 1]
        if repeated:
            col = repeated[0]
            raise ValueError(f"{path}:1: column '{col}' appears {header.count(col)} times in the "
                             f"header; each of {','.join(_COLUMNS)} must appear once")
        idx = {c: header.index(c) for c in _COLUMNS}
        for row in reader:
            line = reader.line_num
            if not any(x.strip() for x in row):
                continue
            if len(row) != len(header):
                raise ValueError(f"{path}:{line}: expected {len(header)} fields, got {len(row)}")
            at = {c: f"{path}:{line}: column '{c}'" for c in _COLUMNS}
            cp = _parse_int(row[idx["cp"]].strip(), at["cp"])
            L = _parse_int(row[idx["input_len"]].strip(), at["input_len"])
            h = _parse_int(row[idx["cached_len"]].strip(), at["cached_len"])
            try:
                s = float(row[idx["seconds"]])
            except ValueError:
                raise ValueError(
                    f"{at['seconds']}: {row[idx['seconds']]!r} is not a number") from None
            if not _is_pow2(cp):
                raise ValueError(f"{at['cp']}: {cp} must be a power of two >= 1")
            if L < 1:
                raise ValueError(f"{at['input_len']}: {L} must be >= 1")
            if not 0 <= h < L:
                raise ValueError(f"{at['cached_len']}: {h} must be in [0, input_len={L})")
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"{at['seconds']}: {s} must be finite and > 0")
            for c, v in zip(_COLUMNS, (cp, L, h, s)):
                cols[c].append(v)
    if not cols["cp"]:
        raise ValueError(f"{path}: no data rows")
    return ProfileTable(*(np.asarray(cols[c]) for c in _COLUMNS))


def coverage_gaps(table: ProfileTable, min_fraction: float = FULL_COVERAGE_FRACTION,
                  slack_tokens: int = 512) -> list[tuple[int, int, float]]:
    """The rows of `table` (one per CP degree and input length) whose largest cached prefix
    stops short of `min_fraction` of the prompt: `L - h_max > ceil((1 - min_fraction) L) +
    slack_tokens`, as `(cp, input_len, largest fraction)`. The slack allows for a measured
    profile's cached lengths rounded down to whole KV blocks (`vertumnus_jax.profile`). A
    prefill with more of its prompt cached is charged that row's largest-fraction time by the
    simulator's ground truth (held, not extrapolated down), so such a table over-charges
    prompts that are mostly cached (agent traffic: 95-99 %)."""
    best: dict[tuple[int, int], int] = {}
    for c, L, h in zip(np.asarray(table.cp).tolist(), np.asarray(table.input_len).tolist(),
                       np.asarray(table.cached_len).tolist()):
        key = (int(c), int(L))
        best[key] = max(best.get(key, 0), int(h))
    return [(c, L, h / L) for (c, L), h in sorted(best.items())
            if L - h > math.ceil((1 - min_fraction) * L) + slack_tokens]


def write_profile_csv(table: ProfileTable, path: str | os.PathLike) -> None:
    """Writes `table` as CSV with header cp,input_len,cached_len,seconds (seconds as repr floats,
    so a round trip is exact)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_COLUMNS)
        for cp, L, h, s in zip(table.cp, table.input_len, table.cached_len, table.seconds):
            w.writerow((int(cp), int(L), int(h), repr(float(s))))


def prefill_flops(model: ModelSpec | str, input_len: int, cached_len: int) -> dict[str, float]:
    """FLOPs of one prefill of L = input_len tokens with h = cached_len cached (module doc gives
    the counting rules). Returns totals over all layers under keys qkv_proj, o_proj, attention,
    mlp, router, lm_head and total.

    Raises:
      ValueError: unless 0 <= cached_len < input_len.
    """
    m = resolve_spec(model, MODELS, "model")
    L, h = int(input_len), int(cached_len)
    if not 0 <= h < L:
        raise ValueError(f"cached_len={h} must be in [0, input_len={L})")
    n, D, d, Nl = L - h, m.hidden, m.head_dim, m.num_layers
    out = {
        "qkv_proj": Nl * 2.0 * n * D * (m.num_q_heads + 2 * m.num_kv_heads) * d,
        "o_proj": Nl * 2.0 * n * m.num_q_heads * d * D,
        "attention": Nl * 2.0 * m.num_q_heads * d * ((L * L - h * h) + (L - h)),
        "mlp": Nl * (6.0 * n * D * m.intermediate if m.num_experts == 0
                     else 6.0 * n * m.experts_per_token * D * m.moe_intermediate),
        "router": Nl * 2.0 * n * D * m.num_experts,
        "lm_head": 2.0 * D * m.vocab,
    }
    out["total"] = sum(out.values())
    return out


def analytic_prefill_seconds(gpu: GpuSpec | str, model: ModelSpec | str, cp_degree: int,
                             input_len: int, cached_len: int, parallelism: str = "cp", *,
                             tp_per_rank: int = 1,
                             fixed_overhead_s: float = DEFAULT_FIXED_OVERHEAD_S) -> float:
    """Modelled prefill seconds on one worker (assumptions in the module docstring).

    Args:
      gpu, model: specs or registry names (`GPUS`, `MODELS`).
      cp_degree: the worker's degree C (power of two >= 1): CP ranks for "cp", TP ways for "tp".
      input_len, cached_len: L >= 1 tokens, of which h (0 <= h < L) are a prefix hit.
      parallelism: "cp" (zigzag context parallel) or "tp" (tensor parallel, a vLLM-like TP-C).
      tp_per_rank: TP ways inside each CP rank ("cp" only), so the worker has C*tp_per_rank GPUs.
      fixed_overhead_s: seconds added once per prefill.

    Raises:
      ValueError: naming the field on an unknown name or out-of-range value.
    """
    g, m = resolve_spec(gpu, GPUS, "gpu"), resolve_spec(model, MODELS, "model")
    if parallelism not in ("cp", "tp"):
        raise ValueError(f"parallelism={parallelism!r} must be 'cp' or 'tp'")
    for name, v in (("cp_degree", cp_degree), ("tp_per_rank", tp_per_rank)):
        if not _is_pow2(int(v)):
            raise ValueError(f"{name}={v} must be a power of two >= 1")
    if parallelism == "tp" and tp_per_rank != 1:
        raise ValueError(f"tp_per_rank={tp_per_rank} must be 1 when parallelism='tp'")
    cp, tp = (int(cp_degree), int(tp_per_rank)) if parallelism == "cp" else (1, int(cp_degree))
    fl = prefill_flops(m, input_len, cached_len)
    L, n = int(input_len), int(input_len) - int(cached_len)
    peak = g.bf16_tflops * 1e12
    hbm = g.hbm_tb_per_s * 1e12
    intra = g.nvlink_gb_per_s / 2 * 1e9 * g.link_efficiency
    link = intra if cp * tp <= g.gpus_per_host else g.scaleout_gb_per_s * 1e9 * g.link_efficiency
    t = n / cp  # new tokens per CP rank (each TP way sees all of them)
    eff = g.mfu_max * t / (t + g.mfu_half_tokens)
    layer_flops = (fl["total"] - fl["lm_head"]) / m.num_layers
    compute = layer_flops / (cp * tp) / (peak * eff)
    experts = min(m.num_experts, t * m.experts_per_token) if m.num_experts else None
    kv_split = min(tp, m.num_kv_heads)
    kv_layer = m.kv_bytes_per_token_per_layer
    mem_bytes = ((m.attn_params_per_layer + m.mlp_params_per_layer(experts)) * m.dtype_bytes / tp
                 + L * kv_layer / kv_split)
    layer = max(compute, mem_bytes / hbm)
    if tp > 1:  # two ring all-reduces of the rank's activations
        layer += 2 * (2 * (tp - 1) / tp * t * m.hidden * m.dtype_bytes / intra
                      + g.collective_latency_s)
    if cp > 1:  # all-gather of new K/V plus the striped cached prefix
        layer += (cp - 1) / cp * L * kv_layer / kv_split / link + g.collective_latency_s
    lm = max(fl["lm_head"] / tp / (peak * g.mfu_max), m.vocab * m.hidden * m.dtype_bytes / tp / hbm)
    return float(fixed_overhead_s + m.num_layers * layer + lm)


def generate_profile(gpu: GpuSpec | str, model: ModelSpec | str,
                     degrees=(1, 2, 4, 8), input_lens=DEFAULT_INPUT_LENS,
                     cached_fractions=DEFAULT_CACHED_FRACTIONS, parallelism: str = "cp",
                     edge: bool = True, **kwargs) -> ProfileTable:
    """Analytic profile on a grid: every degree x input length x cached fraction f, with
    cached_len = floor(f * L) kept exact (not block-rounded), rows with cached_len >= L dropped;
    with `edge`, also cached_len = L - 1 (one new token, the limit h -> L), so interpolation
    never holds a fraction's time beyond the grid (`eval.sim.ground_truth`).

    Defaults: input lengths 128..262144 log-spaced in steps of sqrt(2) (23 points), fractions
    0, .25, .5, .75, .9, .95, .99, and the edge. `kwargs` go to `analytic_prefill_seconds`.

    Raises:
      ValueError: on a fraction outside [0, 1) or an empty grid.
    """
    rows = []
    for f in cached_fractions:
        if not 0.0 <= f < 1.0:
            raise ValueError(f"cached_fractions entry {f} must be in [0, 1)")
    for c in degrees:
        for L in input_lens:
            hs = sorted({int(math.floor(f * L)) for f in cached_fractions}
                        | ({int(L) - 1} if edge and cached_fractions else set()))
            for h in hs:
                if h < L:
                    s = analytic_prefill_seconds(gpu, model, c, int(L), h, parallelism, **kwargs)
                    rows.append((c, int(L), h, s))
    if not rows:
        raise ValueError("empty grid: degrees, input_lens and cached_fractions must be non-empty")
    return ProfileTable(*(np.asarray(col) for col in zip(*rows)))


def _main(argv):
    del argv
    from absl import flags

    from serving.policy.cost_model import PrefillCostModel

    F = flags.FLAGS
    degrees = tuple(int(x) for x in F.degrees)
    table = generate_profile(F.gpu, F.model, degrees, parallelism=F.parallelism)
    os.makedirs(os.path.dirname(F.out) or ".", exist_ok=True)
    write_profile_csv(table, F.out)
    print(f"wrote {len(table)} rows to {F.out} ({F.gpu}, {F.model}, {F.parallelism})")
    fit = PrefillCostModel.fit(table)
    print("\n| C | a (s) | b (s/token) | g (s/token^2) | d (s/token) | floor (s) "
          "| from new tokens | mean rel err | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c, (mean, mx) in fit.fit_error().items():
        k, (f, nf) = fit.coefficients(c), fit.floors()[c]
        print(f"| {c} | {k['a']:.4g} | {k['b']:.4g} | {k['g']:.4g} | {k['d']:.4g} | {f:.4g} "
              f"| {nf} | {mean:.2%} | {mx:.2%} |")
    print("\n| input_len | " + " | ".join(f"C={c} (s)" for c in degrees) + " |")
    print("|---|" + "---|" * len(degrees))
    for L in (8192, 32768, 131072):
        cells = [f"{analytic_prefill_seconds(F.gpu, F.model, c, L, 0, F.parallelism):.3f}"
                 for c in degrees]
        print(f"| {L} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_enum("gpu", "h20", sorted(GPUS), "GPU profile name.")
    flags.DEFINE_enum("model", "qwen3-30b-a3b", sorted(MODELS), "Model profile name.")
    flags.DEFINE_list("degrees", ["1", "2", "4", "8"], "Worker degrees to profile.")
    flags.DEFINE_enum("parallelism", "cp", ["cp", "tp"], "Parallelism inside a worker.")
    flags.DEFINE_string("out", "out/profile.csv", "Output CSV path.")
    app.run(_main)
