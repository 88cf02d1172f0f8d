"""Helpers shared by the scheduler's collaborators' tests (prefix-cache manager, prefix trie,
re-routes, hosts, the overload rule): a backend that records what it is asked to start,
re-carve, copy and reclaim, cost models priced by hand, one 33-block document and a small
pool."""

from __future__ import annotations

from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.request import Request, chain_block_hashes
from serving.policy.router import LeastWorkRouter
from serving.policy.scheduler import Scheduler
from serving.policy.worker import layout_workers


class Backend:
    """Records the prefills started (`(worker id, request id)`), re-carves, replications and
    reclamations it is asked for; it runs nothing."""

    def __init__(self):
        self.started, self.recarves, self.copies, self.reclaims = [], [], [], []

    def start_prefill(self, worker_id, request, now):
        self.started.append((worker_id, request.request_id))

    def recarve(self, rec, now):
        self.recarves.append(rec)

    def replicate(self, rep, now):
        self.copies.append(rep)

    def reclaim(self, w, chain, now):
        self.reclaims.append((w, chain))


class Cost:
    """0.1 ms per uncached token over the degree."""

    def predict(self, c, n, h):
        return 1e-4 * (n - h) / c


class MsCost:
    """1 ms per uncached token over the degree."""

    def predict(self, c, n, h):
        return 1e-3 * (n - h) / c


DOC = Request("doc", 0.0, 32 * 512 + 100, 1, chain_block_hashes(range(33)), 512)


def setup():
    """A scheduler on workers of degrees [4, 2, 2, 1, 1] with a global prefix trie, and its
    recording backend."""
    # worker 0: CP-4 (devices 0-3); workers 1, 2: CP-2; worker 3, 4: CP-1
    b = Backend()
    s = Scheduler(layout_workers([4, 2, 2, 1, 1], 1000, 100_000), Cost(), LeastWorkRouter(), b,
                  prefix_index=GlobalPrefixTrie())
    return s, b


HOLDS = lambda c: 100_000  # noqa: E731 (every worker holds every prompt here)


def req(rid, t=0.0, length=2000):
    """A request of `length` tokens of its own (no prefix shared), arriving at `t`."""
    ids = [hash((rid, k)) for k in range(-(-length // 512))]
    return Request(rid, t, length, 1, chain_block_hashes(ids), 512)


def make(degrees):
    """`(scheduler, backend, records, seen)`: least-work routing at 1 ms a token over workers of
    `degrees` (100 KV blocks a device, 100,000-token prompts); `seen` gets `(request id,
    rerouting)` per placement."""
    backend, done = Backend(), []
    s = Scheduler(layout_workers(list(degrees), 100, 100_000), MsCost(), LeastWorkRouter(),
                  backend, done.append)
    seen = []
    s.placement_hooks.append(lambda r, cached, now: seen.append((r.request_id, s.rerouting)))
    return s, backend, done, seen
