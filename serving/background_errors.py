"""`BackgroundErrors`: the failures of a backend's background operations, logged and kept.

Copies, re-carves, reclaims and KV moves run beside the requests; when one fails the request
path falls back (a prefill recomputes what a copy would have brought) and nothing is answered
wrongly, so the failure is not an error of any request. It is logged once as a warning (an
operator sees it in the server's log) and kept, the latest `maxlen`, for tests and debugging.
"""

from __future__ import annotations

import collections
import logging

MAX_KEPT = 1000  # failures kept (the oldest dropped first): memory stays bounded


class BackgroundErrors(collections.deque):
    """A deque of failure messages (str), the latest `maxlen`; `append` also logs each one as a
    warning on `logger`.

    Args:
      logger: where each failure is logged.
      maxlen: failures kept, >= 1 (default `MAX_KEPT`).
    """

    def __init__(self, logger: logging.Logger, maxlen: int = MAX_KEPT) -> None:
        super().__init__(maxlen=maxlen)
        self._logger = logger

    def append(self, message: str) -> None:
        """Logs `message` as a warning and keeps it."""
        self._logger.warning("background operation failed: %s", message)
        super().append(message)
