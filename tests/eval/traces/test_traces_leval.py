"""L-Eval trace loader: the real shared trace (documents shared, Poisson arrivals), malformed
rows, absurd counts."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from eval.traces.loaders import TraceFormatError, load_leval
from eval.traces.workloads import reuse_fraction
from tests.eval.traces.trace_fixtures import LEVAL, LV_HEAD, common_prefix, need


def test_leval_real_sharing_arrivals_and_determinism():
    need(LEVAL)
    trace = load_leval(LEVAL, rate=4.0, seed=3)
    with open(LEVAL, newline="") as f:
        raw = list(csv.DictReader(f))
    assert len(trace) == len(raw) == 2_074
    by_id = {int(r.request_id.split(":")[1]): r for r in trace.requests}
    doc = {i: (raw[i]["task"], raw[i]["doc_id"]) for i in by_id}
    # Same document: the document's full blocks are shared, and nothing more; else nothing.
    for i, j in [(0, 1), (0, 5), (0, 1500), (171, 172), (1500, 1501), (2072, 2073)]:
        common = common_prefix(by_id[i].block_hashes, by_id[j].block_hashes)
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
