"""Trace loaders across formats: blank lines, byte order marks, bad UTF-8, duplicate columns,
block content ids, windows and format dispatch. Per format: test_traces_mooncake.py,
test_traces_azure.py, test_traces_leval.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from eval.traces.content import segment_block_ids
from eval.traces.loaders import (Trace, TraceFormatError, load_azure, load_leval, load_mooncake,
                         load_trace, sample_window)
from serving.policy.request import Request, chain_block_hashes
from tests.eval.traces.trace_fixtures import AZ_HEAD, GOOD, LV_HEAD, mooncake_line


# ----------------------------------------------------------------------------- robustness


def test_blank_lines_are_not_data(tmp_path):
    # Blank, whitespace-only and trailing blank lines: skipped, not malformed, no row index.
    path = tmp_path / "b.jsonl"
    path.write_text("\n" + mooncake_line(0) + "\n\n   \t\n" + mooncake_line(2000) + "\r\n \n"
                    + mooncake_line(1000) + "\n\n\n")
    for skip in (False, True):
        trace = load_mooncake(path, skip_malformed=skip)
        assert (trace.skipped, trace.skipped_lines) == (0, ())
        assert [(r.request_id, r.arrival_time) for r in trace] == [
            ("mooncake-b:0", 0.0), ("mooncake-b:2", 1.0), ("mooncake-b:1", 2.0)]
    # A malformed line among blanks keeps its own 1-based line number.
    path.write_text(mooncake_line(0) + "\n\n{oops\n\n" + mooncake_line(5) + "\n")
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
    text = {"m.jsonl": mooncake_line(0) + "\n" + mooncake_line(1000) + "\n",
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
    path.write_bytes((mooncake_line(0) + "\n").encode() + b'{"timestamp": 1, "x": "\xff\xfe"}\n'
                     + (mooncake_line(7) + "\n").encode())
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


# ----------------------------------------------------------------------------- content ids


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
