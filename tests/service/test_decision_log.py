"""The route_decision line's own writer (decision_log.py): the line structlog would write, and
one write per turn of the event loop."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from extproc.service.decision_log import DecisionLog
from extproc.service.main import configure_logging

FIELDS: dict[str, Any] = {
    "request_id": "ab12cd-1f", "conversation": "c-1", "stream": False, "cost": 17, "served": "",
    "trace": {"policy": "llm-aware", "loads": {"r0": 0, "r1": 2}, "candidates": [{"replica": "r0", "cost": 1.5}]},
    "duration_ms": 0.125, "cache_n": 3,
}  # fmt: skip


class CountingRaw(io.RawIOBase):
    """A raw stream that counts the writes reaching it (the system calls a file would see)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.writes = 0

    def writable(self) -> bool:
        return True

    def write(self, chunk: Any) -> int:
        self.writes += 1
        self.data += bytes(chunk)
        return len(chunk)


def test_the_line_is_the_one_structlog_writes_with_the_service_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", SimpleNamespace(buffer=out))
    configure_logging("info")
    try:
        # a logger of its own: configure_logging caches a logger on first use, and the module's
        # (through_structlog's) must stay uncached for the tests that capture logs
        structlog.get_logger("test").info("route_decision", **FIELDS)
        DecisionLog(out)(dict(FIELDS))  # no event loop: written and flushed at once
    finally:
        structlog.reset_defaults()
    by_structlog, own = (json.loads(line) for line in out.getvalue().splitlines())
    assert list(own) == list(by_structlog)  # the same keys in the same order
    assert {**own, "timestamp": ""} == {**by_structlog, "timestamp": ""}
    assert own["event"] == "route_decision" and own["level"] == "info"
    assert own["timestamp"].endswith("Z") and own["timestamp"][:4] == by_structlog["timestamp"][:4]


def test_lines_written_in_one_turn_of_the_event_loop_reach_the_file_in_one_write() -> None:
    raw = CountingRaw()
    writer = io.BufferedWriter(raw)
    log = DecisionLog(writer)

    async def burst() -> int:
        for number in range(3):
            log({**FIELDS, "request_id": f"r-{number}"})
        written_before_the_turn = raw.writes
        await asyncio.sleep(0)  # the loop turns: the flush runs
        return written_before_the_turn

    assert asyncio.run(burst()) == 0
    assert raw.writes == 1
    assert [json.loads(line)["request_id"] for line in raw.data.splitlines()] == ["r-0", "r-1", "r-2"]


def test_another_event_of_the_trace_keeps_its_name_in_either_writer() -> None:
    """A leaving replica's phases (service/leaving.py) go through the decision log as
    ``replica_left``, not as one more route_decision."""
    from structlog.testing import capture_logs

    from extproc.service.decision_log import through_structlog

    out = io.BytesIO()
    DecisionLog(out)({"event": "replica_left", "replica": "llm-1"})
    assert json.loads(out.getvalue())["event"] == "replica_left"
    with capture_logs() as logs:
        through_structlog({"event": "replica_left", "replica": "llm-1"})
        through_structlog(dict(FIELDS))
    assert [line["event"] for line in logs] == ["replica_left", "route_decision"]
