"""Vertumnus policy core: routing, scheduling and cache bookkeeping over plain data.

numpy only, never jax; time is passed in (`now`, seconds), never read from a clock. Driven by
the simulated backend in `eval/` and by the live JAX backend. Public names:

- requests: `Request`, `chain_block_hashes`, `prompt_block_hashes` (token ids -> the chain),
  `block_content_id`, `num_blocks`;
- workers: `WorkerSpec`, `WorkerState`, `WorkerStatus`, `layout_workers`, `homogeneous_degrees`;
- scheduling: `Scheduler`, `RequestRecord`, `Backend`, `PrefillResult`, `PrefixIndex`;
- routing: `Router` (protocol), `LeastWorkRouter`;
- cost: `PrefillCostModel` (profiles and GPU/model specs live in `serving.profiles`,
  `serving.specs`).
"""

from serving.backend import Backend, PrefillResult
from serving.cost_model import PrefillCostModel
from serving.prefix_index import PrefixIndex
from serving.request import (Request, block_content_id, chain_block_hashes, num_blocks,
                             prompt_block_hashes)
from serving.router import LeastWorkRouter, Router
from serving.scheduler import RequestRecord, Scheduler
from serving.worker import WorkerSpec, WorkerState, WorkerStatus, homogeneous_degrees, layout_workers

__all__ = [
    "Backend", "LeastWorkRouter", "PrefillCostModel", "PrefillResult", "PrefixIndex", "Request",
    "RequestRecord", "Router", "Scheduler", "WorkerSpec", "WorkerState", "WorkerStatus",
    "block_content_id", "chain_block_hashes", "homogeneous_degrees", "layout_workers",
    "num_blocks", "prompt_block_hashes",
]
