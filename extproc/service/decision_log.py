"""The route_decision line, one per request, written without structlog's per-call machinery.

structlog renders every other event; this line is the one the hot path writes, and structlog's
bound-logger call, its processors and a write + flush per line cost ~10 µs of CPU (measured,
the rendering itself ~1 µs). ``DecisionLog`` writes the same JSON object structlog writes for
``log.info("route_decision", **fields)`` with main.py's processors (the fields, then event,
level and an ISO UTC timestamp) into the same stdout buffer, and flushes once per turn of the
event loop: a burst of requests ending together costs one write. Lines of both stay in order
(one buffer; structlog's flush takes the pending lines along).
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any, BinaryIO

import orjson
import structlog

log = structlog.get_logger("extproc.service")
EVENT = "route_decision"


def through_structlog(fields: dict[str, Any]) -> None:
    """The line through structlog's configuration (tests capture it, offline tools print it);
    ``fields["event"]``, when set, names another event of the trace (``replica_left``)."""
    log.info(fields.pop("event", EVENT), **fields)


class DecisionLog:
    """Writes route_decision lines to ``out`` (main.py: stdout's buffer, at log level info or lower)."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self._flush_pending = False

    def __call__(self, fields: dict[str, Any]) -> None:
        fields.setdefault("event", EVENT)  # another event of the trace keeps its name (replica_left)
        fields["level"] = "info"
        fields["timestamp"] = datetime.datetime.now(tz=datetime.UTC).isoformat().replace("+00:00", "Z")
        self.out.write(orjson.dumps(fields, default=repr, option=orjson.OPT_APPEND_NEWLINE))
        if self._flush_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a tool calling the gateway): at once
            self.out.flush()
            return
        self._flush_pending = True
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        self.out.flush()
