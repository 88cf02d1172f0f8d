"""The live working set of each worker, and what a placement's evictions cost (issue 15).

A prefix cache evicts least recently used blocks. A placement that brings `n` new blocks to a
worker whose cache is full evicts `n` blocks; that costs nothing when they are dead (no request
will ask for them again) and a second prefill of them when they are live. The placement cost
of `serving.policy.cost_router` prices a cache miss for the request it places, never the
misses it causes for others: on long closed-loop sessions (agents, ~100K-token contexts, the
pool's KV caches saturating before its compute) it moved sessions to idle workers whose caches
then evicted other sessions' contexts, which were prefilled again (eval/RESULTS.md).

Here a block is *live* on worker w when a request placed on w within the last `horizon_s`
seconds uses it (the working-set model: Denning, "The working set model for program
behavior", CACM 1968; the window is the horizon). With `live_w` the live blocks of w,
`K_w` its KV capacity (blocks) and `new_w = floor(L / B) - m_w` the full blocks the request
must write there (its prefix `m_w` is cached or promised; a partial last block is never
cached), the live blocks it evicts are

    over_w = min(new_w, live_w + new_w - K_w)            (0 when the live set still fits)

and each is prefilled again on w if it is asked for again, so the placement is charged the
expected cost

    E_w = p * (beta + lambda * C_w) * T(C_w, over_w * B, 0)   seconds

the prefill's latency (weighted as the request's own, beta) and its GPU-seconds (lambda), the
two terms of the placement cost, times `p`, the chance that a live block pushed out is asked
for again, estimated online (`victim_reuse_rate`) as

    p = (live blocks asked for again after the pool lost them) / (sum of over_w placed)

both summed over recent placements. A block is lost when it is live on some worker yet
cached or promised on none of the candidates of the request asking for it: a miss the caches'
capacity caused, as the ghost lists of ARC count them (Megiddo and Modha, "ARC: A
Self-Tuning, Low Overhead Replacement Cache", FAST 2003). The denominator is the same `over_w`
the charge uses, so p calibrates it: live blocks already evicted are counted again by later
placements, and p falls by as much. Measured: 0.25 on the agent sessions at load 0.3, 0.12 on
production at 0.9, 0 on the Tool-Agent generator, whose agents ask for their context again
within seconds (99 % of reuses within 12 s) while a worker's cache turns over in about a
minute, so every block pushed out is dead and the charge is off. The first estimate, the
share of a placement's blocks already live on its worker (`reuse_rate`: 0.97 on the agent
sessions, 0.44 on Tool-Agent), charged those dead evictions: +9 % mean TTFT on Tool-Agent at
load 1.0, no hit gained (eval/RESULTS.md). Misses that are not the caches' doing count as lost
too, an overestimate of p: a live block whose holder cannot take the request (not ACTIVE, or
its KV too small for the grown prompt), held only by a worker draining for a split or merge,
or placed by a request that was aborted before its prefill ran and is asked for again.

Approximations: T from position 0 underestimates a re-prefill deep inside a long context (its
attention spans the prefix before it); blocks cached but no longer live become live again
without a write, so `over_w` underestimates by at most those. Workers that leave the pool
(split, merge, a lost host) keep their live blocks until the horizon passes: their contexts
moved into the new workers' caches, so the pool's live working set (`total`) counts them
where no active worker has them live. Where every worker's live set fits E is 0 and placement
is unchanged; a live set counts every block placed within the horizon, reused or not, so with
small workers it can exceed the KV capacity on production traffic too. Before any placement
is predicted to push a live block out there is no evidence of what pushed-out context does,
and p is the share of placed blocks already live where they are placed (`reuse_rate`: how
much live context is asked for again at all; 0 on one-off prompts, near 1 on sessions), also
after evidence has decayed away (`NO_EVIDENCE`).
Before item 12 of eval/RESULTS.md it was 1: the price then kept placements off workers whose
live set was full while another had room, so the evidence came only when every candidate's
was, and on one-off short prompts (a synthetic stand-in) 18,167 of a 44 s run's 20,000
placements were steered by a price nothing justified: +3.8 % mean TTFT against the best
baseline, now -0.9 %. A p of 0 there instead pushes out the agent sessions' first contexts
unpriced (their lowest load with Qwen3-30B-A3B: 864 -> 871 ms, above the best baseline's 870).

Plain Python over plain data; `now` is passed in, never read from a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from serving.policy.request import Request
from serving.policy.worker import WorkerState

# Weight of a placement k placements ago in `reuse_rate`: REUSE_DECAY ** k (a memory of about
# 1,000 placements; chosen once, not tuned).
REUSE_DECAY = 0.999
# Decayed sums of `victim_reuse_rate` below this many blocks are no evidence and are dropped
# (0.999 ** 230,000 is about 1e-100: far from float underflow, and from any count that matters).
NO_EVIDENCE = 1e-100
# The default horizon: the lifetime hosted prompt caches give an unused prefix (Anthropic's
# prompt caching: 5 minutes; OpenAI's: 5 to 10 minutes of inactivity). On the agent sessions
# 60, 120, 300 and 600 s were also measured (eval/RESULTS.md): 300 was best there, so that
# workload's numbers are in-sample for this constant.
DEFAULT_HORIZON_S = 300.0


class LiveWorkingSet:
    """Per worker, the blocks used by requests placed on it within the last `horizon_s`.

    Block hashes are hash chains (`Request.block_hashes`: block k's hash fixes every block
    before it), so the blocks of one chain live on a worker are a prefix of it; the costs below
    rely on that. One dictionary a worker holds its live blocks; whether a block is live on
    any worker is asked of each worker's (`_live_anywhere`), with no pool-wide copy to keep.

    Costs: `touch` O(request blocks + workers); `size` amortized O(1) (each block leaves the
    window once, and an expiring placement's walk stops at its first block used again since);
    `eviction_costs` O(candidates) plus one prediction per new (degree, blocks) overflow
    (remembered while the cost model and block size stay the same, whatever the weights: a
    cost model changed in place, which `PrefillCostModel` never is, would need a new
    `LiveWorkingSet`).

    Hashes that are not chains (a block after different prefixes, a hash repeated within one
    prompt) break those costs' premise: an expiring placement's walk can stop early and leave
    blocks live for good, and a lost block can be missed. Every source of `Request.block_hashes`
    makes chains (`chain_block_hashes`, `prompt_block_hashes`); a 64-bit collision is the only
    way there.

    Args:
      horizon_s: the window (seconds) within which a block used by a placement stays live,
        finite and > 0.
      rate: the `p` the eviction cost uses (read-only): "victims" (`victim_reuse_rate`, the
        default) or "reuse" (`reuse_rate` throughout; the replayed initial choice of
        `eval.whatif_sim` priced so until eval/RESULTS.md item 28, which runs it as served).

    Raises:
      ValueError: horizon_s not finite and > 0, or an unknown rate.
    """

    __slots__ = ("horizon_s", "_last", "_requests", "_log", "_touches", "_memo", "_memo_for",
                 "_reused", "_placed", "_lost", "_pushed", "_rate")

    def __init__(self, horizon_s: float, rate: str = "victims") -> None:
        if not 0.0 < horizon_s < float("inf"):
            raise ValueError(f"horizon_s must be finite and > 0 seconds, got {horizon_s}")
        if rate not in ("victims", "reuse"):
            raise ValueError(f"rate must be 'victims' or 'reuse', got {rate!r}")
        self.horizon_s = float(horizon_s)
        self._rate = rate
        self._last: dict[int, dict[int, float]] = {}  # worker -> block -> last placement time
        self._requests: dict = {}  # request id -> its placement time, within the horizon
        self._log: deque = deque()  # (time, worker, block hashes, request id), in order
        self._touches = 0
        self._reused = 0.0  # per placement, the share of its blocks live there, decayed sum
        self._placed = 0.0  # placements, decayed the same way (`reuse_rate`)
        self._lost = 0.0  # per placement, live blocks cached nowhere, decayed sum
        self._pushed = 0.0  # per placement, its `over_w`, decayed the same way
        self._memo: dict[int, float] = {}  # C << 32 | blocks -> T(C, blocks * B, 0)
        self._memo_for: tuple | None = None  # (predict, B) of the memo

    def _expire(self, now: float) -> None:
        """Drops the blocks whose last placement is more than `horizon_s` before `now` (each
        placement's entry is visited once, in time order, whichever worker it was on).

        Of one placement's blocks, those no later placement on its worker used again are a
        suffix of its chain (a placement that uses block k uses every block before it), so
        the walk goes from the chain's end and stops at the first block used again since."""
        log, limit = self._log, now - self.horizon_s
        lasts, requests = self._last, self._requests
        while log and log[0][0] < limit:
            t, w, hashes, rid = log.popleft()
            if rid is not None and requests.get(rid) == t:
                del requests[rid]
            last = lasts.get(w)
            if last is None:
                continue
            get = last.get
            for h in reversed(hashes):
                if get(h) != t:
                    break
                del last[h]

    @property
    def rate(self) -> str:
        """"victims" or "reuse": the `p` of the eviction cost (constructor)."""
        return self._rate

    def size(self, worker_id: int, now: float) -> int:
        """Live blocks of `worker_id` at `now` (0 for a worker never placed on). Placements
        are expected in time order; one recorded out of order leaves with those before it."""
        self._expire(now)
        last = self._last.get(worker_id)
        return len(last) if last is not None else 0

    def touch(self, worker_id: int, block_hashes: Sequence[int], now: float,
              matched_blocks: int | None = None, pool_matched_blocks: int = 0,
              capacity_blocks: int = 0, request_id=None) -> None:
        """Records that a request whose full blocks are `block_hashes` was placed on
        `worker_id` at `now` (what left the window is dropped first: memory stays bounded by
        the blocks placed within one horizon).

        Args:
          worker_id, block_hashes, now: the placement; `block_hashes` is the request's hash
            chain from its first block (`Request.block_hashes`, full blocks only).
          matched_blocks: the request's leading blocks cached or promised on `worker_id` when
            it was placed (the router's `m_w`), or None to leave the loss counts of
            `victim_reuse_rate` as they are (`reuse_rate`, its value before any evidence, is
            updated by every placement).
          pool_matched_blocks: the most leading blocks cached or promised on any candidate,
            >= matched_blocks (blocks from there on that are live somewhere count as lost).
          capacity_blocks: the worker's KV capacity (blocks), >= 1 with matched_blocks.
          request_id: the request's id, or None. A request placed again within the horizon
            (re-routed when its worker drained for a split or merge) leaves the loss counts
            as they are: its blocks are live from its first placement, not lost (it still
            counts in `reuse_rate`, as not reused, wherever it is placed: its own first
            placement made them live).

        Raises:
          ValueError: with matched_blocks, pool_matched_blocks < matched_blocks or
            capacity_blocks < 1 (nothing is recorded).
        """
        if matched_blocks is not None and not (pool_matched_blocks >= matched_blocks
                                               and capacity_blocks >= 1):
            raise ValueError(
                f"touch needs pool_matched_blocks >= matched_blocks and capacity_blocks >= 1, "
                f"got pool_matched_blocks={pool_matched_blocks}, matched_blocks="
                f"{matched_blocks}, capacity_blocks={capacity_blocks}")
        self._expire(now)
        last = self._last.get(worker_id)
        if last is None:
            last = self._last[worker_id] = {}
        requests = self._requests
        if matched_blocks is not None and block_hashes and request_id not in requests:
            # `over_w` of this placement, and the live blocks it asks for again that no
            # candidate holds any more (live somewhere within the horizon: evicted since)
            new = len(block_hashes) - matched_blocks
            over = min(new, len(last) + new - capacity_blocks)
            lost = self._live_anywhere(block_hashes, pool_matched_blocks) - pool_matched_blocks
            self._lost = self._lost * REUSE_DECAY + lost
            self._pushed = self._pushed * REUSE_DECAY + (over if over > 0 else 0)
            if self._pushed < NO_EVIDENCE and self._lost < NO_EVIDENCE:
                self._lost = self._pushed = 0.0  # decayed away (`victim_reuse_rate`)
        again = request_id is not None and request_id in requests  # (placed again)
        fresh = dict.fromkeys(block_hashes, now)
        before = len(last)
        last.update(fresh)
        if block_hashes:  # (distinct blocks live before: those `update` did not add)
            share = 0.0 if again else (len(fresh) - (len(last) - before)) / len(block_hashes)
            self._reused = self._reused * REUSE_DECAY + share
            self._placed = self._placed * REUSE_DECAY + 1.0
        if request_id is not None:
            requests[request_id] = now
        self._log.append((now, worker_id, block_hashes, request_id))
        self._touches += 1
        if not self._touches % 1024:
            self._forget_empty()

    def _live_anywhere(self, block_hashes: Sequence[int], start: int) -> int:
        """The length of the longest prefix of the chain `block_hashes` live on some worker,
        when its first `start` blocks are taken as live (`start` if none past them is).

        A worker's live blocks of one chain are a prefix of it (a placement that uses block k
        uses every block before it, at the same time), so each worker is asked whether it has
        the next block beyond the longest prefix found so far, and by bisection how far its
        own goes: O(workers + log(blocks)) lookups, no pool-wide set to keep up."""
        n, best = len(block_hashes), start
        for last in self._last.values():
            if best >= n:
                break
            if block_hashes[best] not in last:
                continue
            lo, hi = best, n - 1  # block_hashes[lo] is live here; find the last one that is
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if block_hashes[mid] in last:
                    lo = mid
                else:
                    hi = mid - 1
            best = lo + 1
        return best

    def _forget_empty(self) -> None:
        """Forgets workers with nothing live (they left the pool, or are no longer placed on)."""
        for w in [w for w, last in self._last.items() if not last]:
            self.forget(w)

    def total(self, now: float, active: Sequence[int] | None = None) -> int:
        """The pool's live blocks at `now`: the sum over the `active` workers' live sets, plus
        the blocks of workers no longer active (they left the pool within the horizon: their
        contexts are in their successors' caches) that no active worker has live yet (so a
        context placed again on a successor is counted once). `active` None: every worker ever
        placed on, summed. Workers with nothing live are forgotten.

        Costs: O(live blocks of the workers that left, and of the active ones while any that
        left are still live), at set-operation speed; O(workers) otherwise.
        """
        self._expire(now)
        self._forget_empty()
        lasts = self._last
        if active is None:
            return sum(len(last) for last in lasts.values())
        ids = set(active)
        out = sum(len(lasts[w]) for w in ids if w in lasts)
        gone = [last.keys() for w, last in lasts.items() if w not in ids]
        if gone:
            here = set().union(*(lasts[w].keys() for w in ids if w in lasts))
            out += len(set().union(*gone) - here)
        return out

    @property
    def reuse_rate(self) -> float:
        """The reuse rate the controller's split veto reads (`pool_load.kv_pressure`): per
        placement, the share of its blocks already live on the worker it was placed on,
        averaged over the recent placements (the one k placements ago weighed
        `REUSE_DECAY ** k`; each placement counts once, whatever its size); 1 before any
        placement. Blocks live on another worker (a session moved, or its worker was split or
        merged) count as not reused: it reads low for a while after a change."""
        return self._reused / self._placed if self._placed else 1.0

    @property
    def victim_reuse_rate(self) -> float:
        """`p` of the module docstring: live blocks asked for again after the pool's caches
        lost them, per live block a placement was predicted to push out (`over_w` of the
        chosen worker), both summed over the recent placements recorded with their match
        (the one k placements ago weighed `REUSE_DECAY ** k`), at most 1. While no placement
        has been predicted to push any out, `reuse_rate` (0 before any placement; module
        doc), also when blocks were lost meanwhile: those were live only on workers that were
        no candidate (draining for a split or merge, or too small for the grown prompt),
        which says nothing of what a placement's pushes cost, and reading them as p = 1 (the
        ratio's limit) would hold itself up, as item 12 of eval/RESULTS.md found: the price
        keeps placements off full workers, so no push comes to correct it (measured: one
        `eval.robustness` cell of 112 moved, +3.4 %). Evidence that has decayed below
        `NO_EVIDENCE` blocks (about 230,000 placements after the last push of one block) is
        dropped, both sums set to 0 (p is `reuse_rate` again), so the ratio never reads floats
        at the edge of their range. A block counts as lost when it is live on some worker
        (placed within the horizon) yet cached or promised on no candidate of the request
        asking for it (blocks held only by workers draining for a split or merge count as
        lost too)."""
        if not self._pushed:
            return self.reuse_rate if self._placed else 0.0
        return min(1.0, self._lost / self._pushed)

    def forget(self, worker_id: int) -> None:
        """Drops a worker's live set (its entries left in the log are skipped); its blocks
        are no longer live on it, nor counted as lost when asked for again."""
        self._last.pop(worker_id, None)

    def overflow_blocks(self, worker: WorkerState, new_blocks: int, now: float) -> int:
        """`over_w` of the module docstring: live blocks of `worker` a placement writing
        `new_blocks` blocks would evict (>= 0)."""
        if new_blocks <= 0:
            return 0
        cap = worker.spec.kv_capacity_blocks
        last = self._last.get(worker.spec.worker_id)
        if last is None or len(last) + new_blocks <= cap:  # `size` only shrinks it
            return 0
        return max(0, min(new_blocks, self.size(worker.spec.worker_id, now) + new_blocks - cap))

    def eviction_costs(self, request: Request, candidates: Sequence[WorkerState],
                       matched_blocks: Sequence[int], now: float,
                       predict: Callable[[int, int, int], float], beta: float, lam: float
                       ) -> list[float] | None:
        """`E_w` of the module docstring per candidate (seconds), or None when every one is 0.

        Args:
          request: the request being placed.
          candidates: the workers it may go to.
          matched_blocks: per candidate, the request's leading blocks cached or promised there
            (at most its full blocks).
          now: the scheduler's clock (seconds).
          predict: the prefill-time model `T(cp_degree, input_len, cached_len) -> seconds`.
          beta, lam: the placement cost's weights (`VertumnusRouter`).
        """
        out = [0.0] * len(candidates)
        if self.add_eviction_costs(out, request, candidates, matched_blocks, now, predict, beta,
                                   lam):
            return out
        return None

    def add_eviction_costs(self, costs: list[float], request: Request,
                           candidates: Sequence[WorkerState], matched_blocks: Sequence[int],
                           now: float, predict: Callable[[int, int, int], float], beta: float,
                           lam: float) -> bool:
        """Adds `E_w` to `costs[i]` for each candidate i whose `E_w` is not 0 (the routers' hot
        path: no list is built); arguments as `eviction_costs`. Returns whether any was added.
        """
        bs = request.block_size
        need = request.input_len // bs
        if self._memo_for != (predict, bs):  # (not the weights: lambda may change per call)
            self._memo, self._memo_for = {}, (predict, bs)
        self._expire(now)
        memo, get_last = self._memo, self._last.get
        p = self.victim_reuse_rate if self._rate == "victims" else self.reuse_rate
        if not p:  # every E_w is 0
            return False
        added = False
        for i, (w, m) in enumerate(zip(candidates, matched_blocks)):  # `overflow_blocks`, inlined
            new = need - m
            if new <= 0:
                continue
            spec = w.spec
            last = get_last(spec.worker_id)
            if last is None:
                continue
            over = len(last) + new - spec.kv_capacity_blocks
            if over <= 0:
                continue
            if over > new:
                over = new
            c = spec.cp_degree
            key = c << 32 | over  # (over < 2**32: blocks of one prompt)
            t = memo.get(key)
            if t is None:
                t = memo[key] = predict(c, over * bs, 0)
            costs[i] += (beta + lam * c) * t * p
            added = True
        return added
