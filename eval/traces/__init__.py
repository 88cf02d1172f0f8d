"""Trace loaders and workloads: `loaders` (Mooncake, Azure, L-Eval), `parsing`, `content`,
`workloads` (rate shaping, the Tool-Agent generator), `scenarios` (time-varying demand)."""
