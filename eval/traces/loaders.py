"""Trace loaders: Mooncake JSONL, Azure LLM-inference CSV and L-Eval CSV -> `Trace` of `Request`s.

Every loader reads the file's lines into a `grain.MapDataset` (`MapDataset.source(rows)
.map_with_index(parse)`), validates each row and returns a `Trace` whose requests are sorted by
arrival time (a stable sort: ties keep file order). Request ids are stable strings
`"<trace name>:<row>"`, `row` being the 0-based data row of the file (in a file without blank
lines: the JSONL line number minus 1; the CSV line number minus 2 for the header), so they
survive sorting and windowing.

Reading: files are read as UTF-8, a leading byte-order mark accepted (as `encoding="utf-8-sig"`);
lines end at `\n`, `\r\n` or `\r`. Blank and whitespace-only lines (trailing ones included)
are not data: they are skipped, are not counted as malformed and do not take a row index. Token
counts must be integers below 2^31.

A malformed row raises `TraceFormatError` naming the file, the 1-based line number and the
field; so does a line that is not valid UTF-8 (field "encoding"), a JSON line nesting arrays and
objects more than `MAX_JSON_DEPTH` levels deep (field "json") and a line longer than
`MAX_LINE_BYTES` (no field: "FILE, line N: line longer than X bytes"). With
`skip_malformed=True` such rows are dropped instead and counted in `Trace.skipped` (their line
numbers in `Trace.skipped_lines`; an over-long line is read past, never held in memory); nothing
is dropped silently. A trace must be a regular file: a FIFO, a device (/dev/zero), a socket or a
folder is refused with a `TraceFormatError` naming it before anything is read (see
`eval.traces.parsing` for the limits).

Prefix structure is carried as block-hash chains (`serving.policy.request.chain_block_hashes`). Where a
trace has no per-block ids, a prompt is modelled as a concatenation of content *segments*
`(segment_id, length)` and `segment_block_ids` gives each block a content id from the segment
pieces it covers; equal content ids at equal block positions mean equal tokens.

Formats: see `../shared/traces/README.md` and the public sources (kvcache-ai/Mooncake
`FAST25-release/traces/`, Azure/AzurePublicDataset `AzureLLMInferenceTrace_*.csv`, OpenLMLab/LEval).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import pathlib
import zlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from eval.traces.content import reblock_hash_ids, segment_block_ids, segment_id
from eval.traces.parsing import (MAX_LINE_BYTES, MAX_TOKENS, Trace,  # noqa: F401
                                TraceFormatError, _blank, _check_block_size, _csv_int, _finish,
                                _json_int, _json_row, _open_regular, _parse_datetime, _ragged,
                                _read_csv, _read_lines, _RowError, _run_rows, _show)
from eval.traces.sessions import SessionWorkload, load_sessions
from serving.policy.request import Request, chain_block_hashes, num_blocks

MOONCAKE_BLOCK_SIZE = 512  # tokens per `hash_ids` entry in the Mooncake traces
TRACE_FORMATS = ("mooncake", "azure", "leval", "sessions")  # `load_trace`'s formats and prefixes


class UnknownTraceFormat(ValueError):
    """`load_trace` with `fmt="auto"` cannot tell a file's format from its name or header."""


# Segment-kind tags, mixed into segment ids so ids of different loaders never collide.
_TAG_AZURE = 0x415A5552
_TAG_LEVAL_DOC, _TAG_LEVAL_INSTR = 0x4C444F43, 0x4C494E53


def load_mooncake(path: str | pathlib.Path, block_size: int = MOONCAKE_BLOCK_SIZE,
                  skip_malformed: bool = False, name: str | None = None,
                  source_block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Loads a Mooncake JSONL trace (kvcache-ai/Mooncake `FAST25-release/traces/`).

    Each line: `{"timestamp": ms >= 0, "input_length": tokens >= 1, "output_length": tokens >= 0,
    "hash_ids": [int, ...]}` with `len(hash_ids) == ceil(input_length / source_block_size)`.
    Arrival = timestamp / 1000 seconds (not re-based). At `block_size == source_block_size` the
    block hashes are `chain_block_hashes(hash_ids)`; otherwise the trace is re-blocked by
    `reblock_hash_ids` (sharing kept at the new granularity).

    Args:
      path: the .jsonl file.
      block_size: tokens per block of the returned requests, >= 1.
      skip_malformed: drop and count malformed lines instead of raising.
      name: trace name and request-id prefix; default "mooncake-conv" / "mooncake-synth" /
        "mooncake-tool" for the public files, else "mooncake-<file stem>".
      source_block_size: tokens per `hash_ids` entry in the file (512 for the public traces).

    Returns:
      A `Trace`; request ids "<name>:<row>", row the 0-based index among the non-blank lines.

    Raises:
      TraceFormatError: a malformed line (file, line, field; a timestamp past the float range,
        a length >= 2^31, a line that is not UTF-8, nested more than MAX_JSON_DEPTH levels or
        longer than MAX_LINE_BYTES included), no valid line at all, or a path that is not a
        regular file.
      ValueError: block_size or source_block_size < 1.
      OSError: the file cannot be read.
    """
    _check_block_size(block_size)
    _check_block_size(source_block_size)
    path = pathlib.Path(path)
    if name is None:
        stem = path.stem.removesuffix("_trace")
        short = {"conversation": "conv", "synthetic": "synth", "toolagent": "tool"}
        name = "mooncake-" + short.get(stem, stem)

    def parse(i: int, item: tuple[int, str | _RowError]) -> Request:
        text = item[1]
        if isinstance(text, _RowError):
            raise text
        obj = _json_row(text)  # not JSON, or nested deeper than MAX_JSON_DEPTH: a row error
        if not isinstance(obj, dict):
            raise _RowError("json", f"expected a JSON object, got {type(obj).__name__}")
        if "timestamp" not in obj:
            raise _RowError("timestamp", "missing")
        ts = obj["timestamp"]
        try:  # float() of an int past the float range raises OverflowError
            ok = type(ts) in (int, float) and math.isfinite(ms := float(ts)) and ms >= 0
        except OverflowError:
            ok = False
        if not ok:
            raise _RowError("timestamp", f"must be a finite number >= 0 (ms), got {_show(ts)}")
        input_len = _json_int(obj, "input_length", 1)
        output_len = _json_int(obj, "output_length", 0)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(type(h) is int for h in ids):
            raise _RowError("hash_ids", "must be a list of integers")
        want = num_blocks(input_len, source_block_size)
        if len(ids) != want:
            raise _RowError("hash_ids", f"must have ceil(input_length / {source_block_size}) = "
                                        f"{want} entries, got {len(ids)}")
        if block_size == source_block_size:
            hashes = chain_block_hashes(ids)
        else:
            hashes = reblock_hash_ids(ids, input_len, source_block_size, block_size)
        return Request(f"{name}:{i}", ms / 1000.0, input_len, output_len, hashes, block_size)

    rows = [(n, text) for n, text in enumerate(_read_lines(path), start=1)
            if not (isinstance(text, str) and _blank(text))]
    reqs, skipped = _run_rows(path, rows, lambda i, item: item[0], parse, skip_malformed)
    return _finish(name, path, reqs, skipped)


def load_azure(path: str | pathlib.Path, skip_malformed: bool = False, block_size: int = 512,
               name: str | None = None) -> Trace:
    """Loads an Azure LLM inference trace CSV (Azure/AzurePublicDataset, Splitwise, ISCA 2024).

    Columns `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is a date-time such as
    `2023-11-16 18:17:03.9799600` (fractional digits past microseconds are dropped). Arrival =
    seconds since the earliest TIMESTAMP of the file. The trace has no prefix information, so
    every request gets its own unique content (one segment per row): no two requests share a block.

    Args:
      path: the .csv file.
      skip_malformed: drop and count malformed rows instead of raising.
      block_size: tokens per block, >= 1.
      name: trace name; default "azure-code" / "azure-conv" for the public files.

    Returns:
      A `Trace`; request ids "<name>:<row>", row the 0-based data row.

    Raises:
      TraceFormatError: missing or duplicated column; ContextTokens not in [1, 2^31),
        GeneratedTokens not in [0, 2^31), bad TIMESTAMP, ragged row, a line not UTF-8 or longer
        than MAX_LINE_BYTES; no valid row; or a path that is not a regular file.
      ValueError: block_size < 1.
    """
    _check_block_size(block_size)
    path = pathlib.Path(path)
    if name is None:
        name = "azure-" + path.stem.removeprefix("AzureLLMInferenceTrace_")
    rows = _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    name_key = zlib.crc32(name.encode())

    def parse(i: int, item: tuple[int, Any]) -> tuple[int, datetime.datetime, int, int]:
        row = _ragged(item[1])
        ctx = _csv_int(row, "ContextTokens", 1)
        gen = _csv_int(row, "GeneratedTokens", 0)
        return i, _parse_datetime(row["TIMESTAMP"]), ctx, gen

    parsed, skipped = _run_rows(path, rows, lambda i, item: item[0], parse, skip_malformed)
    t0 = min(p[1] for p in parsed)
    reqs = []
    for i, dt, ctx, gen in parsed:
        ids = segment_block_ids([(segment_id(_TAG_AZURE, name_key, i), ctx)], block_size)
        reqs.append(Request(f"{name}:{i}", (dt - t0).total_seconds(), ctx, gen,
                            chain_block_hashes(ids), block_size))
    return _finish(name, path, reqs, skipped)


def load_leval(path: str | pathlib.Path, rate: float, seed: int, block_size: int = 512,
               skip_malformed: bool = False, name: str = "leval") -> Trace:
    """Loads the L-Eval request CSV and gives it seeded Poisson arrivals.

    Columns used: `task, doc_id, doc_tokens, instr_tokens, input_tokens, ref_output_tokens`
    (`input_tokens == doc_tokens + instr_tokens` is checked; all rows of one `(task, doc_id)` must
    agree on doc_tokens). A prompt is the document segment (shared by every question on that
    `(task, doc_id)`: doc_id restarts per task) followed by a unique instruction segment, so the
    questions on a document share its full blocks as a prefix. output_len = ref_output_tokens.

    Order and arrivals: the rows are put in a uniformly random order
    (`numpy.random.default_rng(seed).permutation`), so the questions on one document are
    interleaved with other documents' and spread over the run, as independent users would send
    them (the harder case for a finite cache; with an unbounded cache the reuse does not depend on
    the order). Arrival times are a Poisson process at `rate`: cumulative sums of
    `Exponential(1/rate)` gaps drawn from the same generator.

    Args:
      path: the .csv file.
      rate: mean arrival rate, requests per second, > 0.
      seed: seed of the order and the arrivals.
      block_size: tokens per block, >= 1.
      skip_malformed: drop and count malformed rows instead of raising.
      name: trace name and request-id prefix.

    Returns:
      A `Trace`; request ids "<name>:<row>", row the 0-based data row.

    Raises:
      TraceFormatError: a missing or duplicated column, a bad or inconsistent value (token counts
        must be in [0, 2^31)), a line not UTF-8 or longer than MAX_LINE_BYTES (file, line,
        field); or a path that is not a regular file.
      ValueError: rate not a finite number > 0, or block_size < 1.
    """
    _check_block_size(block_size)
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 requests/s, got {rate!r}")
    path = pathlib.Path(path)
    cols = ("task", "doc_id", "doc_tokens", "instr_tokens", "input_tokens", "ref_output_tokens")
    rows = _read_csv(path, cols)

    def parse(i: int, item: tuple[int, Any]) -> tuple[int, int, tuple[str, str], int, int, int]:
        row = _ragged(item[1])
        doc = _csv_int(row, "doc_tokens", 0)
        instr = _csv_int(row, "instr_tokens", 0)
        total = _csv_int(row, "input_tokens", 1)
        out = _csv_int(row, "ref_output_tokens", 0)
        if total != doc + instr:
            raise _RowError("input_tokens", f"must equal doc_tokens + instr_tokens = {doc + instr}, "
                                            f"got {total}")
        return i, item[0], (row["task"].strip(), row["doc_id"].strip()), doc, instr, out

    parsed, skipped = _run_rows(path, rows, lambda i, item: item[0], parse, skip_malformed)
    # Second pass, in file order: the first valid row of a document fixes its length.
    doc_len: dict[tuple[str, str], int] = {}
    consistent = []
    for p in parsed:
        if doc_len.setdefault(p[2], p[3]) != p[3]:
            if not skip_malformed:
                raise TraceFormatError(path, p[1], "doc_tokens", f"document {p[2]} has "
                                       f"{doc_len[p[2]]} tokens in an earlier row, got {p[3]}")
            skipped.append(p[1])
        else:
            consistent.append(p)
    skipped.sort()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(consistent))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(consistent)))
    name_key = zlib.crc32(name.encode())
    reqs = []
    for t, k in zip(arrivals.tolist(), order.tolist()):
        i, _, key, doc, instr, out = consistent[k]
        segs = []
        if doc:
            segs.append((segment_id(_TAG_LEVAL_DOC, zlib.crc32("/".join(key).encode())), doc))
        if instr:
            segs.append((segment_id(_TAG_LEVAL_INSTR, name_key, i), instr))
        hashes = chain_block_hashes(segment_block_ids(segs, block_size))
        reqs.append(Request(f"{name}:{i}", t, doc + instr, out, hashes, block_size))
    return _finish(name, path, reqs, skipped)


def load_trace(spec: str | pathlib.Path, fmt: str = "auto", block_size: int = 512,
               skip_malformed: bool = False, rate: float | None = None, seed: int = 0,
               trace_block_size: int = MOONCAKE_BLOCK_SIZE, warm_prefix_pct: float = 0.5
               ) -> Trace | SessionWorkload:
    """Loads a trace in any supported format (for the CLIs).

    Args:
      spec: the file or folder path, optionally prefixed by its format: "mooncake:PATH",
        "azure:PATH", "leval:PATH", "sessions:PATH".
      fmt: "auto" (the prefix, else a folder -> sessions; `.jsonl` -> mooncake; `.csv` -> azure
        if the header has TIMESTAMP, leval if it has doc_id), or one of "mooncake", "azure",
        "leval", "sessions".
      block_size: tokens per block of the returned requests, >= 1.
      trace_block_size: Mooncake format only: tokens per `hash_ids` entry in the file (512 in
        Mooncake's own traces; 16 or 64 in other public traces of that format); re-blocked
        exactly to `block_size`.
      warm_prefix_pct: sessions only: the fraction of each session's tool + system prefix
        shared across all sessions (`eval.traces.sessions`).
      skip_malformed: drop and count malformed rows instead of raising.
      rate: Poisson arrival rate (req/s) for L-Eval, required there; ignored by the others,
        which carry their own timestamps.
      seed: seed of L-Eval's order and arrivals; ignored by the others.

    Returns:
      A `Trace`, or a `SessionWorkload` for agent sessions (replayed closed-loop).

    Raises:
      ValueError: unknown format (`UnknownTraceFormat` where `fmt="auto"` cannot tell it), or
        an L-Eval load without `rate`; and what the loader raises
        (`TraceFormatError`, a ValueError, for a malformed trace or a path that is not a regular
        file, or for sessions a regular file or a folder of them).
      OSError: the trace cannot be read.
    """
    spec = str(spec)
    head, sep, rest = spec.partition(":")
    if sep and head in TRACE_FORMATS:
        if fmt not in ("auto", head):
            raise ValueError(f"fmt={fmt!r} contradicts the spec prefix {head!r}")
        fmt, spec = head, rest
    path = pathlib.Path(spec)
    if fmt == "auto":
        if path.is_dir():
            fmt = "sessions"
        elif path.suffix.lower() == ".jsonl":
            fmt = "mooncake"
        elif path.suffix.lower() == ".csv":
            with _open_regular(path) as f:  # only to pick the loader, which checks the encoding
                head = f.readline(MAX_LINE_BYTES + 1).decode("utf-8-sig", errors="replace")
            header = head.splitlines()[0] if head else ""
            fmt = "azure" if "TIMESTAMP" in header else "leval" if "doc_id" in header else ""
        if fmt == "auto" or not fmt:
            raise UnknownTraceFormat(
                f"cannot tell the format of {spec!r} from its name or header: give it "
                "(--trace_format, or a 'mooncake:'/'azure:'/'leval:'/'sessions:' prefix) as one "
                f"of {TRACE_FORMATS}")
    if fmt == "sessions":
        return load_sessions(path, block_size=block_size, warm_prefix_pct=warm_prefix_pct,
                             skip_malformed=skip_malformed)
    if fmt == "mooncake":
        return load_mooncake(path, block_size=block_size, skip_malformed=skip_malformed,
                             source_block_size=trace_block_size)
    if fmt == "azure":
        return load_azure(path, skip_malformed=skip_malformed, block_size=block_size)
    if fmt == "leval":
        if rate is None:
            raise ValueError("rate (requests/s) is required for an L-Eval trace, got None")
        return load_leval(path, rate, seed, block_size=block_size, skip_malformed=skip_malformed)
    raise ValueError(f"fmt must be 'auto' or one of {TRACE_FORMATS}, got {fmt!r}")


def sample_window(requests: Sequence[Request], duration_s: float, seed: int) -> list[Request]:
    """A seeded random time window of a trace, re-based to start at 0.

    The window is `[s, s + duration_s)` with `s ~ Uniform(t_first, max(t_first, t_last -
    duration_s))` drawn by `numpy.random.default_rng(seed)`; the requests inside it are taken by
    slicing a `grain.MapDataset` and get `arrival_time - s` (>= 0 seconds). Order and ids kept.

    Args:
      requests: sorted by arrival_time (a `Trace` works too).
      duration_s: window length in seconds, finite and > 0.
      seed: seed of the window start.

    Raises:
      ValueError: duration_s not finite and > 0, no requests, or requests not sorted by arrival.
    """
    reqs = list(requests)
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a finite number > 0 seconds, got {duration_s!r}")
    if not reqs:
        raise ValueError("requests must be non-empty")
    t = np.array([r.arrival_time for r in reqs], dtype=np.float64)
    if np.any(np.diff(t) < 0):
        raise ValueError("requests must be sorted by arrival_time")
    hi = max(t[0], t[-1] - duration_s)
    start = float(np.random.default_rng(seed).uniform(t[0], hi)) if hi > t[0] else float(t[0])
    i0, i1 = np.searchsorted(t, [start, start + duration_s], side="left").tolist()
    ds = grain.MapDataset.source(reqs).slice(slice(i0, i1)).map(
        lambda r: dataclasses.replace(r, arrival_time=r.arrival_time - start))
    return [ds[i] for i in range(len(ds))]
