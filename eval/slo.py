"""Per-request TTFT SLOs.

Three forms, chosen by a spec string (the `--slo` flag of `eval.replay`):

- `scale:K` (default `scale:5`): `S_i = K * iso_i`, where `iso_i` is the request's isolated
  TTFT on the pool's reference configuration: a cold prefill (no cache) alone on a worker of
  the reference CP degree, plus the KV transfer and the first decode step. A length-aware SLO
  of this kind is what DistServe and the Vertumnus paper use, so that long prompts are not
  doomed and short ones not trivially met. The reference degree is the same for every system
  compared in one run (the largest degree in the run), so all systems face the same SLOs.
- `fixed:S`: `S_i = S` seconds for every request.
- `affine:A,B`: `S_i = A + B * L_i / 1000` seconds (A seconds plus B seconds per 1K tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from serving.policy.request import Request


@dataclasses.dataclass(frozen=True)
class SloSpec:
    """A parsed SLO spec; see the module docstring.

    Attributes:
      kind: "scale", "fixed" or "affine".
      a: K for scale, S for fixed, A for affine.
      b: B for affine, else 0.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> SloSpec:
        """Parses `scale:K`, `fixed:S` or `affine:A,B`.

        Raises:
          ValueError: naming the spec and the accepted forms, or a non-positive value.
        """
        forms = "expected 'scale:K' (K > 0), 'fixed:S' (S > 0 s) or 'affine:A,B' (A, B >= 0, not both 0)"
        kind, _, rest = spec.partition(":")
        try:
            values = [float(x) for x in rest.split(",")] if rest else []
        except ValueError:
            raise ValueError(f"slo={spec!r}: {forms}") from None
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"slo={spec!r}: values must be finite; {forms}")
        if kind in ("scale", "fixed") and len(values) == 1 and values[0] > 0:
            return cls(kind, values[0])
        if kind == "affine" and len(values) == 2 and min(values) >= 0 and max(values) > 0:
            return cls(kind, values[0], values[1])
        raise ValueError(f"slo={spec!r}: {forms}")

    def seconds(self, input_len: int, isolated_ttft: Callable[[int], float]) -> float:
        """The SLO in seconds of a request of `input_len` tokens."""
        if self.kind == "scale":
            return self.a * isolated_ttft(input_len)
        if self.kind == "fixed":
            return self.a
        return self.a + self.b * input_len / 1000.0


def assign_slos(requests: Sequence[Request], spec: SloSpec,
                isolated_ttft: Callable[[int], float]) -> list[Request]:
    """Returns copies of `requests` with `ttft_slo` set by `spec`.

    Args:
      requests: the workload.
      spec: the SLO form.
      isolated_ttft: `input_len -> seconds`, the isolated TTFT on the reference configuration.
    """
    memo: dict[int, float] = {}

    def slo(n: int) -> float:
        s = memo.get(n)
        if s is None:
            s = memo[n] = spec.seconds(n, isolated_ttft)
        return s

    return [dataclasses.replace(r, ttft_slo=slo(r.input_len)) for r in requests]
