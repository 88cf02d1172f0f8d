"""Agent sessions: a loader and the closed-loop driver that replays them.

Format (`../shared/traces/README.md`, "Agent session format"; callanjfox/kv-cache-tester): one
JSON object per session file: `id`, `block_size` (tokens per `hash_ids` entry, 64 in the public
set), `hash_id_scope` ("local": ids are scoped to the session and its sub-agents), `tool_tokens`
and `system_tokens` (the prefix every request of the session starts with) and `requests` in
order. A request has `t` (seconds from the session start), `type`, `in` / `out` (tokens),
`hash_ids` (one id per *full* source block; a partial last block has none) and `think_time`
(seconds the client waited after the previous response; absent = 0). An entry with
`"type": "subagent"` holds its own `t`, `requests` (and optionally `tool_tokens`,
`system_tokens`, `agent_id`): a sub-agent started then, running concurrently with its parent.

Replay is closed-loop (`eval.traces.closed_loop`), as the source's own
`trace_replay_tester.py` does ("think-only"): a session's request k+1 is sent `think_time`
after request k's response ended. Sub-agents run as sessions of their own: the sub-agents
listed after request k start when k's response ends, and the parent's next request waits
until they have all finished (the source's replayer: "the parent pauses until all sub-agents
complete, then resumes"). Load is raised by starting more sessions, never by compressing a
session's own time.

Block ids: each source block becomes a content segment (`eval.traces.content`) scoped to the
session (sessions share no ids), the partial tail a segment of its own, re-blocked exactly to
the replay's `block_size` and chained (two requests share k blocks only when they share the
whole k-block prefix). With `warm_prefix_pct > 0`, as the source's `--warm-prefix-pct`
(default 0.5 there and here), the first `warm_prefix_pct x (tool_tokens + system_tokens)`
tokens of every session are one canonical prefix shared by all sessions (Claude Code's tool
definitions and system prompt stay cached across conversations in production); only the
leading run of blocks equal to the session's first request's is mapped.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import stat
from collections.abc import Sequence

import numpy as np

from eval.traces.content import segment_block_ids, segment_id
from eval.traces.parsing import (MAX_TOKENS, TraceFormatError, _check_block_size, _json_too_deep,
                                _kind, _read_document, _show, _too_deep)
from serving.policy.request import Request, chain_block_hashes

_TAG_SESSION, _TAG_TAIL, _TAG_PREFIX = 0x53455353, 0x5441494C, 0x50524546
_SHARED = 1 << 63  # marks a block id shared across sessions (trace ids are below it)
_MUST = "agent sessions must be a regular file or a folder of regular files"


@dataclasses.dataclass(frozen=True)
class SubAgentStart:
    """A sub-agent that starts when its parent's step `after_step` has its response (-1: when
    the parent session starts); the parent's next step waits until it has finished."""

    after_step: int
    session: int  # index into `SessionWorkload.sessions`


@dataclasses.dataclass(frozen=True)
class Session:
    """One session (or sub-agent) of a `SessionWorkload`.

    Attributes:
      session_id: the file's `id` (sub-agents: `<parent id>/<agent id>`).
      steps: indices into `SessionWorkload.requests`, in sending order.
      think_times: per step, seconds after the previous response ended (the first step's:
        after the session started).
      subagents: sub-agents this session starts.
    """

    session_id: str
    steps: tuple[int, ...]
    think_times: tuple[float, ...]
    subagents: tuple[SubAgentStart, ...] = ()


@dataclasses.dataclass(frozen=True)
class SessionWorkload:
    """Agent sessions ready to replay.

    Attributes:
      name: label of the workload (the folder's name).
      requests: every request as a template (`arrival_time` 0; the replay sets it), ids
        `<session id>:<k>`.
      sessions: every session, sub-agents included.
      roots: indices of the top-level sessions (those started by the replay's arrival process).
      shared_blocks: per request, how many leading blocks hold the prefix shared across
        sessions (0 with `warm_prefix_pct=0`); a replay that runs a session more than once
        re-scopes only the blocks after them (`eval.traces.closed_loop`).
      source_path: the folder or file loaded.
      skipped: session files dropped as malformed under `skip_malformed=True`.
    """

    name: str
    requests: tuple[Request, ...]
    sessions: tuple[Session, ...]
    roots: tuple[int, ...]
    shared_blocks: tuple[int, ...] = ()
    source_path: str | None = None
    skipped: int = 0

    def with_requests(self, requests: Sequence[Request]) -> SessionWorkload:
        """The same sessions over transformed templates (same order and ids; e.g. with SLOs or
        interned block hashes).

        Raises:
          ValueError: a different number of requests, or different ids.
        """
        requests = tuple(requests)
        if [r.request_id for r in requests] != [r.request_id for r in self.requests]:
            raise ValueError("requests must keep the templates' order and ids")
        return dataclasses.replace(self, requests=requests)

    def requests_per_session(self) -> float:
        """Mean requests per top-level session, its sub-agents' requests included."""
        return len(self.requests) / len(self.roots)


def _int(obj: dict, key: str, lo: int, where: str, default: int | None = None) -> int:
    if key not in obj and default is not None:
        return default
    v = obj.get(key)
    if type(v) is not int or not lo <= v <= MAX_TOKENS:
        raise ValueError(f"{where}.{key} must be an integer in [{lo}, {MAX_TOKENS}], got {_show(v)}")
    return v


def _seconds(obj: dict, key: str, where: str, default: float | None = None) -> float:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{where}.{key} must be a finite number >= 0 seconds, got {_show(v)}")
    return float(v)


class _Blocks:
    """Hash chains of one session's requests at the replay's block size, reusing the previous
    request's chain over the leading source blocks both share (cost ~ the new blocks only)."""

    def __init__(self, scope: int, source_bs: int, block_size: int) -> None:
        self.scope, self.source_bs, self.block_size = scope, source_bs, block_size
        self.align = math.lcm(source_bs, block_size)  # token offsets where both grids meet
        self.prev_ids = np.zeros(0, dtype=np.uint64)
        self.prev_chain: tuple[int, ...] = ()
        self.prev_full = 0
        self.seg: dict[int, int] = {}

    def chain(self, arr: np.ndarray, input_len: int, tail_key: int) -> tuple[int, ...]:
        """The hash chain of a request of `input_len` tokens whose full source blocks have the
        ids `arr` (uint64); `tail_key` names its partial last source block, if any."""
        sbs, bs = self.source_bs, self.block_size
        m = min(len(arr), len(self.prev_ids))
        diff = np.flatnonzero(arr[:m] != self.prev_ids[:m])
        common = int(diff[0]) if len(diff) else m  # leading source blocks equal to the previous
        q = min(common * sbs // bs, self.prev_full)  # reusable full blocks at the new size
        q = (q * bs // self.align) * self.align // bs  # restart where both grids meet
        k0 = q * bs // sbs
        seg = self.seg
        segs = []
        for x in arr[k0:].tolist():
            s = seg.get(x)
            if s is None:  # a shared id is already global and well mixed; a trace id is scoped
                s = seg[x] = x if x & _SHARED else segment_id(_TAG_SESSION, self.scope, x)
            segs.append((s, sbs))
        tail = input_len - len(arr) * sbs
        if tail:
            segs.append((segment_id(_TAG_TAIL, self.scope, tail_key), tail))
        head = self.prev_chain[:q]
        chain = head + chain_block_hashes(segment_block_ids(segs, bs), head[-1] if head else 0)
        self.prev_ids, self.prev_chain, self.prev_full = arr, chain, input_len // bs
        return chain


@functools.lru_cache(maxsize=None)
def _prefix_ids(n: int) -> np.ndarray:
    """The canonical shared prefix's first `n` block ids (top bit set: never a trace id)."""
    return np.asarray([_SHARED | (segment_id(_TAG_PREFIX, j) & (_SHARED - 1)) for j in range(n)],
                      dtype=np.uint64)


def _shared_prefix(ids: np.ndarray, ref: np.ndarray, n: int) -> np.ndarray:
    """`ids` with its first `n` blocks (at most the run equal to `ref`'s) replaced by the
    canonical shared prefix."""
    n = min(n, len(ids), len(ref))
    diff = np.flatnonzero(ids[:n] != ref[:n])
    n = int(diff[0]) if len(diff) else n
    out = ids.copy()
    out[:n] = _prefix_ids(n)
    return out


@dataclasses.dataclass
class _Loader:
    """What one load accumulates: templates, sessions, shared block counts."""

    block_size: int
    warm_prefix_pct: float
    requests: list[Request] = dataclasses.field(default_factory=list)
    sessions: list[Session | None] = dataclasses.field(default_factory=list)
    shared: list[int] = dataclasses.field(default_factory=list)

    def session(self, obj: object, where: str) -> int:
        """Appends one session file's session (and its sub-agents); returns its index."""
        if not isinstance(obj, dict):
            raise ValueError(f"{where} must be a JSON object, got {_show(obj)}")
        sid = obj.get("id")
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"{where}.id must be a non-empty string, got {_show(sid)}")
        source_bs = _int(obj, "block_size", 1, where)
        scope = int.from_bytes(hashlib.blake2b(sid.encode(), digest_size=8).digest(), "little")
        return self.steps(obj, where, sid, source_bs, scope)

    def steps(self, obj: dict, where: str, sid: str, source_bs: int, scope: int) -> int:
        entries = obj.get("requests")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{where}.requests must be a non-empty list")
        tool, system = _int(obj, "tool_tokens", 0, where, 0), _int(obj, "system_tokens", 0, where, 0)
        warm = int(self.warm_prefix_pct * (tool + system)) // source_bs  # shared source blocks
        blocks = _Blocks(scope, source_bs, self.block_size)
        index = len(self.sessions)
        self.sessions.append(None)  # placeholder: sub-agents are appended after it
        steps, thinks, subs, ref = [], [], [], None
        sub_end = None  # the latest end (its `t`) of the sub-agents since the last request
        for k, e in enumerate(entries):
            w = f"{where}.requests[{k}]"
            if not isinstance(e, dict):
                raise ValueError(f"{w} must be a JSON object, got {_show(e)}")
            t = _seconds(e, "t", w)
            if e.get("type") == "subagent":
                sub_end = t if sub_end is None else max(sub_end, t)
                agent = e.get("agent_id") or f"sub{len(subs)}"
                child = {"tool_tokens": tool, "system_tokens": system, **e}
                subs.append(SubAgentStart(len(steps) - 1, self.steps(
                    child, w, f"{sid}/{agent}", source_bs, scope)))  # ids scoped with the parent
                continue
            n_in, n_out = _int(e, "in", 1, w), _int(e, "out", 0, w, 0)
            ids = e.get("hash_ids")
            try:
                arr = np.asarray(ids if isinstance(ids, list) else None)
            except (ValueError, TypeError, OverflowError):  # ragged or absurd lists
                arr = np.asarray(None)
            if arr.ndim != 1 or (len(arr) and (arr.dtype.kind not in "iu" or arr.min() < 0
                                                or arr.max() >= _SHARED)):
                raise ValueError(f"{w}.hash_ids must be a list of integers in [0, 2^63)")
            arr = arr.astype(np.uint64)
            if len(arr) != n_in // source_bs:
                raise ValueError(f"{w}.hash_ids must have floor(in / {source_bs}) = "
                                 f"{n_in // source_bs} entries (full blocks only), got {len(arr)}")
            if warm:
                ref = arr if ref is None else ref
                arr = _shared_prefix(arr, ref, warm)
            chain = blocks.chain(arr, n_in, len(self.requests))
            own = np.flatnonzero(arr < _SHARED)  # the first block of the session's own
            self.shared.append((int(own[0]) if len(own) else len(arr)) * source_bs
                               // self.block_size)
            think = _seconds(e, "think_time", w, 0.0)
            if sub_end is not None:  # the parent waited for its sub-agents: the recorded gap
                think = max(0.0, t - sub_end)  # since the last of them ended (their `t`)
                sub_end = None
            thinks.append(think if steps else 0.0)  # the first request is sent at the start
            steps.append(len(self.requests))
            self.requests.append(Request(f"{sid}:{len(steps) - 1}", 0.0, n_in, n_out, chain,
                                         self.block_size))
        if not steps:
            raise ValueError(f"{where}.requests has no request (only sub-agents)")
        self.sessions[index] = Session(sid, tuple(steps), tuple(thinks), tuple(subs))
        return index


def load_sessions(path: str | pathlib.Path, block_size: int = 512, warm_prefix_pct: float = 0.5,
                  skip_malformed: bool = False, subset: slice = slice(None)) -> SessionWorkload:
    """Loads agent sessions from a folder of session files (`*.json`, sorted by name) or one file.

    Args:
      path: the folder (or one session file).
      block_size: tokens per block of the returned requests, >= 1 (the files' own block size is
        re-blocked exactly).
      warm_prefix_pct: share this fraction of each session's tool + system prefix across all
        sessions, in [0, 1] (module doc; 0 = sessions share nothing).
      skip_malformed: drop and count malformed session files instead of raising.
      subset: which of the session files, sorted by name, to load (e.g. `slice(0, None,
        2)`: the first, third, ...: a held-out half; `eval.robustness`); a single file is
        the list of one.

    Every `*.json` entry of the folder must be a regular file of at most
    `eval.traces.parsing.MAX_LINE_BYTES` bytes nesting JSON at most `MAX_JSON_DEPTH` levels
    deep; one that is not is a malformed session file (skipped and counted under
    `skip_malformed`).

    Raises:
      TraceFormatError: a malformed session file (naming the file and the field; the line too
        for JSON nested too deeply), a folder without session files, or a path that is neither
        a regular file nor a folder (a FIFO, a device).
      ValueError: block_size < 1, warm_prefix_pct outside [0, 1], or a subset that is not a
        slice or selects no file.
    """
    _check_block_size(block_size)
    if not (isinstance(warm_prefix_pct, (int, float)) and 0.0 <= warm_prefix_pct <= 1.0):
        raise ValueError(f"warm_prefix_pct must be in [0, 1], got {warm_prefix_pct!r}")
    path = pathlib.Path(path)
    if not path.exists():
        raise TraceFormatError(path, None, None, "no such file or folder")
    mode = os.stat(path).st_mode
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise TraceFormatError(path, None, None, f"is {_kind(mode)}: {_MUST}")
    if not isinstance(subset, slice):
        raise ValueError(f"subset must be a slice of the session files, got {subset!r}")
    every = (sorted(f for f in path.iterdir() if f.suffix.lower() == ".json")
             if stat.S_ISDIR(mode) else [path])
    if not every:
        raise TraceFormatError(path, None, None, "no session files (*.json) in this folder")
    files = every[subset]
    if not files:
        raise ValueError(f"subset {subset} selects none of the {len(every)} session files of "
                         f"{path}")
    owner: dict[str, pathlib.Path] = {}  # request id -> its file
    load = _Loader(block_size, float(warm_prefix_pct))
    roots, skipped = [], 0
    for f in files:
        n_req, n_ses = len(load.requests), len(load.sessions)
        try:
            text = _read_document(f, _MUST)  # a regular file of at most MAX_LINE_BYTES
            line = _json_too_deep(text)
            if line is not None:
                raise TraceFormatError(f, line, "json", _too_deep())
            root = load.session(json.loads(text), "session")
            ids = [r.request_id for r in load.requests[n_req:]]
            clash = next((i for i in ids if i in owner), None)
            if clash is not None or len(set(ids)) != len(ids):
                what = (f"{clash} is also in {owner[clash].name}" if clash is not None
                        else "a sub-agent id repeats in this file")
                raise ValueError(f"session and sub-agent ids must be unique: {what}")
            owner.update(dict.fromkeys(ids, f))
            roots.append(root)
        except (ValueError, UnicodeDecodeError, RecursionError, OSError) as e:
            del load.requests[n_req:], load.sessions[n_ses:], load.shared[n_req:]
            if not skip_malformed:
                if isinstance(e, TraceFormatError):
                    raise
                raise TraceFormatError(f, None, None, str(e)) from None
            skipped += 1
    if not roots:
        raise TraceFormatError(path, None, None, f"all {skipped} session files are malformed")
    name = path.name if path.is_dir() else path.stem
    return SessionWorkload(name, tuple(load.requests), tuple(load.sessions), tuple(roots),
                           tuple(load.shared), str(path), skipped)
