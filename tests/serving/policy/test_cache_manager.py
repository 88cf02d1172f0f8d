"""The prefix-cache manager's plans on hand-built trie states."""

from __future__ import annotations

from serving.policy.cache_manager import CacheManagerConfig, PrefixCacheManager
from tests.serving.policy.scheduler_fixtures import DOC, Backend, setup


def test_inter_degree_copy_goes_to_longest_retained_ancestor_with_missing_blocks_only():
    s, b = setup()
    trie = s.prefix_index
    chain = DOC.block_hashes[:32]
    trie.insert(0, chain)
    trie.insert(2, chain[:10])  # worker 2 (CP-2) retains the first 10 blocks
    for _ in range(3):  # three requests routed to CP-2 missed 32 - 0 blocks
        trie.record(DOC, cp_degree=2, global_blocks=32, reused_blocks=0)
    mgr = PrefixCacheManager(CacheManagerConfig(min_missed_tokens=8192, intra_high=100))
    assert mgr.scan(s, now=5.0) >= 1
    [rep] = [c for c in b.copies if c.dst in (1, 2)]
    assert (rep.src, rep.dst, rep.start, rep.num_blocks) == (0, 2, 10, 22)
    assert rep.reason == "inter-degree"
    assert (2, chain[-1]) in s.copies.in_flight
    # Not visible until the backend finishes the copy.
    assert trie.replica_count(chain[-1], 2) == 0
    s.copies.finish(rep, 6.0, list(chain[10:]), [])
    assert trie.replica_count(chain[-1], 2) == 1


def test_below_threshold_nothing_happens_and_decay_ages_demand():
    s, b = setup()
    trie = s.prefix_index
    trie.insert(0, DOC.block_hashes[:32])
    trie.record(DOC, cp_degree=2, global_blocks=32, reused_blocks=24)  # 4096 tokens missed
    mgr = PrefixCacheManager(CacheManagerConfig(min_missed_tokens=8192, decay=0.5))
    mgr.attach(s)
    s.tick(10.0)
    assert b.copies == []
    assert trie.missed[DOC.block_hashes[31]][2] == 2048.0  # halved after the scan


def test_intra_degree_replica_and_reclamation():
    s, b = setup()
    trie = s.prefix_index
    chain = DOC.block_hashes[:32]
    trie.insert(1, chain)
    for _ in range(20):  # 20 requests per scan on one CP-2 replica: too hot
        trie.record(DOC, cp_degree=2, global_blocks=32, reused_blocks=32)
    mgr = PrefixCacheManager(CacheManagerConfig(intra_high=8.0, reclaim_low=0.5))
    mgr.scan(s, 1.0)
    [rep] = b.copies
    assert (rep.src, rep.dst, rep.reason, rep.start) == (1, 2, "intra-degree", 0)
    s.copies.finish(rep, 2.0, list(chain), [])
    trie.decay(0.0)  # demand gone: two CP-2 replicas of a cold prefix
    trie.record(DOC, cp_degree=2, global_blocks=32, reused_blocks=32)
    trie.decay(0.1, floor=0.01)  # 0.1 request per replica-pair < 0.5
    s.workers[2].queued_seconds = 3.0  # the busier holder gives its copy up
    mgr.scan(s, 3.0)
    assert b.reclaims == [(2, tuple(chain))]
    assert trie.replica_count(chain[-1], 2) == 2  # until the worker confirms
    s.copies.finish_reclaim(2, chain, 3.5, list(chain[20:]))
    assert trie.replica_count(chain[-1], 2) == 1


def test_copy_source_must_hold_the_whole_prefix_and_zero_threshold_is_safe():
    s, b = setup()
    trie = s.prefix_index
    chain = DOC.block_hashes[:32]
    trie.insert(0, chain[-1:])   # worker 0 holds only the tip (an orphan after a merge)
    trie.insert(1, chain)        # worker 1 (CP-2) holds the whole prefix
    for _ in range(3):
        trie.record(DOC, cp_degree=1, global_blocks=32, reused_blocks=0)
    mgr = PrefixCacheManager(CacheManagerConfig(min_missed_tokens=0.0, intra_high=100))
    mgr.scan(s, 1.0)
    assert b.copies and all(rep.src == 1 for rep in b.copies)


def test_bad_arguments_change_nothing():
    import math

    import pytest

    s, b = setup()
    s.prefix_index.insert(0, DOC.block_hashes[:4])
    for kwargs, msg in ((dict(block_size=0), "block_size"), (dict(reason="why"), "reason"),
                        (dict(now=math.nan), "now"),
                        (dict(reason="request-transfer"), "request_id"),  # names no request
                        (dict(request_id="r7"), "request_id")):  # a request on a manager copy
        args = dict(src=0, dst=1, chain=DOC.block_hashes[:4], block_size=512, now=0.0)
        args.update(kwargs)
        with pytest.raises(ValueError, match=msg):
            s.copies.begin(**args)
    with pytest.raises(ValueError, match="chain"):
        s.copies.begin_reclaim(0, [], 0.0)
    assert not s.copies.in_flight and not s.copies.reclaims and b.copies == []
    for bad in (dict(scan_interval_s=math.inf), dict(max_actions=2.5), dict(min_missed_tokens=math.nan)):
        with pytest.raises(ValueError):
            CacheManagerConfig(**bad)


def test_a_backend_without_copies_leaves_nothing_in_flight():
    """`Backend.replicate` may raise NotImplementedError: the copy is then not in flight."""
    import pytest

    s, b = setup()

    def no_copies(rep, now):
        raise NotImplementedError("this backend does not copy between workers")

    b.replicate = no_copies
    s.prefix_index.insert(0, DOC.block_hashes[:4])
    with pytest.raises(NotImplementedError):
        s.copies.begin(0, 1, DOC.block_hashes[:4], 512, 0.0)
    assert s.copies.in_flight == {}


def test_fetch_for_request_copies_the_longest_prefix_held_elsewhere():
    s, b = setup()
    trie = s.prefix_index
    trie.insert(1, DOC.block_hashes[:10])
    trie.insert(2, DOC.block_hashes[:20])  # the longest run: worker 2
    trie.insert(0, DOC.block_hashes[:4])
    rep = s.copies.fetch_for_request(DOC, 0, 32, 1.5)
    assert (rep.src, rep.dst, rep.chain, rep.start) == (2, 0, DOC.block_hashes[:20], 4)
    assert (rep.reason, rep.request_id, b.copies) == ("request-transfer", "doc", [rep])
    assert s.copies.fetch_for_request(DOC, 0, 32, 1.5) is None  # that copy is in flight: refused
    assert s.copies.fetch_for_request(DOC, 2, 32, 1.5) is None  # worker 2 holds the longest already
    assert s.copies.fetch_for_request(DOC, 3, 8, 1.5).chain == DOC.block_hashes[:8]  # capped
    assert len(s.copies.in_flight) == 2
