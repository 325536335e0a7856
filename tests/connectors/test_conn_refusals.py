"""The refusal log: the first few refused objects one line each, then one line per
interval with the count by reason, and the rest at close."""

from __future__ import annotations

import logging

import pytest

from kvplugin import serde
from kvplugin.connectors.refusals import RefusalLog, reason_of


def test_reasons() -> None:
    assert [reason_of(e) for e in (serde.ChecksumMismatch("x"), serde.Unauthenticated("x"),
                                   serde.MetadataMismatch("x"), serde.TruncatedBlock("x"),
                                   serde.UnknownFormatVersion("x"))] == [
        "checksum", "checksum", "metadata", "truncated", "format"]


def test_first_few_then_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RefusalLog(logging.getLogger("t"), first=2, interval_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, "t")
    err = serde.ChecksumMismatch("payload checksum mismatch")
    for i in range(6):
        now[0] = i  # seconds
        log.refused("disk", f"id{i}", "checksum" if i % 2 else "truncated", err)
    now[0] = 12.0
    log.refused("disk", "id6", "checksum", err)  # the interval is over: the sum is said
    log.refused("disk", "id7", "metadata", err)
    log.flush("disk")
    log.flush("disk")  # nothing held: silent
    assert [r.getMessage() for r in caplog.records] == [
        "disk: dropping corrupt object id0 (truncated): payload checksum mismatch",
        "disk: dropping corrupt object id1 (checksum): payload checksum mismatch; more are "
        "counted, and summed up every 10 s",
        "disk: 5 more corrupt objects dropped (checksum 3, truncated 2)",
        "disk: 1 more corrupt objects dropped (metadata 1)",
    ]
