"""NVIDIA Dynamo's KV router: uncached prefill blocks plus active blocks, lowest wins.

Plain Python over plain data; `now` is passed in, never read from a clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.baselines.common import ActiveRequests, argmin_rotating
from serving.policy.request import Request
from serving.policy.worker import WorkerState


class DynamoKvRouter:
    """NVIDIA Dynamo's KV-router cost: weighted uncached prefill blocks plus active blocks.

    Source: ai-dynamo/dynamo, `lib/llm/src/kv_router/scheduler.rs` (`DefaultWorkerSelector::
    select_worker`) and `lib/llm/src/kv_router/sequence.rs` (`ActiveSequences::
    potential_blocks_and_tokens`); defaults from `KvRouterConfig::default()`
    (overlap_score_weight 1.0, router_temperature 0.0). Per worker w, with `overlap_w` the
    blocks of r that w caches (from the workers' KV events) and B the block size:

        potential_prefill_blocks_w = (active_prefill_tokens_w + L_r - overlap_w * B) / B
        potential_decode_blocks_w  = active_blocks_w + #(blocks of r not among them)
        logit_w = overlap_score_weight * potential_prefill_blocks_w + potential_decode_blocks_w

    and the lowest logit wins (temperature 0: the source picks at random among equal minima;
    here the rotating tie-break).

    Mapping to this prefill pool: there is no decode on a prefill worker. A request's KV blocks
    stay allocated on the worker from placement until its prefill ends and the KV leaves for
    the decode pool, so "active (decode) blocks" are the distinct blocks of the requests placed
    on w and not finished (queued + running: its outstanding reserved blocks), and "active
    prefill tokens" are their uncached tokens as estimated at their placement. The router
    tracks these itself (`ActiveRequests`), as Dynamo's router tracks its active sequences.

    Args:
      overlap_score_weight: weight of the prefill blocks against the active blocks, >= 0.

    Raises:
      ValueError: negative overlap_score_weight.
    """

    def __init__(self, overlap_score_weight: float = 1.0, name: str = "dynamo-kv") -> None:
        if not overlap_score_weight >= 0:
            raise ValueError(f"overlap_score_weight must be >= 0, got {overlap_score_weight}")
        self.overlap_score_weight, self.name = float(overlap_score_weight), name
        self._active = ActiveRequests()
        self._rotation = 0

    def logits(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> list[float]:
        """The logit of each candidate (blocks; lower is better); see the class docstring."""
        bs, n = request.block_size, request.input_len
        active, weight = self._active, self.overlap_score_weight
        out = []
        for w, m in zip(candidates, matched_blocks):
            active.sync(w)
            wid = w.worker_id
            prefill_blocks = (active.tokens(wid) + n - min(m * bs, n)) / bs
            decode_blocks = active.blocks(wid) + active.new_blocks(wid, request.block_hashes)
            out.append(weight * prefill_blocks + decode_blocks)
        return out

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        i = argmin_rotating(self.logits(request, candidates, matched_blocks, now), self._rotation)
        self._rotation += 1
        new_tokens = request.input_len - min(matched_blocks[i] * request.block_size,
                                             request.input_len)
        self._active.add(candidates[i].worker_id, new_tokens, request.block_hashes)
        return i
