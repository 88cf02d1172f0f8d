"""Against a running server: `client` (HTTP replay, pool state), `prompts` (token prompts
with real prefix sharing), the CLIs `loadgen` and `fidelity`, and the soak test `soak` (with
`soak_config`, `soak_run`, `soak_ledger`, `soak_ops`, `soak_report`)."""
