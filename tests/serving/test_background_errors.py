"""Failures of background operations are logged once each and kept, the latest few."""

from __future__ import annotations

import logging

from serving.background_errors import BackgroundErrors


def test_each_failure_is_logged_as_a_warning_and_only_the_latest_are_kept(caplog):
    errors = BackgroundErrors(logging.getLogger("test.background"), maxlen=3)
    assert not errors
    with caplog.at_level(logging.WARNING, logger="test.background"):
        for k in range(5):
            errors.append(f"copy {k}->9 failed")
    assert list(errors) == ["copy 2->9 failed", "copy 3->9 failed", "copy 4->9 failed"]
    assert [r.getMessage() for r in caplog.records] == [
        f"background operation failed: copy {k}->9 failed" for k in range(5)]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
