"""Baseline routers: the rules of today's serving systems, on the same `Router` protocol.

Each is a class with `name`, `choose(request, candidates, matched_blocks, now) -> index` and,
where it needs the scheduler's cost model, `bind(scheduler)`. Ties are broken by a rotating
start (`argmin_rotating`): deterministic, no bias toward worker 0. Where the source breaks ties
at random, the rotation stands in for it. Sources are cited on each class.

- `StaticThresholdRouter`: two fixed groups by input length (FlexLB's long-context rule).
- `VllmPrefixAwareRouter`: vLLM production-stack's `prefixaware` routing logic.
- `SglangCacheAwareRouter`: SGLang router's `cache_aware` policy.
- `DynamoKvRouter`: Dynamo's KV-router cost.
- `MooncakeConductorRouter`: Mooncake's Conductor (earliest estimated TTFT, counting KV transfer).

One module per system family: `static_threshold`, `vllm`, `sglang`, `dynamo`, `mooncake`;
shared pieces (`argmin_rotating`, `RoutedPrefixTrie`, `ActiveRequests`) in `common`.
numpy-free plain Python over plain data; `now` is passed in, never read from a clock.
"""


from serving.baselines.common import argmin_rotating
from serving.baselines.dynamo import DynamoKvRouter
from serving.baselines.mooncake import MooncakeConductorRouter
from serving.baselines.sglang import SglangCacheAwareRouter
from serving.baselines.static_threshold import StaticThresholdRouter
from serving.baselines.vllm import VllmPrefixAwareRouter

__all__ = [
    "DynamoKvRouter", "MooncakeConductorRouter", "SglangCacheAwareRouter",
    "StaticThresholdRouter", "VllmPrefixAwareRouter", "argmin_rotating",
]
