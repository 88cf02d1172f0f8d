"""Azure LLM inference trace loader: the real shared trace, malformed rows, absurd counts."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from eval.traces.loaders import TraceFormatError, load_azure
from eval.traces.workloads import reuse_fraction
from tests.eval.traces.trace_fixtures import AZ_HEAD, AZURE, need


def test_azure_real():
    need(AZURE)
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
