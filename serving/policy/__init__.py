"""The policy core: routing, scheduling and cache bookkeeping over plain data.

numpy only, never jax; time is passed in (`now`, seconds), never read from a clock. Driven by
the simulated backend in `eval/` and by the live JAX backend. Public names:

- requests: `Request`, `chain_block_hashes`, `prompt_block_hashes` (token ids -> the chain),
  `block_content_id`, `num_blocks`;
- workers: `WorkerSpec` (with its host), `WorkerState`, `WorkerStatus`, `layout_workers`,
  `homogeneous_degrees`;
- scheduling: `Scheduler`, `RequestRecord`, `Backend`, `PrefillResult`, `PrefixIndex`;
- routing: `Router` (protocol), `LeastWorkRouter`;
- cost: `PrefillCostModel` (profiles and GPU/model specs live in `serving.policy.profiles`,
  `serving.policy.specs`).

Modules: `request`, `worker`, `backend` (the protocol both backends implement), `scheduler`
(queues, reservations, exactly-once completion) and its collaborators `reconfiguration`
(epochs, splits and merges in progress), `replication` (prefix copies and reclamations, priced
by host) and `membership` (workers lost with their host, or added),
`router` (protocol), `cost_router` and `fetch_router` (Vertumnus's placement cost),
`composition` (the what-if split / merge controller; `whatif`, its replay) and `controller`
(the paper's threshold controller), `prefix_index`, `prefix_trie`, `cache_manager`, `cost_model`,
`profiles`, `specs`, `plugins` (`module:attr` loading), `checks`.
"""

from serving.policy.backend import Backend, PrefillResult
from serving.policy.cost_model import PrefillCostModel
from serving.policy.prefix_index import PrefixIndex
from serving.policy.request import (Request, RequestRecord, block_content_id, chain_block_hashes,
                                    num_blocks, prompt_block_hashes)
from serving.policy.router import LeastWorkRouter, Router
from serving.policy.scheduler import Scheduler
from serving.policy.worker import (WorkerSpec, WorkerState, WorkerStatus, homogeneous_degrees,
                                   layout_workers)

__all__ = [
    "Backend", "LeastWorkRouter", "PrefillCostModel", "PrefillResult", "PrefixIndex", "Request",
    "RequestRecord", "Router", "Scheduler", "WorkerSpec", "WorkerState", "WorkerStatus",
    "block_content_id", "chain_block_hashes", "homogeneous_degrees", "layout_workers",
    "num_blocks", "prompt_block_hashes",
]
