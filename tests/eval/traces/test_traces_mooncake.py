"""Mooncake trace loader: the real shared traces, malformed lines, timestamps, re-blocking."""

from __future__ import annotations

import json
import math

import pytest

from eval.traces.content import reblock_hash_ids
from eval.traces.loaders import TraceFormatError, load_mooncake
from eval.traces.workloads import reuse_fraction
from tests.eval.traces.trace_fixtures import CONV, GOOD, SYNTH, common_prefix, mooncake_line, need


def _raw_reuse(rows: list[dict], bs: int = 512) -> float:
    """Independent unbounded-cache reuse over raw Mooncake hash_ids (prefix tuples as keys)."""
    seen, hit, total = set(), 0, 0
    for r in sorted(rows, key=lambda r: r["timestamp"]):
        ids, n = r["hash_ids"], r["input_length"]
        k = 0
        while k < (n - 1) // bs and tuple(ids[:k + 1]) in seen:
            k += 1
        hit += k * bs
        total += n
        seen.update(tuple(ids[:j]) for j in range(1, n // bs + 1))
    return hit / total


@pytest.fixture(scope="module")
def conv():
    need(CONV)
    rows = [json.loads(line) for line in CONV.read_text().splitlines()]
    return load_mooncake(CONV), rows


@pytest.mark.parametrize("path,rows", [(CONV, 12_031), (SYNTH, 3_993)])
def test_mooncake_real_row_counts_and_block_rule(path, rows):
    need(path)
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(raw) == rows
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / 512) for r in raw)
    trace = load_mooncake(path)
    assert len(trace) == rows and trace.skipped == 0
    for req in trace.requests:
        r = raw[int(req.request_id.split(":")[1])]
        assert (req.input_len, req.output_len) == (r["input_length"], r["output_length"])
        assert req.arrival_time == r["timestamp"] / 1000
        assert len(req.block_hashes) == len(r["hash_ids"])


def test_mooncake_conversation_order_sharing_and_reuse(conv):
    trace, rows = conv
    assert trace.name == "mooncake-conv"
    t = [r.arrival_time for r in trace.requests]
    assert t == sorted(t)
    idx = [int(r.request_id.split(":")[1]) for r in trace.requests]
    # Ties keep file order: within one arrival time the row indices ascend.
    assert all(i < j for (a, i), (b, j) in zip(zip(t, idx), zip(t[1:], idx[1:])) if a == b)
    # Hash chains share exactly the prefixes the raw ids share.
    for a, b in zip(trace.requests[:2000], trace.requests[1:2001]):
        ra, rb = rows[int(a.request_id.split(":")[1])], rows[int(b.request_id.split(":")[1])]
        assert (common_prefix(a.block_hashes, b.block_hashes)
                == common_prefix(ra["hash_ids"], rb["hash_ids"]))
    reuse = reuse_fraction(trace.requests)
    assert reuse == pytest.approx(_raw_reuse(rows), abs=1e-12)
    assert reuse == pytest.approx(0.374, abs=0.001)  # traces README


def test_mooncake_synthetic_reuse_matches_readme():
    need(SYNTH)
    trace = load_mooncake(SYNTH)
    rows = [json.loads(line) for line in SYNTH.read_text().splitlines()]
    assert reuse_fraction(trace.requests) == pytest.approx(_raw_reuse(rows), abs=1e-12)
    assert reuse_fraction(trace.requests) == pytest.approx(0.651, abs=0.001)


@pytest.mark.parametrize("bad,field", [
    ("{not json", "json"),
    (json.dumps({**GOOD, "hash_ids": [1, 2, 3]}), "hash_ids"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "timestamp"}), "timestamp"),
    (json.dumps({**GOOD, "input_length": 0}), "input_length"),
    (json.dumps({**GOOD, "output_length": "5"}), "output_length"),
    (json.dumps({**GOOD, "timestamp": -3}), "timestamp"),
])
def test_mooncake_malformed_line(tmp_path, bad, field):
    lines = [json.dumps({**GOOD, "timestamp": 1000 * i}) for i in range(4)]
    lines[2] = bad
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_mooncake(path)
    assert (e.value.path, e.value.line, e.value.field) == (str(path), 3, field)
    assert str(path) in str(e.value) and "line 3" in str(e.value) and field in str(e.value)
    trace = load_mooncake(path, skip_malformed=True)
    assert (trace.skipped, trace.skipped_lines) == (1, (3,))
    assert [r.request_id for r in trace.requests] == ["mooncake-t:0", "mooncake-t:1", "mooncake-t:3"]
    assert [r.arrival_time for r in trace.requests] == [0.0, 1.0, 3.0]


def test_timestamp_past_float_range_is_a_row_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(mooncake_line(0) + "\n" + mooncake_line(10**400) + "\n" + mooncake_line(3000)
                    + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_mooncake(path)
    assert (e.value.line, e.value.field) == (2, "timestamp")
    assert len(str(e.value)) < 300  # the 401-digit value is summarised, not printed
    trace = load_mooncake(path, skip_malformed=True)
    assert trace.skipped_lines == (2,) and [r.arrival_time for r in trace] == [0.0, 3.0]


# ----------------------------------------------------------------------------- re-blocking


def _reqs(hand, bs):
    return [reblock_hash_ids(ids, n, 512, bs) for ids, n in hand]


def test_reblock_preserves_sharing_structure():
    # A and B share source blocks 1, 2; A and C share source block 1 only.
    hand = [([1, 2, 3], 1300), ([1, 2, 4], 1100), ([1, 5], 800)]
    a, b, c = _reqs(hand, 256)
    assert (len(a), len(b), len(c)) == (6, 5, 4)
    assert common_prefix(a, b) == 4   # tokens [0, 1024) = source blocks 1, 2
    assert common_prefix(a, c) == 2   # tokens [0, 512) = source block 1
    a, b, c = _reqs(hand, 1024)
    assert (common_prefix(a, b), common_prefix(a, c)) == (1, 0)
    a, b, c = _reqs(hand, 768)          # block 0 = source 1 + half of source 2
    assert (common_prefix(a, b), common_prefix(a, c)) == (1, 0)
    a, b, c = _reqs(hand, 512)          # same structure as the trace's own ids
    assert (common_prefix(a, b), common_prefix(a, c)) == (2, 1)


def test_mooncake_block_size_flag(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 3]},
            {"timestamp": 5, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 4]}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = load_mooncake(path, block_size=256).requests
    assert a.block_size == 256 and len(a.block_hashes) == 6
    assert common_prefix(a.block_hashes, b.block_hashes) == 4
    # Unbounded-cache reuse at 256: B hits 4 blocks of 256 = 1024 tokens.
    assert reuse_fraction([a, b]) == pytest.approx(1024 / 2400)


def test_64_token_trace_reblocked_to_512_shares_like_a_hand_made_512_trace(tmp_path):
    """A Mooncake-format trace with 64-token `hash_ids` (as public agent and Qwen traces use),
    read with `trace_block_size=64` and re-blocked to 512, has the pairwise shared-prefix
    structure of the same prompts written by hand at 512: a 512-block is shared only when all
    eight 64-blocks in it, and every block before, are."""
    base = list(range(1, 33))                                   # 2048 tokens: 32 x 64
    rows64 = [base, base[:20] + [900 + i for i in range(12)],   # shares 20 x 64 = 1280 tokens
              base[:16] + [800 + i for i in range(16)],         # shares exactly 2 x 512
              [700] + base[1:]]                                 # differs in the first block
    rows512 = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8], [9, 10, 11, 12]]
    for name, rows, bs in (("a.jsonl", rows64, 64), ("b.jsonl", rows512, 512)):
        (tmp_path / name).write_text("".join(json.dumps(
            {"timestamp": i, "input_length": 2048, "output_length": 1, "hash_ids": ids}) + "\n"
            for i, ids in enumerate(rows)))
    from eval.traces.loaders import load_trace
    a = load_trace(tmp_path / "a.jsonl", block_size=512, trace_block_size=64).requests
    b = load_trace(tmp_path / "b.jsonl", block_size=512).requests
    assert all(len(r.block_hashes) == 4 for r in a)
    shared = [[common_prefix(x.block_hashes, y.block_hashes) for y in reqs] for reqs in (a, b)
              for x in reqs]
    assert shared[:4] == shared[4:]
    assert [common_prefix(a[0].block_hashes, r.block_hashes) for r in a] == [4, 2, 2, 0]
    with pytest.raises(TraceFormatError, match="ceil"):  # 64-token ids read as 512 ones
        load_trace(tmp_path / "a.jsonl", block_size=512)
