"""Mooncake-format traces: read them, and find the conversations in them.

The format (Mooncake FAST'25 release; also read by SGLang bench_serving, AIPerf,
Dynamo replay): one JSON object a line with ``timestamp`` (ms from the start),
``input_length``, ``output_length`` (tokens) and ``hash_ids`` (ids of the prompt's
512-token blocks; equal ids at equal positions mean an equal prefix). The synthetic
trace at ``shared/data/mooncake_synthetic_trace.jsonl`` is Apache-2.0 (see the
README beside it); it is read from where it lies, not copied.

Traces carry no conversation ids. A request continues the conversation of the
earlier request with which it shares the longest block prefix, if that prefix
covers at least half of that earlier request's blocks (a follow-up turn resends the
history; a shared system prompt alone covers only a small share). Otherwise it
starts a new conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

FOLLOW_UP_SHARE = 0.5


class TraceError(ValueError):
    """A trace line is not in the Mooncake format; the message names the line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace not found: {path}")
    with path.open() as lines:
        numbered = ((n, line) for n, line in enumerate(lines, start=1) if line.strip())
        return [parse_line(line, f"{path}:{n}") for n, line in islice(numbered, limit)]


def parse_line(line: str, where: str) -> TraceRequest:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in raw:
            raise TraceError(f"{where}: {key}: missing")
    timestamp, inputs, outputs, hashes = raw["timestamp"], raw["input_length"], raw["output_length"], raw["hash_ids"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
        raise TraceError(f"{where}: timestamp: must be milliseconds >= 0 (got {timestamp!r})")
    for key, value in (("input_length", inputs), ("output_length", outputs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TraceError(f"{where}: {key}: must be an integer >= 1 (got {value!r})")
    if not isinstance(hashes, list) or not hashes or not all(isinstance(h, int) for h in hashes):
        raise TraceError(f"{where}: hash_ids: must be a non-empty list of integers")
    return TraceRequest(timestamp / 1000.0, inputs, outputs, tuple(hashes))


def infer_conversations(trace: list[TraceRequest]) -> list[int]:
    """Conversation number of each request (numbers in order of first appearance)."""
    # A trie of block prefixes: node id of (parent node, block id); each node remembers
    # the latest request whose prompt starts with that prefix.
    children: dict[tuple[int, int], int] = {}
    latest: list[int] = [-1]  # node 0 = the empty prefix
    conversation_of: list[int] = []
    count = 0
    for number, request in enumerate(trace):
        node, parent, path = 0, None, []
        for block in request.hash_ids:
            child = children.get((node, block))
            if child is None:
                break
            node = child
            path.append(node)
        if path:
            earlier = latest[path[-1]]
            if len(path) >= FOLLOW_UP_SHARE * len(trace[earlier].hash_ids):
                parent = earlier
        if parent is None:
            conversation_of.append(count)
            count += 1
        else:
            conversation_of.append(conversation_of[parent])
        node = 0
        for block in request.hash_ids:
            child = children.get((node, block))
            if child is None:
                child = children[(node, block)] = len(latest)
                latest.append(number)
            else:
                latest[child] = number
            node = child
    return conversation_of
