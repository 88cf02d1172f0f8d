"""Mooncake's Conductor: the earliest estimated TTFT, counting the KV transfer of a prefix.

Plain Python over plain data; `now` is passed in, never read from a clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.baselines.common import argmin_rotating
from serving.policy.replication import FetchOnDispatch, check_transfer_args, copy_seconds
from serving.policy.request import Request
from serving.policy.worker import WorkerState


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
    (`serving.policy.replication.FetchOnDispatch`): the scheduler copies the missing blocks of the
    longest prefix another worker holds then (reason "request-transfer"), and the simulated
    backend starts the prefill when the copy is done, so the run is charged queue + transfer +
    prefill with the fetched prefix, as Algorithm 1 estimates it (the live backends hold it too:
    `serving.fetch_wait`). A fetch not made (nothing longer to fetch by then,
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
