"""A test router that places each request on a worker of the CP degree the test chose.

`DegreeRouter.target` (a class attribute, so the server's own instance sees it) names the
degree; among the workers of that degree the one holding the most of the prompt wins (then the
lowest id). With `target` None it behaves as "most matched blocks". `DegreeRouter.worker_id`,
when set, names the worker itself (if it is eligible; else the rule above). With
`DegreeRouter.spread`, requests go round-robin over the eligible workers. With
`DegreeRouter.fetch_blocks` set too, a request placed on `worker_id` has that many leading
blocks fetched from the worker holding them when it starts (`FetchOnDispatch`, as a fetching
router plans it).
"""

from __future__ import annotations


class DegreeRouter:
    name = "degree"
    target: int | None = None
    worker_id: int | None = None
    spread = False
    fetch_blocks: int | None = None
    _turn = 0

    def bind(self, scheduler):
        from serving.policy.replication import FetchOnDispatch
        self.fetches = FetchOnDispatch()
        self.fetches.attach(scheduler)

    def choose(self, request, candidates, matched_blocks, now):
        if DegreeRouter.spread:
            DegreeRouter._turn += 1
            return DegreeRouter._turn % len(candidates)
        for i, w in enumerate(candidates):
            if w.worker_id == self.worker_id:
                if DegreeRouter.fetch_blocks:
                    self.fetches.plan(request, w.worker_id, DegreeRouter.fetch_blocks)
                return i
        order = sorted(range(len(candidates)),
                       key=lambda i: (-matched_blocks[i], candidates[i].worker_id))
        for i in order:
            if self.target is None or candidates[i].cp_degree == self.target:
                return i
        raise AssertionError(f"no eligible worker of degree {self.target}")
