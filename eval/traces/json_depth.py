"""How deep a JSON text nests its arrays and objects, found before parsing it, in bounded memory.

`json.loads` recurses once per level, so a trace line of 100,000 `[` would exhaust the stack;
`eval.traces.parsing` refuses text nested deeper than its `MAX_JSON_DEPTH` first. The scan reads
the text `SCAN_CHARS` characters at a time, carrying the depth and whether the chunk starts inside
a string (and after a backslash), so it allocates a few MiB whatever the text's length (a line
may be 64 MiB): strings are removed per chunk by regex, brackets counted with numpy.
"""

from __future__ import annotations

import re

import numpy as np

SCAN_CHARS = 1 << 18
# A JSON string (unterminated: to the text's end, a lone final backslash left out); one token
# of the locating pass (a string or a bracket); a string's rest up to its closing quote or a
# lone final backslash. Possessive: nothing backtracks, each is linear.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_TOKEN = re.compile(r'"(?:[^"\\]++|\\.)*+"?|[\[\]{}]', re.DOTALL)
_STRING_REST = re.compile(r'(?:[^"\\]++|\\.)*+', re.DOTALL)
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def first_too_deep_line(text: str, limit: int) -> int | None:
    """The 1-based line of `text` holding the first bracket that nests its arrays and objects
    more than `limit` levels deep (brackets inside JSON strings not counted), or None.

    The depth is counted as written: a close bracket too many makes it negative (the text is
    then not JSON, which the parser says)."""
    if text.count("[") + text.count("{") <= limit:  # the common case, at C speed
        return None
    depth, in_string, skip = 0, False, 0  # skip: 1 when the chunk starts with an escaped char
    for start in range(0, len(text), SCAN_CHARS):
        end = min(start + SCAN_CHARS, len(text))
        chunk = text[start:end]
        pos = 0
        if in_string:
            close = _STRING_REST.match(chunk, skip).end()
            if close == len(chunk) or chunk[close] == "\\":  # the string goes on past the chunk
                skip = int(close < len(chunk))
                continue
            pos, in_string = close + 1, False
        rest = chunk[pos:] if pos else chunk
        if end == len(text):
            bare = _STRING.sub("", rest)
        else:  # `x"[` put after the chunk: its `[` stays outside strings only when the chunk
            # ends inside one (the `x` its content, or the character a final backslash escapes,
            # the quote its end); after a chunk ending outside, the quote opens a string
            bare = _STRING.sub("", rest + 'x"[')
            in_string, bare = bare[-1] == "[", bare[:-1]
            if in_string:  # after a backslash when an odd number of them end the chunk
                skip = (len(chunk) - len(chunk.rstrip("\\"))) % 2
        opens = bare.count("[") + bare.count("{")
        if depth + opens <= limit:  # cannot pass the limit in this chunk
            depth += opens - bare.count("]") - bare.count("}")
            continue
        a = np.frombuffer(bare.encode("utf-8", "surrogatepass"), np.uint8)
        is_open = (a == 91) | (a == 123)
        at = np.flatnonzero(is_open | (a == 93) | (a == 125))  # the brackets' offsets
        depths = np.cumsum(np.where(is_open[at], 1, -1))
        if depth + depths.max() > limit:
            return _line_of_first_too_deep(text, start + pos, end, depth, limit)
        depth += int(depths[-1])
    return None


def _line_of_first_too_deep(text: str, pos: int, end: int, depth: int, limit: int) -> int:
    """The line of the first bracket of `text[pos:end]` (`pos` outside any string, `depth` deep)
    past `limit` levels, which the scan has found there."""
    for m in _TOKEN.finditer(text, pos, end):
        depth += _STEP.get(m.group(), 0)
        if depth > limit:
            return text.count("\n", 0, m.start()) + 1
    raise AssertionError("the scan saw a bracket past the limit that this pass does not")
