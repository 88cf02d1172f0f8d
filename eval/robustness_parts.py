"""The parts of `eval.robustness`: workloads the comparison never ran whole.

`part_loaders` builds the built-in parts (halves of the public traces, alternate agent session
files, other draws of the generated workloads, the synthetic stand-ins), `extra_part_loaders`
those of the user's own traces (`--extra_parts`), and `select` picks parts by name
(`--parts`). Every loader is lazy: nothing is read until its part is run.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable, Sequence

from eval.paper_setup import LOADS, QUICK_REQUESTS, TRACE_FILES
from eval.traces.loaders import TRACE_FORMATS, UnknownTraceFormat, load_trace
from eval.traces.sessions import load_sessions
from eval.traces.synthetic import SYNTHETIC, synthetic_workload
from eval.traces.workloads import native_rate, tool_agent_workload
from serving.policy.request import Request

DRAW_SEED = 1  # the drawn parts' seed (the comparison's own draws use 0)


def halves(requests: Sequence[Request]) -> tuple[list[Request], list[Request]]:
    """The first and second half of a trace by arrival (the middle request goes to the second),
    each re-timed so that its first request arrives at 0 s.

    Raises:
      ValueError: fewer than 4 requests (each half needs two to have a rate).
    """
    if len(requests) < 4:
        raise ValueError(f"a trace needs at least 4 requests to halve, got {len(requests)}")
    reqs = sorted(requests, key=lambda r: r.arrival_time)
    out = []
    for part in (reqs[:len(reqs) // 2], reqs[len(reqs) // 2:]):
        t0 = part[0].arrival_time
        out.append([dataclasses.replace(r, arrival_time=r.arrival_time - t0) for r in part])
    return out[0], out[1]


def part_loaders(traces_dir: str, quick: bool, draw_seed: int = DRAW_SEED
                 ) -> dict[str, tuple[str, Callable[[], object]]]:
    """Part name -> (the workload it is a part of, a function that builds its requests or
    sessions). Nothing is read until a function is called; each trace is read and halved
    once. `draw_seed`: the seed of Tool-Agent, of the L-Eval CSV's order and of the stand-ins
    (in their names)."""
    d = pathlib.Path(traces_dir)
    n = QUICK_REQUESTS if quick else None

    @functools.cache
    def halved(wname: str) -> tuple[list[Request], list[Request]]:
        return halves(load_trace(d / TRACE_FILES[wname]).requests[:n])

    out: dict[str, tuple[str, Callable[[], object]]] = {}
    for wname, trace in (("production", "Mooncake conversation"),
                         ("leval", "Mooncake synthetic"), ("code", "Azure code")):
        for i, label in enumerate(("first half", "second half")):
            out[f"{wname} ({trace}), {label}"] = (wname, lambda w=wname, i=i: halved(w)[i])
    for label, sl in (("1st, 3rd, ...", slice(0, None, 2)), ("2nd, 4th, ...", slice(1, None, 2))):
        out[f"agents, session files {label}"] = ("agents", lambda sl=sl: load_sessions(
            d / TRACE_FILES["agents"], subset=sl))
    out[f"toolagent, generated with seed {draw_seed}"] = ("toolagent", lambda: (
        tool_agent_workload(duration_s=600.0 if quick else 3600.0, seed=draw_seed)[:n]))
    out[f"leval-csv (L-Eval CSV), drawn with seed {draw_seed}"] = ("leval-csv", lambda: (
        load_trace(d / TRACE_FILES["leval-csv"], rate=1.0, seed=draw_seed).requests[:n]))
    for name, config in SYNTHETIC.items():  # (a cached system prompt: its own load factors)
        out[f"stand-in: {name}"] = ("synthetic-prefix" if config.shared_prefix_len else
                                    "synthetic",
                                    lambda c=config: synthetic_workload(c, draw_seed)[:n])
    return out


def extra_part_loaders(specs: Sequence[str], quick: bool = False, draw_seed: int = DRAW_SEED
                       ) -> dict[str, tuple[str, Callable[[], object]]]:
    """Parts of the user's own traces, like `part_loaders`'s: each spec `KIND:PATH` becomes
    the part `"extra KIND: PATH"`, swept at `LOADS[KIND]`. `PATH` is a trace file or a folder
    of agent sessions, its format inferred by `eval.traces.loaders.load_trace` (a folder is
    sessions, `.jsonl` Mooncake with 512-token `hash_ids`, `.csv` Azure or L-Eval) or named by
    a prefix `FORMAT:` ("mooncake", "azure", "leval", "sessions"); `~` is expanded. Sessions
    (KIND "agents") replay closed-loop, a request trace at `LOADS[KIND]` times its own cold
    capacity rate (an L-Eval CSV, which has no timestamps, ordered with `draw_seed`). With
    `quick`, the first `QUICK_REQUESTS` requests of a request trace. Nothing is read until a
    function is called, and then once (`eval.robustness.run` reads the extra parts it runs
    before any output, so a bad trace of one's own fails first).

    Raises:
      ValueError, naming `--extra_parts` and the spec: a spec without `KIND:` or an empty
        `PATH`, a `KIND` not a key of `LOADS`, a `PATH` that does not exist, "agents" with a
        path neither a folder nor a `.json` file (nor prefixed "sessions:"), or with a
        request-trace format, another `KIND` with a folder or the "sessions" format; when
        built, what the loaders raise for a malformed trace (a name that does not tell the
        format included), or a request trace of fewer than two requests or all at one time
        (its rate is measured from them).
    """
    if isinstance(specs, str):
        raise ValueError(f"extra parts must be a sequence of KIND:PATH strings, not the string "
                         f"{specs!r}")
    n = QUICK_REQUESTS if quick else None
    out: dict[str, tuple[str, Callable[[], object]]] = {}
    for spec in specs:
        kind, sep, path = str(spec).partition(":")
        kind, path = kind.strip(), path.strip()
        if not sep or not path or kind not in LOADS:
            raise ValueError(f"--extra_parts {spec!r}: expected KIND:PATH with KIND one of "
                             f"{sorted(LOADS)} (agent sessions: agents) and PATH a trace file "
                             "or a folder of agent sessions")
        fmt, sep, rest = path.partition(":")
        fmt, file = (fmt, rest) if sep and fmt in TRACE_FORMATS else ("auto", path)
        p = pathlib.Path(file).expanduser()
        if not p.exists():
            raise ValueError(f"--extra_parts {spec!r}: {file} does not exist")
        if kind == "agents" and (fmt not in ("auto", "sessions") or not (
                p.is_dir() or p.suffix.lower() == ".json" or fmt == "sessions")):
            raise ValueError(f"--extra_parts {spec!r}: agents takes a folder of agent session "
                             f"files or one .json session file; {path} is neither (a request "
                             f"trace is given as one of {sorted(set(LOADS) - {'agents'})})")
        if kind != "agents" and (fmt == "sessions" or p.is_dir()):
            raise ValueError(f"--extra_parts {spec!r}: {kind} takes a request trace file (.jsonl "
                             f"Mooncake, .csv Azure or L-Eval); {path} is agent sessions "
                             f"(give it as agents:{path})")
        out[f"extra {kind}: {path}"] = (kind, functools.cache(functools.partial(
            _load_extra, f"--extra_parts {kind}:{path}", kind, p, fmt, n, draw_seed)))
    return out


def _load_extra(flag: str, kind: str, path: pathlib.Path, fmt: str, n: int | None,
                draw_seed: int) -> object:
    """An extra part's sessions or requests (`extra_part_loaders`); errors name `flag`."""
    try:
        if kind == "agents":
            return load_sessions(path)
        trace = load_trace(path, fmt=fmt, rate=1.0, seed=draw_seed)
    except UnknownTraceFormat as e:  # (its hint names eval.replay's flag: give this one's)
        raise ValueError(f"{flag}: cannot tell the format of {path} from its name: give it "
                         f"as {kind}:mooncake:PATH, {kind}:azure:PATH or {kind}:leval:PATH "
                         "(a .json session file: agents:PATH)") from e
    except (ValueError, OSError) as e:
        raise ValueError(f"{flag}: {e}") from e
    reqs = trace.requests[:n]
    try:
        native_rate(reqs)  # (the sweep scales the trace by it)
    except ValueError:
        span = reqs[-1].arrival_time - reqs[0].arrival_time if reqs else 0.0
        raise ValueError(f"{flag}: a request trace needs at least 2 requests spread over time "
                         f"(its rate is measured from them), got {len(reqs)} over {span:g} s"
                         ) from None
    return reqs


def select(loaders: dict[str, tuple[str, Callable[[], object]]], only: Sequence[str] | None
           ) -> dict[str, tuple[str, Callable[[], object]]]:
    """The parts whose name contains one of the strings of `only` (case-insensitive, blanks
    around them ignored); every part when `only` is empty or None.

    Raises:
      ValueError: `only` is a single string, has only blank strings, or has a string that
        matches no part (a misspelt part is not skipped in silence).
    """
    if isinstance(only, str):
        raise ValueError(f"only must be a sequence of strings, not the string {only!r}")
    given = list(only or ())
    keys = [k.strip().lower() for k in given if k.strip()]
    if given and not keys:
        raise ValueError(f"--parts {given} has only blank entries: give one or more parts of "
                         f"part names, among {list(loaders)}")
    chosen = {p: v for p, v in loaders.items() if not keys or any(k in p.lower() for k in keys)}
    unmatched = [k for k in keys if not any(k in p.lower() for p in loaders)]
    if unmatched:
        what = "none of the parts" if not chosen else f"no part for {unmatched}"
        raise ValueError(f"--parts {given} matches {what}: {list(loaders)} (a trace of your own "
                         "is a part only with --extra_parts=KIND:PATH)")
    return chosen
