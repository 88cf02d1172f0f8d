"""Trace loaders: the real shared traces, malformed lines, re-blocking, windows, dispatch."""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib

import numpy as np
import pytest

from eval.content import reblock_hash_ids, segment_block_ids
from eval.traces import (Trace, TraceFormatError, load_azure, load_leval, load_mooncake,
                         load_trace, sample_window)
from eval.workloads import reuse_fraction
from serving.request import Request, chain_block_hashes

# The public traces live beside the repository (../shared/traces); VERTUMNUS_TRACES_DIR points
# elsewhere for a checkout that is not laid out that way.
TRACES = pathlib.Path(os.environ.get("VERTUMNUS_TRACES_DIR") or
                      pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "traces")
CONV = TRACES / "mooncake" / "conversation_trace.jsonl"
SYNTH = TRACES / "mooncake" / "synthetic_trace.jsonl"
AZURE = TRACES / "azure2023" / "AzureLLMInferenceTrace_code.csv"
LEVAL = TRACES / "leval" / "leval_requests_llama3tok.csv"


def _need(path: pathlib.Path) -> None:
    if not path.exists():
        pytest.skip(f"shared trace {path} not present (get it from the Mooncake / Azure public "
                    f"repositories, see ../shared/traces/README.md)")


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
    _need(CONV)
    rows = [json.loads(line) for line in CONV.read_text().splitlines()]
    return load_mooncake(CONV), rows


@pytest.mark.parametrize("path,rows", [(CONV, 12_031), (SYNTH, 3_993)])
def test_mooncake_real_row_counts_and_block_rule(path, rows):
    _need(path)
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
        assert (_common_prefix(a.block_hashes, b.block_hashes)
                == _common_prefix(ra["hash_ids"], rb["hash_ids"]))
    reuse = reuse_fraction(trace.requests)
    assert reuse == pytest.approx(_raw_reuse(rows), abs=1e-12)
    assert reuse == pytest.approx(0.374, abs=0.001)  # traces README


def test_mooncake_synthetic_reuse_matches_readme():
    _need(SYNTH)
    trace = load_mooncake(SYNTH)
    rows = [json.loads(line) for line in SYNTH.read_text().splitlines()]
    assert reuse_fraction(trace.requests) == pytest.approx(_raw_reuse(rows), abs=1e-12)
    assert reuse_fraction(trace.requests) == pytest.approx(0.651, abs=0.001)


def test_azure_real():
    _need(AZURE)
    trace = load_azure(AZURE)
    with open(AZURE, newline="") as f:
        raw = list(csv.DictReader(f))
    assert len(trace) == len(raw) == 8_819 and trace.name == "azure-code"
    ts = np.array([r["TIMESTAMP"] for r in raw], dtype="datetime64[ns]")
    secs = (ts - ts.min()) / np.timedelta64(1, "s")
    for req in trace.requests[::97]:
        i = int(req.request_id.split(":")[1])
        assert req.arrival_time == pytest.approx(secs[i], abs=1e-6)
        assert req.input_len == int(raw[i]["ContextTokens"])
    t = [r.arrival_time for r in trace.requests]
    assert t == sorted(t) and t[0] == 0.0
    blocks = [h for r in trace.requests for h in r.block_hashes]
    assert len(set(blocks)) == len(blocks)  # no prefix information: nothing shared
    assert reuse_fraction(trace.requests) == 0.0


def test_leval_real_sharing_arrivals_and_determinism():
    _need(LEVAL)
    trace = load_leval(LEVAL, rate=4.0, seed=3)
    with open(LEVAL, newline="") as f:
        raw = list(csv.DictReader(f))
    assert len(trace) == len(raw) == 2_074
    by_id = {int(r.request_id.split(":")[1]): r for r in trace.requests}
    doc = {i: (raw[i]["task"], raw[i]["doc_id"]) for i in by_id}
    # Same document: the document's full blocks are shared, and nothing more; else nothing.
    for i, j in [(0, 1), (0, 5), (0, 1500), (171, 172), (1500, 1501), (2072, 2073)]:
        common = _common_prefix(by_id[i].block_hashes, by_id[j].block_hashes)
        want = int(raw[i]["doc_tokens"]) // 512 if doc[i] == doc[j] else 0
        assert common == want, (i, j)
    gaps = np.diff([0.0] + [r.arrival_time for r in trace.requests])
    assert gaps.min() > 0 and gaps.mean() == pytest.approx(1 / 4.0, rel=0.1)
    # Independent reuse: every later question on a document hits its full doc blocks.
    seen, hit = set(), 0
    for r in trace.requests:
        i = int(r.request_id.split(":")[1])
        if doc[i] in seen:
            hit += min(int(raw[i]["doc_tokens"]) // 512, (r.input_len - 1) // 512) * 512
        seen.add(doc[i])
    total = sum(int(r["input_tokens"]) for r in raw)
    assert reuse_fraction(trace.requests) == pytest.approx(hit / total, abs=1e-12)
    again = load_leval(LEVAL, rate=4.0, seed=3)
    assert [r.request_id for r in again.requests] == [r.request_id for r in trace.requests]
    other = load_leval(LEVAL, rate=4.0, seed=4)
    assert [r.request_id for r in other.requests] != [r.request_id for r in trace.requests]


# ----------------------------------------------------------------------------- malformed lines

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


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


def test_azure_malformed_rows(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:03.9799600,100,5\n"
                    "2023-11-16 18:17:05.0000000,0,5\n"          # line 3: ContextTokens < 1
                    "yesterday,10,5\n"                           # line 4: TIMESTAMP
                    "2023-11-16 18:17:04.4799600,30\n"           # line 5: GeneratedTokens missing
                    "2023-11-16 18:17:04.0,700,x\n")             # line 6: GeneratedTokens
    with pytest.raises(TraceFormatError) as e:
        load_azure(path)
    assert (e.value.line, e.value.field) == (3, "ContextTokens")
    trace = load_azure(path, skip_malformed=True)
    assert (trace.skipped, trace.skipped_lines) == (4, (3, 4, 5, 6))
    assert [(r.arrival_time, r.input_len) for r in trace] == [(0.0, 100)]
    no_col = tmp_path / "b.csv"
    no_col.write_text("TIMESTAMP,Context,GeneratedTokens\n2023-11-16 18:17:03,1,1\n")
    with pytest.raises(TraceFormatError) as e:
        load_azure(no_col)
    assert (e.value.line, e.value.field) == (1, "ContextTokens")


def test_leval_malformed_rows(tmp_path):
    head = ("group,task,doc_id,query_idx,doc_tokens,instr_tokens,input_tokens,ref_output_tokens,"
            "doc_chars\n")
    path = tmp_path / "l.csv"
    path.write_text(head + "g,qa,0,0,1000,20,1020,3,9\n"
                    "g,qa,0,1,1000,30,1031,3,9\n"   # line 3: input != doc + instr
                    "g,qa,0,2,999,30,1029,3,9\n"    # line 4: doc_tokens disagrees with line 2
                    "g,qa,1,0,700,30,730,3,9\n")
    with pytest.raises(TraceFormatError) as e:
        load_leval(path, rate=1.0, seed=0)
    assert (e.value.line, e.value.field) == (3, "input_tokens")
    trace = load_leval(path, rate=1.0, seed=0, skip_malformed=True)
    assert (trace.skipped, trace.skipped_lines) == (2, (3, 4))
    assert sorted(r.request_id for r in trace) == ["leval:0", "leval:3"]


# ----------------------------------------------------------------------------- robustness

AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
LV_HEAD = "task,doc_id,doc_tokens,instr_tokens,input_tokens,ref_output_tokens\n"


def _mc(ts, n=600):
    return json.dumps({**GOOD, "timestamp": ts, "input_length": n})


def test_blank_lines_are_not_data(tmp_path):
    # Blank, whitespace-only and trailing blank lines: skipped, not malformed, no row index.
    path = tmp_path / "b.jsonl"
    path.write_text("\n" + _mc(0) + "\n\n   \t\n" + _mc(2000) + "\r\n \n" + _mc(1000) + "\n\n\n")
    for skip in (False, True):
        trace = load_mooncake(path, skip_malformed=skip)
        assert (trace.skipped, trace.skipped_lines) == (0, ())
        assert [(r.request_id, r.arrival_time) for r in trace] == [
            ("mooncake-b:0", 0.0), ("mooncake-b:2", 1.0), ("mooncake-b:1", 2.0)]
    # A malformed line among blanks keeps its own 1-based line number.
    path.write_text(_mc(0) + "\n\n{oops\n\n" + _mc(5) + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_mooncake(path)
    assert (e.value.line, e.value.field) == (3, "json")
    trace = load_mooncake(path, skip_malformed=True)
    assert trace.skipped_lines == (3,) and [r.request_id for r in trace] == ["mooncake-b:0",
                                                                              "mooncake-b:2"]
    az = tmp_path / "a.csv"
    az.write_text("\n" + AZ_HEAD + "2023-11-16 18:17:03,100,10\n\n  \n"
                  "2023-11-16 18:17:04.5,200,5\n\n\n")
    trace = load_azure(az)
    assert trace.skipped == 0
    assert [(r.request_id, r.arrival_time, r.input_len) for r in trace] == [
        ("azure-a:0", 0.0, 100), ("azure-a:1", 1.5, 200)]
    lv = tmp_path / "l.csv"
    lv.write_text(LV_HEAD + "qa,0,5,5,10,1\n \n\nqa,0,5,7,12,1\n\n")
    trace = load_leval(lv, rate=1.0, seed=0)
    assert trace.skipped == 0 and sorted(r.input_len for r in trace) == [10, 12]


def test_byte_order_mark_accepted(tmp_path):
    text = {"m.jsonl": _mc(0) + "\n" + _mc(1000) + "\n",
            "a.csv": AZ_HEAD + "2023-11-16 18:17:03,100,10\n2023-11-16 18:17:05,20,1\n",
            "l.csv": LV_HEAD + "qa,0,5,5,10,1\nqa,1,3,4,7,2\n"}
    loads = {"m.jsonl": load_mooncake, "a.csv": load_azure,
             "l.csv": lambda p: load_leval(p, rate=2.0, seed=1)}
    (tmp_path / "bom").mkdir()
    for name, body in text.items():
        plain, bom = tmp_path / name, tmp_path / "bom" / name  # same name: same content ids
        plain.write_text(body, encoding="utf-8")
        bom.write_text(body, encoding="utf-8-sig")
        assert bom.read_bytes()[:3] == b"\xef\xbb\xbf"
        a, b = loads[name](plain), loads[name](bom)
        assert b.skipped == 0
        assert ([(r.arrival_time, r.input_len, r.output_len, r.block_hashes) for r in a]
                == [(r.arrival_time, r.input_len, r.output_len, r.block_hashes) for r in b])


def test_invalid_utf8_is_a_row_error(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes((_mc(0) + "\n").encode() + b'{"timestamp": 1, "x": "\xff\xfe"}\n'
                     + (_mc(7) + "\n").encode())
    with pytest.raises(TraceFormatError) as e:
        load_mooncake(path)
    assert (e.value.path, e.value.line, e.value.field) == (str(path), 2, "encoding")
    assert "line 2" in str(e.value) and "UTF-8" in str(e.value)
    trace = load_mooncake(path, skip_malformed=True)
    assert (trace.skipped_lines, [r.request_id for r in trace]) == ((2,), ["mooncake-u:0",
                                                                           "mooncake-u:2"])
    az = tmp_path / "a.csv"
    az.write_bytes(AZ_HEAD.encode() + b"2023-11-16 18:17:03,100,10\n"
                   b"2023-11-16 18:17:04,\xc3\x28,1\n2023-11-16 18:17:05,30,1\n")
    with pytest.raises(TraceFormatError) as e:
        load_azure(az)
    assert (e.value.line, e.value.field) == (3, "encoding")
    trace = load_azure(az, skip_malformed=True)
    assert trace.skipped_lines == (3,) and [r.input_len for r in trace] == [100, 30]
    head = tmp_path / "h.csv"
    head.write_bytes(b"TIMESTAMP,Context\xffTokens,GeneratedTokens\n2023-11-16 18:17:03,1,1\n")
    with pytest.raises(TraceFormatError) as e:
        load_azure(head, skip_malformed=True)  # a bad header is not skippable
    assert (e.value.line, e.value.field) == (1, "encoding")


def test_timestamp_past_float_range_is_a_row_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(_mc(0) + "\n" + _mc(10**400) + "\n" + _mc(3000) + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_mooncake(path)
    assert (e.value.line, e.value.field) == (2, "timestamp")
    assert len(str(e.value)) < 300  # the 401-digit value is summarised, not printed
    trace = load_mooncake(path, skip_malformed=True)
    assert trace.skipped_lines == (2,) and [r.arrival_time for r in trace] == [0.0, 3.0]


@pytest.mark.parametrize("row,field", [
    ("2023-11-16 18:17:04,2147483648,1", "ContextTokens"),    # 2^31
    ("2023-11-16 18:17:04,5000000000,1", "ContextTokens"),
    ("2023-11-16 18:17:04," + "9" * 6000 + ",1", "ContextTokens"),
    ("2023-11-16 18:17:04,10,2147483648", "GeneratedTokens"),
])
def test_azure_absurd_token_counts_are_row_errors(tmp_path, row, field):
    path = tmp_path / "a.csv"
    path.write_text(AZ_HEAD + "2023-11-16 18:17:03,100,10\n" + row + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_azure(path)
    assert (e.value.line, e.value.field) == (3, field) and len(str(e.value)) < 300
    trace = load_azure(path, skip_malformed=True)
    assert trace.skipped_lines == (3,) and [r.input_len for r in trace] == [100]


@pytest.mark.parametrize("row,field", [("qa,1,2147483648,1,2147483649,1", "doc_tokens"),
                                       ("qa,1,1,2147483648,2147483649,1", "instr_tokens")])
def test_leval_absurd_token_counts_are_row_errors(tmp_path, row, field):
    path = tmp_path / "l.csv"
    path.write_text(LV_HEAD + "qa,0,5,5,10,1\n" + row + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_leval(path, rate=1.0, seed=0)
    assert (e.value.line, e.value.field) == (3, field)
    trace = load_leval(path, rate=1.0, seed=0, skip_malformed=True)
    assert trace.skipped_lines == (3,) and [r.input_len for r in trace] == [10]


def test_duplicate_csv_column_is_rejected(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n"
                    "2023-11-16 18:17:03,5,1,7\n")
    for skip in (False, True):
        with pytest.raises(TraceFormatError) as e:
            load_azure(path, skip_malformed=skip)
        assert (e.value.line, e.value.field) == (1, "ContextTokens")
        assert "duplicated" in str(e.value)
    lv = tmp_path / "l.csv"
    lv.write_text(LV_HEAD.strip() + ",doc_id\nqa,0,5,5,10,1,0\n")
    with pytest.raises(TraceFormatError) as e:
        load_leval(lv, rate=1.0, seed=0)
    assert e.value.field == "doc_id"


# ----------------------------------------------------------------------------- re-blocking


def _reqs(hand, bs):
    return [reblock_hash_ids(ids, n, 512, bs) for ids, n in hand]


def test_reblock_preserves_sharing_structure():
    # A and B share source blocks 1, 2; A and C share source block 1 only.
    hand = [([1, 2, 3], 1300), ([1, 2, 4], 1100), ([1, 5], 800)]
    a, b, c = _reqs(hand, 256)
    assert (len(a), len(b), len(c)) == (6, 5, 4)
    assert _common_prefix(a, b) == 4   # tokens [0, 1024) = source blocks 1, 2
    assert _common_prefix(a, c) == 2   # tokens [0, 512) = source block 1
    a, b, c = _reqs(hand, 1024)
    assert (_common_prefix(a, b), _common_prefix(a, c)) == (1, 0)
    a, b, c = _reqs(hand, 768)          # block 0 = source 1 + half of source 2
    assert (_common_prefix(a, b), _common_prefix(a, c)) == (1, 0)
    a, b, c = _reqs(hand, 512)          # same structure as the trace's own ids
    assert (_common_prefix(a, b), _common_prefix(a, c)) == (2, 1)


def test_mooncake_block_size_flag(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 3]},
            {"timestamp": 5, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 4]}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = load_mooncake(path, block_size=256).requests
    assert a.block_size == 256 and len(a.block_hashes) == 6
    assert _common_prefix(a.block_hashes, b.block_hashes) == 4
    # Unbounded-cache reuse at 256: B hits 4 blocks of 256 = 1024 tokens.
    assert reuse_fraction([a, b]) == pytest.approx(1024 / 2400)


def test_segment_block_ids_by_hand():
    s, t = 0xABCDEF0123456789, 0x1111222233334444
    ids = segment_block_ids([(s, 700), (t, 300)], 512)
    assert ids == [s ^ 512, ((s ^ (512 << 32 | 188)) * 31 % 2**64) ^ t ^ 300]
    assert segment_block_ids([(s, 700), (t, 300)], 512, start_block=1) == ids[1:]
    with pytest.raises(ValueError, match="segment length"):
        segment_block_ids([(s, 0)], 512)


# ----------------------------------------------------------------------------- windows, dispatch


def _ticks(n):
    return [Request(f"r:{i}", float(i), 10, 1, chain_block_hashes([i]), 16) for i in range(n)]


def test_sample_window():
    reqs = _ticks(100)
    w = sample_window(reqs, 10.0, seed=7)
    start = np.random.default_rng(7).uniform(0.0, 89.0)
    first = math.ceil(start)
    assert [r.request_id for r in w] == [f"r:{i}" for i in range(first, first + 10)]
    assert [r.arrival_time for r in w] == pytest.approx([i - start
                                                         for i in range(first, first + 10)])
    assert w[0].arrival_time >= 0
    assert [r.request_id for r in sample_window(reqs, 10.0, seed=7)] == [r.request_id for r in w]
    whole = sample_window(reqs, 1000.0, seed=1)
    assert len(whole) == 100 and whole[0].arrival_time == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        sample_window(reqs, 0.0, seed=0)


def test_load_trace_dispatch(tmp_path):
    m = tmp_path / "x.jsonl"
    m.write_text(json.dumps(GOOD) + "\n")
    a = tmp_path / "y.csv"
    a.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,10,1\n")
    l_ = tmp_path / "z.csv"
    l_.write_text("task,doc_id,doc_tokens,instr_tokens,input_tokens,ref_output_tokens\n"
                  "qa,0,5,5,10,1\n")
    assert isinstance(load_trace(m), Trace) and load_trace(m).name == "mooncake-x"
    assert load_trace(a).name == "azure-y" and load_trace(f"azure:{a}").name == "azure-y"
    assert load_trace(l_, rate=1.0).requests[0].input_len == 10
    with pytest.raises(ValueError, match="rate"):
        load_trace(l_)
    with pytest.raises(ValueError, match="fmt"):
        load_trace(m, fmt="parquet")
