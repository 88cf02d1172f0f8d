"""Evaluation: traces and workloads, the discrete-event simulator, metrics, reports, CLIs.

- `eval.traces`: trace loaders (`loaders`: Mooncake / Azure / L-Eval; `parsing`), the prompt
  content model (`content`), rate shaping and the built-in Tool-Agent generator (`workloads`),
  time-varying scenarios (`scenarios`);
- `eval.sim`: the simulator (`simulator`: event loop; `backend`: simulated workers;
  `local_cache`: their LRU prefix caches; `ground_truth`: the profile-table clock);
- `eval.live`: against a running server (`client`, `prompts`, the `loadgen` and `fidelity` CLIs,
  the `soak` test);
- here: `slo`, `metrics`, `report`, `systems` (what is compared), `experiment` (one comparison
  as a library) and the CLIs `replay`, `paper`, `bench_sim`, `bench_router` (and `loadgen`,
  `fidelity`, `soak`, which run `eval.live`'s).

Nothing here imports jax directly (grain, used by `eval.traces.loaders`, does); nothing outside
`eval` imports it.
"""
