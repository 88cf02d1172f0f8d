"""Client-side accounting of a soak run (`eval.live.soak`): pure logic, no I/O.

- `Ledger`: every request sent gets exactly one final outcome, per HTTP exchange: *answered*
  (200 with a valid body), *refused* with a documented status (`REFUSAL_CODES`), *abandoned*
  (the client closed the connection on purpose once the server was reading it, see
  `eval.live.soak_server.abandon`), or *lost* (anything else: a transport error or timeout, an
  undocumented status such as 500 or 400, an invalid body, or no outcome at all). A request
  with two outcomes, or a completion id (`cmpl-...`) answered to two requests, is
  *duplicated* (the client-side check; `eval.live.soak_server.check_counts` is the server-side
  one, which also catches a request the server ran twice).
- `classify_completion`: an HTTP answer of `POST /v1/completions` as one outcome.
- `FirstTokens`: the greedy first token of each repeated prompt must be the same whatever
  worker and CP degree served it.
- `distribution`: mean / P50 / P90 / max of a list of numbers.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

# Documented refusals of `POST /v1/completions` (serving/api.py): 429 overloaded (with
# Retry-After); 503 shutting down, or no worker of the current composition can hold the prompt
# (its message says "cannot be held by any worker"; `refusal_reason`). Every other non-200
# status of a valid request is a loss.
REFUSAL_CODES = {429: "overloaded", 503: "shutting down"}
NO_WORKER_FITS = "cannot be held by any worker"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The final outcome of one request.

    Attributes:
      kind: "answered", "refused", "abandoned" or "lost".
      status: the HTTP status (None when no response came; 100 for an abandoned request).
      detail: why (lost / refused / abandoned), or the completion id (answered).
    """

    kind: str
    status: int | None = None
    detail: str = ""


def classify_completion(status: int, body: object, prompt_len: int) -> Outcome:
    """One answer of `POST /v1/completions` for a prompt of `prompt_len` tokens as an `Outcome`.

    A 200 is *answered* only with a valid body: a `cmpl-` id, an int first token in
    `choices[0].token_ids[0]`, a worker id and CP degree, and `usage.prompt_tokens ==
    prompt_len` (an answer that belongs to another request is caught when lengths differ);
    otherwise it is *lost* ("invalid body: ..."). `REFUSAL_CODES` are *refused*, with the
    reason `refusal_reason` reads from the body; every other status is *lost* ("HTTP <status>:
    <message>").
    """
    if status == 200:
        problem = _body_problem(body, prompt_len)
        if problem:
            return Outcome("lost", status, f"invalid body: {problem}")
        return Outcome("answered", status, body["id"])
    msg = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        msg = str(body["error"].get("message", ""))[:200]
    if status in REFUSAL_CODES:
        return Outcome("refused", status, refusal_reason(status, msg))
    return Outcome("lost", status, f"HTTP {status}: {msg}" if msg else f"HTTP {status}")


def refusal_reason(status: int, message: str) -> str:
    """The reason of a documented refusal: "overloaded" (429); for a 503 "no worker fits" when
    its error message says the prompt `cannot be held by any worker`, else "shutting down"."""
    if status == 503 and NO_WORKER_FITS in message:
        return "no worker fits"
    return REFUSAL_CODES[status]


def _body_problem(body: object, prompt_len: int) -> str:
    if not isinstance(body, dict):
        return "not a JSON object"
    cid = body.get("id")
    if not isinstance(cid, str) or not cid.startswith("cmpl-"):
        return f"id {cid!r} is not a cmpl- id"
    try:
        token = body["choices"][0]["token_ids"][0]
    except (KeyError, IndexError, TypeError):
        return "no choices[0].token_ids[0]"
    if not isinstance(token, int) or isinstance(token, bool):
        return f"first token {token!r} is not an int"
    for key in ("worker_id", "cp_degree"):
        if not isinstance(body.get(key), int):
            return f"{key} {body.get(key)!r} is not an int"
    used = (body.get("usage") or {}).get("prompt_tokens") if isinstance(body.get("usage"), dict) \
        else None
    if used != prompt_len:
        return f"usage.prompt_tokens {used!r} != {prompt_len} tokens sent"
    return ""


class Ledger:
    """Outcomes of every request of a run, by the client's unique request id.

    `sent` opens a request, then exactly one of `answered` / `refused` / `lost` / `abandoned`
    (or `record`) must close it; `summary` counts. Counts are kept as outcomes arrive (a run of 10^6
    requests keeps one small entry per request and per completion id; `summary` is cheap).
    Times are not kept here (the caller measures latency).

    Args:
      examples: how many lost and duplicated requests are kept as examples.
    """

    def __init__(self, examples: int = 10) -> None:
        self._outcomes: dict[str, int] = {}  # request id -> outcomes recorded
        self._owner: dict[str, str] = {}  # completion id -> the request it answered first
        self._examples = examples
        self._pending = self._answered = self._abandoned = 0
        self._refused: collections.Counter = collections.Counter()  # status -> requests
        self._refused_why: collections.Counter = collections.Counter()  # reason -> requests
        self._lost: collections.Counter = collections.Counter()  # reason -> requests
        self._duplicated = 0
        self._lost_examples: list[dict] = []
        self._dup_examples: list[dict] = []

    def sent(self, rid: str) -> None:
        """Opens request `rid`.

        Raises:
          ValueError: `rid` was already sent (ids must be unique: a client bug).
        """
        if rid in self._outcomes:
            raise ValueError(f"request id {rid!r} was already sent")
        self._outcomes[rid] = 0
        self._pending += 1

    def record(self, rid: str, outcome: Outcome) -> None:
        """Adds `outcome` to request `rid`. The first outcome is the request's; a second one
        makes it duplicated, and so does an answer whose completion id already answered
        another request.

        Raises:
          KeyError: `rid` was never sent.
        """
        n = self._outcomes[rid]
        self._outcomes[rid] = n + 1
        if n == 0:
            self._pending -= 1
            if outcome.kind == "answered":
                self._answered += 1
            elif outcome.kind == "refused":
                self._refused[outcome.status] += 1
                self._refused_why[outcome.detail] += 1
            elif outcome.kind == "abandoned":
                self._abandoned += 1
            else:
                self._lost[outcome.detail.split(":")[0]] += 1
                self._example(self._lost_examples, {"request": rid,
                                                    **dataclasses.asdict(outcome)})
        else:
            self._duplicated += 1 if n == 1 else 0
            self._example(self._dup_examples, {"request": rid, "outcome": n + 1,
                                               **dataclasses.asdict(outcome)})
        if outcome.kind == "answered":
            owner = self._owner.setdefault(outcome.detail, rid)
            if owner != rid:
                self._duplicated += 1
                self._example(self._dup_examples, {"completion_id": outcome.detail,
                                                   "requests": [owner, rid]})

    def _example(self, examples: list, what: dict) -> None:
        if len(examples) < self._examples:
            examples.append(what)

    def answered(self, rid: str, completion_id: str) -> None:
        """`record`s a 200 with a valid body whose id is `completion_id`."""
        self.record(rid, Outcome("answered", 200, completion_id))

    def refused(self, rid: str, status: int, message: str = "") -> None:
        """`record`s a documented refusal (`REFUSAL_CODES`) whose error message is `message`."""
        self.record(rid, Outcome("refused", status, refusal_reason(status, message)))

    def abandoned(self, rid: str) -> None:
        """`record`s a request the client abandoned on purpose once the server read it."""
        self.record(rid, Outcome("abandoned", 100, "closed after 100 Continue"))

    def lost(self, rid: str, reason: str, status: int | None = None) -> None:
        """`record`s a request that got no documented answer (transport error, 5xx, ...)."""
        self.record(rid, Outcome("lost", status, reason))

    @property
    def num_sent(self) -> int:
        """Requests sent so far."""
        return len(self._outcomes)

    def summary(self, final: bool = True) -> dict:
        """Counts over every request sent.

        A request's outcome is its first one; a request with none is lost ("no outcome") when
        `final` (the run is over), else counted `in_flight`. `duplicated` counts the requests
        with more than one outcome plus the extra requests answered with a completion id that
        already answered another request.

        Returns:
          `sent`, `answered`, `refused` (total), `refused_by_code` ({status: count}),
          `refused_reasons` ({"overloaded" / "shutting down" / "no worker fits": count}),
          `abandoned`, `lost`,
          `lost_reasons` ({reason: count}, the reason without its message after ':' for HTTP
          and transport errors), `duplicated`, `in_flight` (0 when `final`), and examples in
          `lost_examples` / `duplicated_examples` (request id, what happened).
        """
        lost = collections.Counter(self._lost)
        examples = list(self._lost_examples)
        if final and self._pending:
            lost["no outcome"] += self._pending
            examples += [{"request": rid, "kind": "lost", "status": None,
                          "detail": "no outcome"} for rid, n in self._outcomes.items()
                         if n == 0][:max(0, self._examples - len(examples))]
        return {"sent": len(self._outcomes), "answered": self._answered,
                "refused": sum(self._refused.values()),
                "refused_by_code": {str(k): v for k, v in sorted(self._refused.items())},
                "refused_reasons": dict(self._refused_why.most_common()),
                "abandoned": self._abandoned,
                "lost": sum(lost.values()), "lost_reasons": dict(lost.most_common()),
                "duplicated": self._duplicated, "in_flight": 0 if final else self._pending,
                "lost_examples": examples, "duplicated_examples": list(self._dup_examples)}


class FirstTokens:
    """Greedy first tokens of repeated prompts, by prompt, with the CP degrees that served them.

    A prompt is consistent when every answer to it carried the same first token.
    """

    def __init__(self) -> None:
        self._seen: dict[int, dict[int, set[int]]] = collections.defaultdict(
            lambda: collections.defaultdict(set))  # prompt -> token -> CP degrees
        self.observations = 0

    def record(self, prompt: int, token: int, cp_degree: int) -> None:
        """One answer to repeated prompt number `prompt`: first token `token`, served at
        `cp_degree`."""
        self._seen[prompt][token].add(cp_degree)
        self.observations += 1

    def mismatches(self) -> list[dict]:
        """The prompts answered with more than one first token: `{"prompt", "tokens":
        {token: [CP degrees that gave it]}}`, by prompt number."""
        return [{"prompt": p, "tokens": {str(t): sorted(d) for t, d in sorted(toks.items())}}
                for p, toks in sorted(self._seen.items()) if len(toks) > 1]

    def summary(self) -> dict:
        """`prompts` (answered at least once), `observations` (answers), `multi_degree_prompts`
        (prompts answered at two or more CP degrees: the ones the check really covers),
        `degrees_seen`, `mismatched_prompts` (count) and `mismatches` (`mismatches()`)."""
        degrees = {p: set().union(*toks.values()) for p, toks in self._seen.items()}
        bad = self.mismatches()
        return {"prompts": len(self._seen), "observations": self.observations,
                "multi_degree_prompts": sum(len(d) > 1 for d in degrees.values()),
                "degrees_seen": sorted(set().union(*degrees.values())) if degrees else [],
                "mismatched_prompts": len(bad), "mismatches": bad}


def distribution(values: Sequence[float]) -> dict:
    """`{"n", "mean", "p50", "p90", "max"}` of `values` (in their unit); None for each
    statistic when `values` is empty."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "max": float(a.max())}
