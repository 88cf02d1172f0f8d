"""The discrete-event simulator: `simulator` (event loop), `backend` (simulated workers),
`local_cache` (their LRU prefix caches), `ground_truth` (the profile-table clock).
Imports the policy core and numpy only."""
