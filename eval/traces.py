"""Trace loaders: Mooncake JSONL, Azure LLM-inference CSV and L-Eval CSV -> `Trace` of `Request`s.

Every loader reads the file's lines into a `grain.MapDataset` (`MapDataset.source(rows)
.map_with_index(parse)`), validates each row and returns a `Trace` whose requests are sorted by
arrival time (a stable sort: ties keep file order). Request ids are stable strings
`"<trace name>:<row>"`, `row` being the 0-based data row of the file (the JSONL line number
minus 1; the CSV line number minus 2 for the header), so they survive sorting and windowing.

A malformed row raises `TraceFormatError` naming the file, the 1-based line number and the
field. With `skip_malformed=True` such rows are dropped instead and counted in `Trace.skipped`
(their line numbers in `Trace.skipped_lines`); nothing is dropped silently.

Prefix structure is carried as block-hash chains (`serving.request.chain_block_hashes`). Where a
trace has no per-block ids, a prompt is modelled as a concatenation of content *segments*
`(segment_id, length)` and `segment_block_ids` gives each block a content id from the segment
pieces it covers; equal content ids at equal block positions mean equal tokens.

Formats: see `../shared/traces/README.md` and the public sources (kvcache-ai/Mooncake
`FAST25-release/traces/`, Azure/AzurePublicDataset `AzureLLMInferenceTrace_*.csv`, OpenLMLab/LEval).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import pathlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np

from eval.content import reblock_hash_ids, segment_block_ids, segment_id
from serving.request import Request, chain_block_hashes, num_blocks

MOONCAKE_BLOCK_SIZE = 512  # tokens per `hash_ids` entry in the Mooncake traces
# Segment-kind tags, mixed into segment ids so ids of different loaders never collide.
_TAG_AZURE = 0x415A5552
_TAG_LEVAL_DOC, _TAG_LEVAL_INSTR = 0x4C444F43, 0x4C494E53


class TraceFormatError(ValueError):
    """A trace row (or the file) does not follow its format.

    Attributes:
      path: the trace file.
      line: 1-based line number of the offending row, or None for the file as a whole.
      field: the offending field (a column or JSON key; "json" for an unparsable JSONL line,
        "columns" for a CSV row with extra columns), or None.
    """

    def __init__(self, path: str | pathlib.Path, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field = str(path), line, field
        where = f"{path}, line {line}" if line is not None else f"{path}"
        what = f", field {field!r}" if field is not None else ""
        super().__init__(f"{where}{what}: {message}")


@dataclasses.dataclass(frozen=True)
class Trace:
    """A loaded trace.

    Attributes:
      name: short label, also the prefix of every request id (e.g. "mooncake-conv").
      requests: the requests sorted by `arrival_time` (seconds), ties in file order.
      source_path: the file it came from.
      skipped: malformed rows dropped under `skip_malformed=True` (0 otherwise).
      skipped_lines: their 1-based line numbers, ascending.
    """

    name: str
    requests: list[Request]
    source_path: str | None = None
    skipped: int = 0
    skipped_lines: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)


class _RowError(Exception):
    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field, self.message = field, message


@dataclasses.dataclass(frozen=True, slots=True)
class _Bad:
    line: int
    field: str | None
    message: str


def _run_rows(path: pathlib.Path, rows: Sequence[Any], line_of: Callable[[int, Any], int],
              parse: Callable[[int, Any], Any], skip_malformed: bool) -> tuple[list[Any], list[int]]:
    """Parses `rows` through a grain MapDataset; returns (parsed rows, skipped line numbers)."""

    def guarded(i: int, row: Any) -> Any:
        try:
            return parse(i, row)
        except _RowError as e:
            return _Bad(line_of(i, row), e.field, e.message)

    ds = grain.MapDataset.source(rows).map_with_index(guarded)
    good, skipped = [], []
    for i in range(len(ds)):
        item = ds[i]
        if isinstance(item, _Bad):
            if not skip_malformed:
                raise TraceFormatError(path, item.line, item.field, item.message)
            skipped.append(item.line)
        else:
            good.append(item)
    if not good:
        raise TraceFormatError(path, None, None, f"no valid requests ({len(skipped)} rows skipped)")
    return good, skipped


def _json_int(obj: dict, field: str, lo: int) -> int:
    if field not in obj:
        raise _RowError(field, "missing")
    v = obj[field]
    if type(v) is not int or v < lo:
        raise _RowError(field, f"must be an integer >= {lo}, got {v!r}")
    return v


def _csv_int(row: dict[str, str], field: str, lo: int) -> int:
    text = row[field]
    try:
        v = int(text)
    except ValueError:
        raise _RowError(field, f"must be an integer >= {lo}, got {text!r}") from None
    if v < lo:
        raise _RowError(field, f"must be an integer >= {lo}, got {v}")
    return v


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 token, got {block_size!r}")


def _finish(name: str, path: pathlib.Path, reqs: list[Request], skipped: list[int]) -> Trace:
    reqs.sort(key=lambda r: r.arrival_time)  # stable: ties keep file order
    return Trace(name, reqs, str(path), len(skipped), tuple(skipped))


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
      A `Trace`; request ids "<name>:<line - 1>".

    Raises:
      TraceFormatError: a malformed line (file, line, field), or no valid line at all.
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

    def parse(i: int, text: str) -> Request:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise _RowError("json", f"not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise _RowError("json", f"expected a JSON object, got {type(obj).__name__}")
        if "timestamp" not in obj:
            raise _RowError("timestamp", "missing")
        ts = obj["timestamp"]
        if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
            raise _RowError("timestamp", f"must be a finite number >= 0 (ms), got {ts!r}")
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
        return Request(f"{name}:{i}", ts / 1000.0, input_len, output_len, hashes, block_size)

    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]  # only newlines end a JSONL record
    reqs, skipped = _run_rows(path, lines, lambda i, _: i + 1, parse, skip_malformed)
    return _finish(name, path, reqs, skipped)


def _read_csv(path: pathlib.Path,
              required: Sequence[str]) -> list[tuple[int, dict[str, str] | str]]:
    """CSV data rows as `(line_number, {column: text})`, or `(line, error)` for a ragged row."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(path, None, None, "empty file (no header)")
        header = [h.strip() for h in header]
        for col in required:
            if col not in header:
                raise TraceFormatError(path, 1, col, f"missing column (header has {header})")
        rows: list[tuple[int, dict[str, str] | str]] = []
        prev = reader.line_num
        for fields in reader:
            line = prev + 1  # first physical line of this record
            prev = reader.line_num
            if len(fields) < len(header):
                rows.append((line, header[len(fields)]))
            elif len(fields) > len(header):
                rows.append((line, "columns"))
            else:
                rows.append((line, dict(zip(header, fields))))
    return rows


def _ragged(row: dict[str, str] | str) -> dict[str, str]:
    if isinstance(row, str):
        raise _RowError(row, "missing" if row != "columns" else "more fields than the header")
    return row


def _parse_datetime(text: str) -> datetime.datetime:
    try:
        dt = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise _RowError("TIMESTAMP", f"must be an ISO date-time, got {text!r}") from None
    if dt.tzinfo is not None:
        dt = dt.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return dt


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
      TraceFormatError: missing column, ContextTokens < 1, GeneratedTokens < 0, bad TIMESTAMP,
        ragged row; or no valid row.
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
      TraceFormatError: a missing column, a bad or inconsistent value (file, line, field).
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
               skip_malformed: bool = False, rate: float | None = None, seed: int = 0) -> Trace:
    """Loads a trace file in any supported format (for the CLIs).

    Args:
      spec: the file path, optionally prefixed by its format: "mooncake:PATH", "azure:PATH",
        "leval:PATH".
      fmt: "auto" (the prefix, else `.jsonl` -> mooncake; `.csv` -> azure if the header has
        TIMESTAMP, leval if it has doc_id), or one of "mooncake", "azure", "leval".
      block_size: tokens per block, >= 1.
      skip_malformed: drop and count malformed rows instead of raising.
      rate: Poisson arrival rate (req/s) for L-Eval, required there; ignored by the others,
        which carry their own timestamps.
      seed: seed of L-Eval's order and arrivals; ignored by the others.

    Raises:
      ValueError: unknown format, or an L-Eval load without `rate`; and what the loader raises.
    """
    formats = ("mooncake", "azure", "leval")
    spec = str(spec)
    head, sep, rest = spec.partition(":")
    if sep and head in formats:
        if fmt not in ("auto", head):
            raise ValueError(f"fmt={fmt!r} contradicts the spec prefix {head!r}")
        fmt, spec = head, rest
    path = pathlib.Path(spec)
    if fmt == "auto":
        if path.suffix == ".jsonl":
            fmt = "mooncake"
        elif path.suffix == ".csv":
            with open(path, encoding="utf-8-sig") as f:
                header = f.readline()
            fmt = "azure" if "TIMESTAMP" in header else "leval" if "doc_id" in header else ""
        if fmt == "auto" or not fmt:
            raise ValueError(f"cannot tell the format of {spec!r} from its name or header: give it "
                             f"(--trace_format, or a 'mooncake:'/'azure:'/'leval:' prefix) as one of {formats}")
    if fmt == "mooncake":
        return load_mooncake(path, block_size=block_size, skip_malformed=skip_malformed)
    if fmt == "azure":
        return load_azure(path, skip_malformed=skip_malformed, block_size=block_size)
    if fmt == "leval":
        if rate is None:
            raise ValueError("rate (requests/s) is required for an L-Eval trace, got None")
        return load_leval(path, rate, seed, block_size=block_size, skip_malformed=skip_malformed)
    raise ValueError(f"fmt must be 'auto' or one of {formats}, got {fmt!r}")


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
