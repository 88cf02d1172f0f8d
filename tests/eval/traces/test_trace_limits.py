"""Limits of trace reading (eval.traces.parsing): JSON nested too deeply, over-long lines and
session files, and paths that are not regular files (FIFOs, devices). Each is a row or file
error naming the file (and line), skipped and counted under skip_malformed; none hangs, recurses
past the stack or exhausts memory."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import tracemalloc

import pytest

from eval.traces import json_depth, parsing
from eval.traces.loaders import TraceFormatError, load_azure, load_mooncake, load_trace
from eval.traces.sessions import load_sessions
from tests.eval.traces.trace_fixtures import AZ_HEAD, mooncake_line

DEPTH = "arrays and objects nested more than 100 levels deep (eval.traces.parsing.MAX_JSON_DEPTH)"
SESSION = {"id": "s0", "block_size": 64, "requests": [{"t": 0, "in": 128, "out": 5,
                                                       "hash_ids": [1, 2]}]}


@contextlib.contextmanager
def deadline(seconds: int):
    """Fails the block instead of hanging past `seconds` (a FIFO open used to block forever)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def nested(depth: int, inner: str = "1") -> str:
    return '{"a":' * depth + inner + "}" * depth


# ----------------------------------------------------------------------------- nesting


def test_jsonl_lines_nested_1200_deep_are_row_errors(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join([mooncake_line(0), "[" * 1200 + "]" * 1200, nested(1200),
                               mooncake_line(1000)]) + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_mooncake(path)
    assert str(e.value) == f"{path}, line 2, field 'json': {DEPTH}"
    assert (e.value.line, e.value.field) == (2, "json")
    trace = load_mooncake(path, skip_malformed=True)
    assert (trace.skipped, trace.skipped_lines) == (2, (2, 3))
    assert [r.request_id for r in trace] == ["mooncake-deep:0", "mooncake-deep:3"]


def test_nesting_limit_is_exact_and_ignores_brackets_in_strings(tmp_path):
    path = tmp_path / "d.jsonl"
    # 100 levels (the object itself is level 1): parsed (the extra key is ignored).
    path.write_text(mooncake_line(0)[:-1] + ', "x": ' + "[" * 99 + "]" * 99 + "}\n")
    trace = load_mooncake(path)
    assert len(trace) == 1
    path.write_text(mooncake_line(0)[:-1] + ', "x": ' + "[" * 100 + "]" * 100 + "}\n")
    with pytest.raises(TraceFormatError, match="field 'json': arrays and objects nested more"):
        load_mooncake(path)
    path.write_text(mooncake_line(0)[:-1] + ', "x": "' + "[{" * 600 + '\\"[["}\n')
    assert len(load_mooncake(path)) == 1  # brackets in a string (escaped quote included)


def test_session_files_nested_too_deeply_name_file_and_line(tmp_path):
    folder = tmp_path / "agents"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(SESSION))
    (folder / "b.json").write_text('{\n"id": "s1",\n"x":\n' + "[" * 1200 + "]" * 1200 + "}")
    with pytest.raises(TraceFormatError) as e:
        load_sessions(folder)
    assert str(e.value) == f"{folder / 'b.json'}, line 4, field 'json': {DEPTH}"
    work = load_sessions(folder, skip_malformed=True)
    assert (work.skipped, [s.session_id for s in work.sessions]) == (1, ["s0"])
    # Sub-agents nested 1,200 deep (each level 2 JSON levels): refused before any recursion.
    sub = json.dumps(SESSION["requests"][0])
    entry = sub
    for _ in range(1200):
        entry = '{"t": 0, "type": "subagent", "requests": [' + sub + ", " + entry + "]}"
    (folder / "b.json").write_text('{"id": "s1", "block_size": 64, "requests": [' + sub + ", "
                                   + entry + "]}")
    with pytest.raises(TraceFormatError, match=r"b\.json, line 1, field 'json': arrays and"):
        load_sessions(folder)
    assert load_sessions(folder, skip_malformed=True).skipped == 1


def _depth_line_char_by_char(text: str, limit: int) -> int | None:
    """The reference of `json_depth.first_too_deep_line`: one character at a time."""
    depth, in_string, escaped, line = 0, False, False, 1
    for c in text:
        line += c == "\n"
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{]}":
            depth += 1 if c in "[{" else -1
            if depth > limit:
                return line
    return None


def test_depth_scan_in_chunks_agrees_with_a_character_scan(monkeypatch):
    """Strings, escapes and brackets across every chunk boundary (chunks of 1 to 8 characters)."""
    rng = random.Random(11)
    for chunk in (1, 2, 3, 5, 8, json_depth.SCAN_CHARS):
        monkeypatch.setattr(json_depth, "SCAN_CHARS", chunk)
        for trial in range(1500):
            text = "".join(rng.choice('[[{]}"\\a\né') for _ in range(rng.randrange(0, 40)))
            limit = rng.randrange(0, 4)
            want = _depth_line_char_by_char(text, limit)
            assert json_depth.first_too_deep_line(text, limit) == want, (chunk, text, limit)


def test_depth_scan_memory_is_bounded_whatever_the_line_length():
    """A 64 MiB line of `[` (it allocated 30 times that, 1.9 GB, before), and a long balanced
    text with strings: the scan allocates a few MiB, its chunks' worth."""
    unit = '[[1,{"k":[2]}],"s\\"]"],'  # nests 4 deep; the string holds `\"]`
    for text, line in (("[" * parsing.MAX_LINE_BYTES, 1),
                       (unit * ((2 << 20) // len(unit)) + "\n" + "[" * 101, 2)):
        tracemalloc.start()
        try:
            assert parsing._json_too_deep(text) == line
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 12 << 20, f"{peak / 2**20:.1f} MiB for a line of {len(text) >> 20} MiB"


# ----------------------------------------------------------------------------- line length


def test_physical_lines_split_as_splitlines_within_the_cap():
    rng = random.Random(7)
    for trial in range(300):
        data = bytes(rng.choice(b"ab\r\n") for _ in range(rng.randrange(0, 60)))
        limit = rng.randrange(1, 8)
        want = [ln if len(ln.rstrip(b"\r\n")) <= limit else None
                for ln in data.splitlines(keepends=True)]
        got = list(parsing._physical_lines(io.BufferedReader(io.BytesIO(data)), limit))
        assert got == want, (trial, data, limit)
    # "\r\n" split across two reads stays one line end.
    f = io.BufferedReader(io.BytesIO(b"abc\r\nd\n"))
    assert list(parsing._physical_lines(f, 3)) == [b"abc\r\n", b"d\n"]


def test_over_long_lines_are_row_errors_read_past(tmp_path, monkeypatch):
    monkeypatch.setattr(parsing, "MAX_LINE_BYTES", 100)
    path = tmp_path / "long.jsonl"
    line = mooncake_line(0)
    assert len(line) <= 100
    path.write_text(line + "\n" + " " * 101 + "\n" + "x" * 5000 + "\r\n" + mooncake_line(2000))
    with pytest.raises(TraceFormatError) as e:
        load_mooncake(path)
    assert str(e.value) == (f"{path}, line 2: line longer than 100 bytes "
                            f"(eval.traces.parsing.MAX_LINE_BYTES)")
    trace = load_mooncake(path, skip_malformed=True)
    assert (trace.skipped_lines, [r.request_id for r in trace]) == ((2, 3), ["mooncake-long:0",
                                                                             "mooncake-long:3"])
    csv = tmp_path / "a.csv"
    csv.write_text(AZ_HEAD + "2023-11-16 18:17:03,100,10\n" + "9" * 200 + "\n"
                   + "2023-11-16 18:17:05,20,1\n")
    with pytest.raises(TraceFormatError, match=r"a\.csv, line 3: line longer than 100 bytes"):
        load_azure(csv)
    assert load_azure(csv, skip_malformed=True).skipped_lines == (3,)
    csv.write_text("TIMESTAMP," + "x" * 200 + "\n")  # the header: fatal, no field
    with pytest.raises(TraceFormatError) as e:
        load_azure(csv, skip_malformed=True)
    assert (e.value.line, e.value.field) == (1, None)
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "big.json").write_text(json.dumps(SESSION) + " " * 100)
    with pytest.raises(TraceFormatError) as e:
        load_sessions(tmp_path / "agents")
    assert str(e.value) == (f"{tmp_path / 'agents' / 'big.json'}: file longer than 100 bytes "
                            f"(eval.traces.parsing.MAX_LINE_BYTES)")


def test_the_real_cap_is_64_mib():
    assert parsing.MAX_LINE_BYTES == 64 * 2**20 and parsing.MAX_JSON_DEPTH == 100


# ----------------------------------------------------------------------------- not regular files


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifos_and_devices_are_refused_without_reading(tmp_path):
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)
    must = "a trace must be a regular file"
    with deadline(20):
        for load in (load_mooncake, lambda p: load_trace(p), lambda p: load_trace(f"azure:{p}")):
            with pytest.raises(TraceFormatError) as e:
                load(fifo)
            assert str(e.value) == f"{fifo}: is a FIFO: {must}"
        csv = tmp_path / "t.csv"  # format detection reads the header: refused there too
        os.mkfifo(csv)
        with pytest.raises(TraceFormatError, match=f"t.csv: is a FIFO: {must}"):
            load_trace(csv)
        with pytest.raises(TraceFormatError) as e:
            load_sessions(fifo)
        assert str(e.value) == (f"{fifo}: is a FIFO: agent sessions must be a regular file or "
                                f"a folder of regular files")
        folder = tmp_path / "agents"
        folder.mkdir()
        (folder / "a.json").write_text(json.dumps(SESSION))
        os.mkfifo(folder / "b.json")
        with pytest.raises(TraceFormatError, match=r"b\.json: is a FIFO: agent sessions must"):
            load_sessions(folder)
        assert load_sessions(folder, skip_malformed=True).skipped == 1
        if os.path.exists("/dev/zero"):
            with pytest.raises(TraceFormatError, match="^/dev/zero: is a character device: a "
                                                       "trace must be a regular file$"):
                load_trace("mooncake:/dev/zero")
        with pytest.raises(TraceFormatError, match=f"is a folder: {must}"):
            load_mooncake(folder)
