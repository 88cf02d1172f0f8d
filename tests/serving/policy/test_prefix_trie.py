"""Global prefix trie: statistics, and replica counts under every operation (stateful test)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.request import Request, chain_block_hashes
from serving.policy.router import LeastWorkRouter
from serving.policy.scheduler import Scheduler
from serving.policy.worker import layout_workers, merge_buddies, split_halves, are_buddies
from tests.serving.policy.scheduler_fixtures import Backend


def req(ids, bs=4):
    n = len(ids) * bs
    return Request(str(ids), 0.0, n, 1, chain_block_hashes(ids), bs)


def test_record_access_missed_benefit_and_decay():
    trie = GlobalPrefixTrie()
    for w, c in ((0, 4), (1, 2), (2, 2)):
        trie.register_worker(w, c)
    r = req([1, 2, 3, 4, 5])
    trie.insert(0, r.block_hashes[:4])
    trie.insert(1, r.block_hashes[:2])
    assert trie.replica_count(r.block_hashes[1], 2) == 1
    assert trie.replica_count(r.block_hashes[3], 2) == 0
    assert trie.replica_count(r.block_hashes[3], 4) == 1
    trie.record(r, cp_degree=2, global_blocks=4, reused_blocks=2)
    tip = r.block_hashes[3]
    assert trie.access[tip] == {2: 1.0}
    assert trie.missed[tip] == {2: 2 * 4}  # 2 blocks of 4 tokens missed at degree 2
    assert trie.chain(tip) == list(r.block_hashes[:4])
    trie.record(r, cp_degree=4, global_blocks=4, reused_blocks=4)
    assert trie.access[tip] == {2: 1.0, 4: 1.0} and 4 not in trie.missed[tip]
    assert (trie.global_tokens, trie.reused_tokens) == (32, 24)
    trie.decay(0.5, floor=0.6)
    assert tip not in trie.access and trie.missed[tip] == {2: 4.0}
    assert trie.tips() == [tip]


class Cost:
    def predict(self, c, n, h):
        return 1e-3 * (n - h) / c


CHAINS = [chain_block_hashes(range(k * 10, k * 10 + 6)) for k in range(4)]


class TrieMachine(RuleBasedStateMachine):
    """Drives the scheduler's trie through inserts, evictions, copies, reclamations, splits and
    merges; a plain model of who holds what must always agree with `replica_count`."""

    def __init__(self):
        super().__init__()
        self.backend = Backend()
        self.s = Scheduler(layout_workers([4, 2, 2], 10_000, 10_000), Cost(), LeastWorkRouter(),
                           self.backend, prefix_index=GlobalPrefixTrie())
        self.model = {w: set() for w in self.s.workers}

    @property
    def trie(self):
        return self.s.prefix_index

    def _ids(self):
        return sorted(self.s.workers)

    @rule(data=st.data(), chain=st.sampled_from(CHAINS), k=st.integers(1, 6))
    def insert(self, data, chain, k):
        w = data.draw(st.sampled_from(self._ids()))
        self.trie.insert(w, chain[:k])
        self.model[w] |= set(chain[:k])

    @rule(data=st.data(), chain=st.sampled_from(CHAINS), k=st.integers(0, 5))
    def evict(self, data, chain, k):
        w = data.draw(st.sampled_from(self._ids()))
        self.trie.evict(w, chain[k:])
        self.model[w] -= set(chain[k:])

    @rule(data=st.data(), chain=st.sampled_from(CHAINS))
    def replicate(self, data, chain):
        ids = self._ids()
        src, dst = data.draw(st.sampled_from(ids)), data.draw(st.sampled_from(ids))
        try:
            rep = self.s.copies.begin(src, dst, chain, 4, 0.0)
        except ValueError:
            return  # refused: nothing may have changed (checked by the invariant)
        self.s.copies.finish(rep, 1.0, list(chain[rep.start:]), [])
        self.model[dst] |= set(chain)

    @rule(data=st.data(), chain=st.sampled_from(CHAINS), k=st.integers(1, 6))
    def reclaim(self, data, chain, k):
        w = data.draw(st.sampled_from(self._ids()))
        self.s.copies.begin_reclaim(w, chain, 0.0)
        freed = [h for h in chain[k:] if h in self.model[w]]
        self.s.copies.finish_reclaim(w, chain, 0.0, freed)
        self.model[w] -= set(freed)

    @precondition(lambda self: any(w.cp_degree > 1 for w in self.s.workers.values()))
    @rule(data=st.data())
    def split(self, data):
        w = data.draw(st.sampled_from([w for w in self.s.workers.values() if w.cp_degree > 1]))
        new = split_halves(w.spec, self.s.new_worker_ids(2), lambda c: 10_000)
        rec = self.s.begin_reconfiguration("split", [w.worker_id], list(new), 0.0)
        blocks = sorted(self.model.pop(w.worker_id))
        cut = data.draw(st.integers(0, len(blocks)))
        given = {new[0].worker_id: blocks[:cut], new[1].worker_id: blocks[cut:]}
        self.s.finish_reconfiguration(rec.epoch, 1.0, given)
        for wid, b in given.items():
            self.model[wid] = set(b)

    @rule(data=st.data())
    def merge(self, data):
        ws = list(self.s.workers.values())
        pairs = [(a, b) for a in ws for b in ws if a.worker_id < b.worker_id and are_buddies(a.spec, b.spec)]
        if not pairs:
            return
        a, b = data.draw(st.sampled_from(pairs))
        [nid] = self.s.new_worker_ids(1)
        spec = merge_buddies(a.spec, b.spec, nid, lambda c: 10_000)
        rec = self.s.begin_reconfiguration("merge", [a.worker_id, b.worker_id], [spec], 0.0)
        union = self.model.pop(a.worker_id) | self.model.pop(b.worker_id)
        self.s.finish_reconfiguration(rec.epoch, 1.0, {nid: sorted(union)})
        self.model[nid] = union

    @invariant()
    def replica_counts_match_holders(self):
        degree = {w: s.cp_degree for w, s in self.s.workers.items()}
        assert set(self.model) == set(self.s.workers)
        for chain in CHAINS:
            for z in chain:
                for c in (1, 2, 4, 8):
                    want = sum(1 for w, held in self.model.items() if z in held and degree[w] == c)
                    assert self.trie.replica_count(z, c) == want
        for w, held in self.model.items():
            assert self.trie.num_blocks(w) == len(held)
        assert sum(self.s.composition) == 8


TestTrieMachine = TrieMachine.TestCase
TestTrieMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
