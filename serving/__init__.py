"""Vertumnus-JAX serving: the policy core, the baselines and the live service.

- `serving.policy`: the policy core (scheduler, routers, controller, prefix trie, cache manager,
  cost model, profiles). Plain Python and numpy over plain data, time passed in; driven by the
  simulator in `eval.sim` and by the live backend here.
- `serving.baselines`: today's routers (vLLM, SGLang, Dynamo, Mooncake, FlexLB's threshold) on
  the same `Router` protocol.
- the live service (this folder): `main` (the absl binary), `server` (assembly), `api` and
  `api_models` (FastAPI, OpenAI-compatible), `engine` (asyncio), `live_backend` (JAX prefill on
  device submeshes), `prom` (Prometheus metrics), `tokenizer`.

The policy core's public names are re-exported here (`from serving import Scheduler` works as
`from serving.policy import Scheduler`); importing `serving` loads neither jax nor the web stack.
"""

from serving.policy import *  # noqa: F401,F403 (the policy core's public names)
from serving.policy import __all__  # noqa: F401
