"""Evaluation: traces and workloads, the discrete-event simulator, metrics, reports, CLIs.

Modules: `traces` (Mooncake / Azure / L-Eval loaders), `content` (prompt content model),
`workloads` (rate shaping, the built-in Tool-Agent generator), `ground_truth` (profile-table
clock), `local_cache` and `simulator` (the simulated backend and event loop), `slo`, `metrics`,
`report`, `systems` (what is compared), `experiment` (one comparison as a library), and the CLIs
`replay` and `bench_sim`. Nothing here imports jax directly (grain, used by `traces`, does).
"""
