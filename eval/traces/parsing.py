"""Reading trace files: lines and CSV rows, row errors, the `Trace` result.

Shared by the loaders in `eval.traces.loaders`. Files are read as bytes and decoded per line (UTF-8, a
leading byte-order mark accepted), so an undecodable line is a row error naming its line.

Limits, so that no input can hang a load or exhaust its memory or stack:
- a trace must be a regular file (`_open_regular`; a FIFO, a device such as /dev/zero, a socket
  or a folder is refused before anything is read);
- a line is read at most `MAX_LINE_BYTES` + 1 bytes at a time; a longer line is a row error
  ("line longer than MAX_LINE_BYTES bytes") that, under `skip_malformed`, is skipped and counted
  like any other malformed line: it is read past without being held in memory. A session file
  (one JSON document) may be at most `MAX_LINE_BYTES` long;
- JSON (a JSONL line, a session file) may nest arrays and objects at most `MAX_JSON_DEPTH`
  levels deep; deeper is a row error (field "json"), checked before parsing, so Python's
  recursion limit is never reached (the check reads a line in chunks: its memory is a few MiB,
  however long the line; `eval.traces.json_depth`).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import os
import pathlib
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

import grain

from eval.traces.json_depth import first_too_deep_line
from serving.policy.request import Request

MAX_TOKENS = 2**31 - 1     # largest token count a trace row may give
# Longest line (bytes, line end excluded) of a trace file, and largest session file: the public
# traces' longest line is 2.7 KB (Mooncake), their largest session file 2 MB.
MAX_LINE_BYTES = 64 << 20
# Deepest nesting of JSON arrays and objects in a trace line or session file: the public traces
# nest at most 6 levels (a session's sub-agent's request's hash_ids).
MAX_JSON_DEPTH = 100


class TraceFormatError(ValueError):
    """A trace row (or the file) does not follow its format.

    Attributes:
      path: the trace file.
      line: 1-based line number of the offending row, or None for the file as a whole.
      field: the offending field (a column or JSON key; "json" for an unparsable JSONL line,
        "columns" for a CSV row with extra columns, "encoding" for a line that is not valid
        UTF-8), or None.
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


def _show(value: Any, limit: int = 40) -> str:
    """`repr(value)` cut to `limit` characters, for error messages about absurd inputs."""
    if type(value) is int and value.bit_length() > 128:  # str() may exceed the digit limit
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: pathlib.Path, must: str = "a trace must be a regular file") -> BinaryIO:
    """`path` opened for binary reading, refused (`TraceFormatError` naming it and `must`) unless
    it is a regular file (a link to one is fine). Opened non-blocking, then checked, so a FIFO
    cannot hang the open."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise TraceFormatError(path, None, None, f"is {_kind(mode)}: {must}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _physical_lines(f: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The lines of `f` as `bytes.splitlines(keepends=True)` of the whole file would give them
    (ends `\n`, `\r\n`, `\r`), reading at most `limit` + 1 bytes at a time; a line of more than
    `limit` bytes (its end excluded) is yielded as None, its bytes read past and dropped."""
    part, over = b"", False  # the current line's unterminated start; it is already too long
    while chunk := f.readline(limit + 1):
        pieces = chunk.splitlines(keepends=True)
        for k, piece in enumerate(pieces):
            if k == len(pieces) - 1 and piece.endswith(b"\r") and f.peek(1)[:1] == b"\n":
                piece += f.read(1)  # a "\r\n" split across two reads
            ended = piece.endswith((b"\n", b"\r"))
            if not over and len(part) + len(piece.rstrip(b"\r\n")) > limit:
                part, over = b"", True
            if over:
                if ended:
                    over = False
                    yield None
            elif ended:
                yield part + piece
                part = b""
            else:
                part += piece
    if over:
        yield None
    elif part:
        yield part


def _read_lines(path: pathlib.Path) -> list[str | _RowError]:
    """The file's physical lines, line ends kept, each decoded as UTF-8 on its own.

    A byte-order mark at the start of the file is dropped (`utf-8-sig`). Lines end at `\n`,
    `\r\n` or `\r` (`bytes.splitlines`: as Python's universal newlines). A line that is not valid
    UTF-8 is returned as a `_RowError` (field "encoding") instead of its text; so is a line
    longer than `MAX_LINE_BYTES` (field None), which is never held in memory whole.

    Raises:
      TraceFormatError: `path` is not a regular file.
      OSError: it cannot be read.
    """
    limit = MAX_LINE_BYTES
    out: list[str | _RowError] = []
    with _open_regular(path) as f:
        for n, raw in enumerate(_physical_lines(f, limit)):
            if raw is None:
                out.append(_RowError(None, f"line longer than {limit} bytes "
                                           f"(eval.traces.parsing.MAX_LINE_BYTES)"))
                continue
            try:
                out.append(raw.decode("utf-8-sig" if n == 0 else "utf-8"))
            except UnicodeDecodeError as e:
                out.append(_RowError("encoding", f"not valid UTF-8 ({e.reason} at byte {e.start} "
                                                 f"of the line)"))
    return out


def _read_document(path: pathlib.Path, must: str) -> str:
    """A whole file of at most `MAX_LINE_BYTES` as UTF-8 text (a leading byte-order mark dropped).

    Raises:
      TraceFormatError: not a regular file (the message ends in `must`), or a longer file.
      UnicodeDecodeError: not UTF-8. OSError: unreadable.
    """
    limit = MAX_LINE_BYTES
    with _open_regular(path, must) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TraceFormatError(path, None, None, f"file longer than {limit} bytes "
                                                 f"(eval.traces.parsing.MAX_LINE_BYTES)")
    return data.decode("utf-8-sig")


def _json_too_deep(text: str) -> int | None:
    """The 1-based line of `text` where its JSON arrays and objects first nest deeper than
    `MAX_JSON_DEPTH` (brackets inside strings not counted), or None; the scan's memory is
    bounded whatever the length of `text` (`eval.traces.json_depth`)."""
    return first_too_deep_line(text, MAX_JSON_DEPTH)


def _too_deep() -> str:
    return (f"arrays and objects nested more than {MAX_JSON_DEPTH} levels deep "
            f"(eval.traces.parsing.MAX_JSON_DEPTH)")


def _json_row(text: str) -> Any:
    """`json.loads(text)` for one trace row; a row that is not JSON, or nests deeper than
    `MAX_JSON_DEPTH`, raises `_RowError` (field "json")."""
    if _json_too_deep(text) is not None:
        raise _RowError("json", _too_deep())
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _RowError("json", f"not valid JSON ({e.msg})") from None
    except ValueError as e:  # an integer literal past the int-string conversion limit
        raise _RowError("json", f"not valid JSON ({_show(str(e), 80)})") from None
    except RecursionError:  # not reached below MAX_JSON_DEPTH; kept as a guard
        raise _RowError("json", "nested too deeply for the JSON parser") from None


def _blank(text: str) -> bool:
    return not text.strip()


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
        except RecursionError:  # a guard: the readers bound nesting (MAX_JSON_DEPTH)
            return _Bad(line_of(i, row), None, "nested too deeply to parse (RecursionError)")

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
    if type(v) is not int or not lo <= v <= MAX_TOKENS:
        raise _RowError(field, f"must be an integer in [{lo}, 2^31 - 1], got {_show(v)}")
    return v


def _csv_int(row: dict[str, str], field: str, lo: int) -> int:
    text = row[field]
    try:
        v = int(text)
    except ValueError:  # also a string of more than sys.get_int_max_str_digits() digits
        v = None
    if v is None or not lo <= v <= MAX_TOKENS:
        shown = _show(text.strip()) if v is None else _show(v)
        raise _RowError(field, f"must be an integer in [{lo}, 2^31 - 1], got {shown}")
    return v


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 token, got {block_size!r}")


def _finish(name: str, path: pathlib.Path, reqs: list[Request], skipped: list[int]) -> Trace:
    reqs.sort(key=lambda r: r.arrival_time)  # stable: ties keep file order
    return Trace(name, reqs, str(path), len(skipped), tuple(skipped))


def _read_csv(path: pathlib.Path,
              required: Sequence[str]) -> list[tuple[int, dict[str, str] | _RowError]]:
    """CSV data rows as `(line_number, {column: text})`, or `(line, error)` for a bad row.

    The line number is the record's first physical line (1-based). Blank and whitespace-only
    records (before the header too) are skipped; a ragged record or one with a line that is not
    UTF-8 or is longer than `MAX_LINE_BYTES` (then the number of that line) becomes an error row.
    Raises `TraceFormatError` for a path that is not a regular file, an empty file, a header that
    is not UTF-8 or too long, lacks a `required` column or repeats a column name.
    """
    lines = _read_lines(path)
    bad: list[tuple[int, _RowError]] = []  # undecodable lines the reader has consumed

    def texts() -> Iterator[str]:
        for n, text in enumerate(lines, start=1):
            if isinstance(text, _RowError):
                bad.append((n, text))
                yield "\n"  # the record that held it becomes an error row below
            else:
                yield text

    reader = csv.reader(texts())
    seen_bad, prev = 0, 0
    header: list[str] | None = None
    rows: list[tuple[int, dict[str, str] | _RowError]] = []
    while True:
        line = prev + 1  # first physical line of the next record
        try:
            fields = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # e.g. a field past csv.field_size_limit(): the file is unusable
            raise TraceFormatError(path, line, None, f"not valid CSV ({e})") from None
        prev = reader.line_num
        if len(bad) > seen_bad:
            seen_bad = len(bad)
            if header is None:
                raise TraceFormatError(path, bad[-1][0], bad[-1][1].field, bad[-1][1].message)
            rows.append((bad[-1][0], bad[-1][1]))
        elif not fields or (len(fields) == 1 and _blank(fields[0])):
            continue  # a blank line is not data
        elif header is None:
            header = [h.strip() for h in fields]
            dups = sorted({h for h in header if header.count(h) > 1})
            if dups:
                raise TraceFormatError(path, line, dups[0], f"duplicated column name (header "
                                                            f"has {header})")
            for col in required:
                if col not in header:
                    raise TraceFormatError(path, line, col, f"missing column (header has {header})")
        elif len(fields) < len(header):
            rows.append((line, _RowError(header[len(fields)], "missing")))
        elif len(fields) > len(header):
            rows.append((line, _RowError("columns", "more fields than the header")))
        else:
            rows.append((line, dict(zip(header, fields))))
    if header is None:
        raise TraceFormatError(path, None, None, "empty file (no header)")
    return rows


def _ragged(row: dict[str, str] | _RowError) -> dict[str, str]:
    if isinstance(row, _RowError):
        raise row
    return row


def _parse_datetime(text: str) -> datetime.datetime:
    try:
        dt = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise _RowError("TIMESTAMP", f"must be an ISO date-time, got {text!r}") from None
    if dt.tzinfo is not None:
        dt = dt.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return dt
