"""The real HTTP app and `GracefulServer` over the fake backend (no JAX), as a process, for the
tests that need a real socket or real signals: `python -m tests.serving.fake_server --port=N`."""

from __future__ import annotations

import signal

import uvicorn
from absl import app, flags

from serving.http_server import GracefulServer
from tests.serving.api_fixtures import make_app

_PORT = flags.DEFINE_integer("port", 8000, "Port on 127.0.0.1.")
_SECONDS = flags.DEFINE_float("seconds", 0.01, "Seconds per fake prefill.")
_COMPOSITION = flags.DEFINE_list("composition", ["4", "2", "2"], "CP degrees.")
_SHUTDOWN = flags.DEFINE_float("shutdown_timeout_s", None, "Engine shutdown deadline.")
_BODY_TIMEOUT = flags.DEFINE_float("body_timeout_s", 30.0, "Body deadline (seconds).")
_MAX_IN_FLIGHT = flags.DEFINE_integer("max_in_flight", 64, "Admission limit.")


def main(argv):
    del argv
    application, engine = make_app(seconds=_SECONDS.value, max_in_flight=_MAX_IN_FLIGHT.value,
                                   composition=tuple(int(c) for c in _COMPOSITION.value),
                                   body_timeout=_BODY_TIMEOUT.value)
    server = GracefulServer(uvicorn.Config(application, host="127.0.0.1", port=_PORT.value,
                                           log_level="info"), engine, _SHUTDOWN.value,
                            header_timeout=_BODY_TIMEOUT.value)
    for sig in (signal.SIGTERM, signal.SIGINT):  # as serving.main: a graceful stop exits 0
        signal.signal(sig, lambda *_: None)
    server.run()


if __name__ == "__main__":
    app.run(main)
