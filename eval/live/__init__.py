"""Against a running server: `client` (HTTP replay, pool state), `prompts` (token prompts
with real prefix sharing), and the CLIs `loadgen` and `fidelity`."""
