"""Baseline routers that score workers by KV-cache state and load: Dynamo's KV router and
Mooncake's Conductor. Re-exported by `serving.baselines`; shared pieces in
`serving.baselines_common`. Plain Python over plain data; `now` is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.baselines_common import ActiveRequests, argmin_rotating
from serving.replication import FetchOnDispatch, check_transfer_args, copy_seconds
from serving.request import Request
from serving.worker import WorkerState


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


class MooncakeConductorRouter:
    """Mooncake's Conductor: the worker with the earliest estimated TTFT, counting KV transfer.

    Source: Qin et al., "Mooncake: Trading More Storage for Less Computation - A KVCache-centric
    Architecture for Serving LLM Chatbot", FAST '25 (arXiv 2407.00079), section 6.1,
    Algorithm 1 (KVCache-centric scheduling), and section 6.2 (cache load balancing);
    kvcache-ai/Mooncake. For request r with best_len = the longest prefix of r any candidate
    holds, and for each candidate w with local prefix h_w:

        T_queue(w)  = predicted prefill time of the work queued on w (Q_w, seconds)
        local(w)    = T(C_w, L_r, h_w)
        remote(w)   = T_transfer(best_len - h_w) + T(C_w, L_r, best_len)
        TTFT(w)     = T_queue(w) + min(local(w), remote(w))   if best_len > h_w and
                                                               best_len >= threshold * h_w
                    = T_queue(w) + local(w)                    otherwise

    with T the fitted prefill-time model and T_transfer(k) = k * B * kv_bytes_per_token /
    (transfer_gb_per_s * 1e9). The lowest TTFT wins. Algorithm 1 takes the transfer branch
    whenever `best_len / h_w` reaches `kvcache_balancing_threshold`; like section 6.2 (fetch
    the remote prefix only when that beats recomputing it) the branch here keeps the cheaper
    plan. The paper gives no threshold value; the default 1.0 considers every longer remote
    prefix. SLO-based early rejection and the decode-instance choice are out of scope (decode
    is a separate pool).

    A transfer plan is executed when the request leaves the chosen worker's queue
    (`serving.replication.FetchOnDispatch`): the scheduler copies the missing blocks of the
    longest prefix another worker holds then (reason "request-transfer"), and the simulated
    backend starts the prefill when the copy is done, so the run is charged queue + transfer +
    prefill with the fetched prefix, as Algorithm 1 estimates it (the live backend copies but
    does not hold the prefill for the copy). A fetch not made (nothing longer to fetch by then,
    or the copy refused) leaves the request on its local prefix; `fetches.started` /
    `fetches.skipped` count them. Among equal estimates the plan that copies less wins (then
    round-robin). The scheduler reserves the local-prefix estimate. `last_transfer_blocks`
    reports the plan of the last choice.

    Args:
      kv_bytes_per_token: bytes of K and V of one token, all layers
        (`ModelSpec.kv_bytes_per_token`), >= 0.
      transfer_gb_per_s: bandwidth of a KV copy between workers, GB/s (1e9 bytes/s), >= 0;
        0 = free. Default 100, the simulator's `SimConfig.replication_gb_per_s` (the rate it
        charges the copies at).
      kvcache_balancing_threshold: ratio best_len / h_w from which a transfer is considered, >= 1.
      cost_model: `predict(cp_degree, input_len, cached_len) -> seconds`; None = the
        scheduler's (set by `bind`).
      execute_transfers: copy the planned prefix (True), or only estimate with it (False: the
        chosen worker prefills from its local prefix).

    Raises:
      ValueError: an argument outside the range above.
    """

    def __init__(self, kv_bytes_per_token: int, transfer_gb_per_s: float = 100.0,
                 kvcache_balancing_threshold: float = 1.0, cost_model=None,
                 name: str = "mooncake-conductor", execute_transfers: bool = True) -> None:
        check_transfer_args(kv_bytes_per_token, transfer_gb_per_s)
        if not kvcache_balancing_threshold >= 1.0:
            raise ValueError(f"kvcache_balancing_threshold must be >= 1, got "
                             f"{kvcache_balancing_threshold}")
        self.kv_bytes_per_token = int(kv_bytes_per_token)
        self.transfer_gb_per_s = float(transfer_gb_per_s)
        self.kvcache_balancing_threshold = float(kvcache_balancing_threshold)
        self.cost_model, self.name = cost_model, name
        self.last_transfer_blocks = 0
        self.execute_transfers = bool(execute_transfers)
        self.fetches = FetchOnDispatch()
        self._rotation = 0

    def bind(self, scheduler) -> None:
        if self.cost_model is None:
            self.cost_model = scheduler.cost_model
        if self.execute_transfers:
            self.fetches.attach(scheduler)

    def transfer_seconds(self, blocks: int, block_size: int) -> float:
        """Time to copy `blocks` KV blocks of `block_size` tokens between workers (seconds)."""
        return copy_seconds(blocks, block_size, self.kv_bytes_per_token, self.transfer_gb_per_s)

    def plans(self, request: Request, candidates: Sequence[WorkerState],
              matched_blocks: Sequence[int], now: float) -> list[tuple[float, int]]:
        """Per candidate: (estimated TTFT in seconds, blocks the plan copies from elsewhere)."""
        predict, n, bs = self.cost_model.predict, request.input_len, request.block_size
        best = max(matched_blocks)
        out = []
        for w, m in zip(candidates, matched_blocks):
            c = w.spec.cp_degree
            t, copied = predict(c, n, m * bs), 0
            if best > m and best >= self.kvcache_balancing_threshold * m:
                remote = self.transfer_seconds(best - m, bs) + predict(c, n, best * bs)
                if remote < t:
                    t, copied = remote, best - m
            out.append((w.outstanding_seconds(now) + t, copied))
        return out

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        plans = self.plans(request, candidates, matched_blocks, now)
        i = argmin_rotating(plans, self._rotation)  # (TTFT, blocks copied): fewer copies on ties
        self._rotation += 1
        self.last_transfer_blocks = copied = plans[i][1]
        if copied:
            self.fetches.plan(request, candidates[i].spec.worker_id, matched_blocks[i] + copied)
        return i
