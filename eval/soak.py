"""`python -m eval.soak`: the live server under a steady request stream while it splits and merges.

    python -m eval.soak                          # 1,000 splits and merges, ~25 min on 2 cores
    python -m eval.soak --operations=20          # a short run (minutes, mostly compilation)
    python -m eval.soak --url=http://127.0.0.1:8000 --admin_api_key=$ADMIN --server_pid=$PID

Starts `python -m serving.main --controller=false` with a random admin key in its environment
(`VERTUMNUS_ADMIN_API_KEY`, not on its command line) (`--composition`,
`--degrees`, `--server_flags`; its output goes to `<--out_dir>/soak-<time>.server.log`), or uses
the running server at `--url` (its admin key; its RSS only with `--server_pid`). Then, together:
`--concurrency` closed-loop senders of completions with unique ids (`--rate` caps them), a
share `--repeat_fraction` of them one of `--repeated_prompts` fixed prompts, the others unique,
each prompt's length drawn from the range `--prompt_lengths`; a share `--disconnect_fraction`
abandoned: closed `--disconnect_after_s` after the server began reading them. A split or merge
every `--interval_s` (always a legal one, in the order `--walk`: by default sweeping from the
smallest degree to the largest and back; each waited for until finished) until
`--operations` finished or `--max_duration_s` passed; the server's RSS sampled every
`--rss_interval_s`. Every request is accounted for client-side: answered once (200, a valid
body whose `usage.prompt_tokens` is the length sent), refused with a documented code (429,
503), abandoned, or lost; and server-side: `GET /metrics`'s request counters (success, aborted,
rejected, failure) must have grown by exactly answered + refused + abandoned, failure by 0.
The greedy first token of each repeated prompt must be the same at every worker and CP
degree. The code is `eval.live.soak`; what it cannot check is listed in
`eval.live.soak_report`. The server must serve the soak alone.

Prints a table (requests sent / answered / refused / abandoned / lost / duplicated, the
server's counters, first-token mismatches, reconfigurations and their times, RSS) and writes
JSON to `<--out_dir>/soak-<time>.json` (with `failures`, `verdict` and `passed`). Exit status:
0 passed; 1 failed: a request lost or duplicated, refusals above `--max_refused_fraction` of
the requests sent (with `--concurrency` below the server's `--max_in_flight` none is
expected), no request answered, server counters that disagree with the client, a first token
that differed, a split or merge answered other than 200 or 409 (a 400 too: only legal ones are
asked for), stuck, or none finished for `--reconfig_timeout_s` (e.g. each refused), error lines
in the launched server's log, or a server that did not exit 0; 2 incomplete: no failure, but
`--max_duration_s` passed before `--operations` finished; 130 after a Ctrl-C with no failure
(the stream stops, what was sent is accounted for, the table is printed).
"""

from __future__ import annotations

import logging
import secrets
import sys

import httpx
from absl import app, flags

from eval.live.soak import SoakConfig, run_soak
from eval.live.soak_report import EXIT_STATUS, table

_URL = flags.DEFINE_string("url", None, "A running server's base URL (it should run with "
                           "--controller=false); default: launch one on --port.")
_PORT = flags.DEFINE_integer("port", 8000, "Port of the launched server.", lower_bound=1,
                             upper_bound=65535)
_COMPOSITION = flags.DEFINE_string("composition", "4,4", "Initial CP degrees of the launched "
                                   "server.")
_DEGREES = flags.DEFINE_list("degrees", ["1", "2", "4", "8"], "CP degrees splits and merges may "
                             "create (passed to the launched server).")
_WALK = flags.DEFINE_enum("walk", "sweep", ["sweep", "alternate", "random"], "Order of the "
                          "operations: sweep (split down to the smallest degree, then merge up "
                          "to the largest, and again: every degree and device group is met once "
                          "enough operations ran, 13 from 4,4), "
                          "alternate (split, merge, ...; from 4,4 this only toggles one worker) "
                          "or random.")
_SERVER_FLAGS = flags.DEFINE_string("server_flags", "--log_level=warning",
                                    "More flags of the launched server.")
_ADMIN_KEY = flags.DEFINE_string("admin_api_key", None, "Admin key of the server (required "
                                 "with --url; default for a launched server: a random one).")
_API_KEY = flags.DEFINE_string("api_key", None, "Bearer key of the server's endpoints.")
_SERVER_PID = flags.DEFINE_integer("server_pid", None, "With --url: the server's process id, "
                                   "whose RSS is sampled (default: not sampled).")
_OPERATIONS = flags.DEFINE_integer("operations", 1000, "Splits and merges to finish.",
                                   lower_bound=1)
_INTERVAL = flags.DEFINE_float("interval_s", 1.5, "Seconds from the start of one split or merge "
                               "to the start of the next.", lower_bound=0.0)
_CONCURRENCY = flags.DEFINE_integer("concurrency", 8, "Requests in flight at once.",
                                    lower_bound=1)
_RATE = flags.DEFINE_float("rate", 0.0, "Cap on requests per second (0 = none).",
                           lower_bound=0.0)
_REPEATED = flags.DEFINE_integer("repeated_prompts", 8, "Fixed prompts sent again and again "
                                 "(first-token consistency).", lower_bound=1)
_REPEAT_FRACTION = flags.DEFINE_float("repeat_fraction", 0.5, "Share of requests that send a "
                                      "repeated prompt (the others: unique random prompts).",
                                      lower_bound=0.0, upper_bound=1.0)
_LENGTHS = flags.DEFINE_list("prompt_lengths", ["12", "40"], "min,max prompt length (tokens; "
                             "one value: all prompts that long): each prompt's length is drawn "
                             "uniformly from the range, so a swapped answer shows in "
                             "usage.prompt_tokens; the server pads to powers of two from 16, so "
                             "12..40 compiles 3 lengths per worker.")
_MAX_REFUSED = flags.DEFINE_float("max_refused_fraction", 0.001, "Largest share of the requests "
                                  "sent that may be refused (429, 503) without failing: with "
                                  "--concurrency below the server's --max_in_flight none is "
                                  "expected.", lower_bound=0.0, upper_bound=1.0)
_DISCONNECT = flags.DEFINE_float("disconnect_fraction", 0.02, "Share of requests abandoned: "
                                 "their connection closed once the server reads them (it "
                                 "withdraws them or runs them unseen).", lower_bound=0.0,
                                 upper_bound=1.0)
_DISCONNECT_AFTER = flags.DEFINE_float("disconnect_after_s", 0.005, "Seconds from the server's "
                                       "100 Continue to the close of an abandoned request.",
                                       lower_bound=0.0)
_MAX_DURATION = flags.DEFINE_float("max_duration_s", 3600.0, "No split or merge is started "
                                   "after this many seconds (the run is then incomplete, exit "
                                   "status 2, unless --operations finished).", lower_bound=1.0)
_REQUEST_TIMEOUT = flags.DEFINE_float("request_timeout_s", 300.0, "A completion unanswered "
                                      "this long is lost (seconds).", lower_bound=1.0)
_RECONFIG_TIMEOUT = flags.DEFINE_float("reconfig_timeout_s", 300.0, "A split or merge not "
                                       "finished this long is stuck and stops the run (seconds).",
                                       lower_bound=1.0)
_RSS_INTERVAL = flags.DEFINE_float("rss_interval_s", 5.0, "Seconds between RSS samples.",
                                   lower_bound=0.1)
_PROGRESS = flags.DEFINE_float("progress_interval_s", 30.0, "Seconds between progress lines "
                               "(0 = none).", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the prompts and of the operations chosen.")
_OUT = flags.DEFINE_string("out_dir", "out/soak", "Where the JSON (and the server log) go.")
flags.DEFINE_alias("output_dir", "out_dir")  # the name of the other tools' flag, too


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        degrees = tuple(int(d) for d in _DEGREES.value)
        lengths = tuple(int(n) for n in _LENGTHS.value)
    except ValueError:
        raise app.UsageError("--degrees and --prompt_lengths must be comma-separated "
                             "integers") from None
    if len(lengths) not in (1, 2):
        raise app.UsageError("--prompt_lengths is min,max (or one length)")
    if not _OUT.value:
        raise app.UsageError("--out_dir must name a folder")
    if flags.FLAGS["out_dir"].present > flags.FLAGS["output_dir"].present > 0:
        raise app.UsageError("give the output folder once: --out_dir or its alias --output_dir")
    if _URL.value and not _ADMIN_KEY.value:
        raise app.UsageError("--url needs --admin_api_key (the server's admin key)")
    url = _URL.value or f"http://127.0.0.1:{_PORT.value}"
    key = _ADMIN_KEY.value or secrets.token_hex(16)
    server_flags = None if _URL.value else (
        f"--port={_PORT.value} --composition={_COMPOSITION.value} --controller=false "
        f"--degrees={','.join(map(str, degrees))} {_SERVER_FLAGS.value}")
    try:
        cfg = SoakConfig(
            url=url, admin_api_key=key, api_key=_API_KEY.value, operations=_OPERATIONS.value,
            interval_s=_INTERVAL.value, concurrency=_CONCURRENCY.value, rate=_RATE.value,
            repeated_prompts=_REPEATED.value, repeat_fraction=_REPEAT_FRACTION.value,
            prompt_lengths=(lengths[0], lengths[-1]), degrees=degrees, walk=_WALK.value,
            max_duration_s=_MAX_DURATION.value,
            request_timeout_s=_REQUEST_TIMEOUT.value, reconfig_timeout_s=_RECONFIG_TIMEOUT.value,
            rss_interval_s=_RSS_INTERVAL.value, progress_interval_s=_PROGRESS.value,
            max_refused_fraction=_MAX_REFUSED.value, disconnect_fraction=_DISCONNECT.value,
            disconnect_after_s=_DISCONNECT_AFTER.value,
            seed=_SEED.value, server_pid=_SERVER_PID.value if _URL.value else None)
    except ValueError as e:
        sys.exit(f"error: {e}")
    try:
        result, path = run_soak(cfg, server_flags, _OUT.value)
    except RuntimeError as e:  # the server did not start or was not healthy
        sys.exit(f"error: {e}")
    except OSError as e:  # --out_dir cannot be made or written
        sys.exit(f"error: --out_dir={_OUT.value!r}: {e}")
    except httpx.TransportError as e:  # --url unreachable (or the server went away)
        sys.exit(f"error: {url}: {type(e).__name__}: {e}")
    print(table(result))
    for line in result["failures"]:
        print(f"FAILED: {line}")
    if result["verdict"] == "incomplete":
        print(f"INCOMPLETE: --max_duration_s={_MAX_DURATION.value:.0f} s passed after "
              f"{result['reconfigurations']['done']} of --operations={_OPERATIONS.value}")
    print(f"results in {path} ({result['verdict']})")
    sys.exit(EXIT_STATUS[result["verdict"]])


if __name__ == "__main__":
    app.run(main)
