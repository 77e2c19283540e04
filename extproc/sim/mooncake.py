"""Mooncake-format traces: read them, and find the conversations in them.

The format (Mooncake FAST'25 release; also read by SGLang bench_serving, AIPerf,
Dynamo replay): one JSON object a line with ``timestamp`` (ms from the start),
``input_length``, ``output_length`` (tokens) and ``hash_ids`` (ids of the prompt's
512-token blocks; equal ids at equal positions mean an equal prefix). The synthetic
trace at ``shared/data/mooncake_synthetic_trace.jsonl`` is Apache-2.0 (see the
README beside it); it is read from where it lies, not copied.

Plain traces of (timestamp, input_length, output_length), such as Azure's LLM inference
traces, are read too: JSONL lines without ``hash_ids``, or CSV with a header naming those
columns (Azure's ``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens`` are understood).
A numeric timestamp is milliseconds, as in Mooncake; a date-time string is taken relative
to the first line. Such a trace says nothing about shared prefixes: each request is its
own conversation and cache hits cannot be computed (``has_blocks`` is False).

Traces carry no conversation ids. A request continues the conversation of the
earlier request with which it shares the longest block prefix, if that prefix
covers at least half of that earlier request's blocks (a follow-up turn resends the
history; a shared system prompt alone covers only a small share). Otherwise it
starts a new conversation.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any

FOLLOW_UP_SHARE = 0.5
BLOCK_TOKENS = 512  # Mooncake's block size
# column names of plain traces -> ours (Azure LLM inference traces name them so)
ALIASES = {"TIMESTAMP": "timestamp", "ContextTokens": "input_length", "GeneratedTokens": "output_length"}


class TraceError(ValueError):
    """A trace line is not in the Mooncake format; the message names the line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # empty: a plain trace (no block hashes)


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """A Mooncake (or plain) JSONL trace, or a plain CSV trace, in time order."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace not found: {path}")
    with path.open(newline="") as lines:
        if path.suffix.lower() == ".csv":
            rows = enumerate(csv.DictReader(lines), start=2)
            lines_read = [_fields(dict(row), f"{path}:{n}") for n, row in islice(rows, limit)]
        else:
            numbered = ((n, line) for n, line in enumerate(lines, start=1) if line.strip())
            lines_read = [_fields(_json_object(line, f"{path}:{n}"), f"{path}:{n}")
                          for n, line in islice(numbered, limit)]
    if len({bool(hashes) for *_, hashes in lines_read}) > 1:
        raise TraceError(f"{path}: some lines have hash_ids and some do not")
    if len({isinstance(at, datetime) for at, *_ in lines_read}) > 1:
        raise TraceError(f"{path}: timestamps mix milliseconds and date-times")
    lines_read.sort(key=_first)
    start = lines_read[0][0] if lines_read else None
    return [TraceRequest(_seconds(at, start), inputs, outputs, hashes) for at, inputs, outputs, hashes in lines_read]


def _seconds(at: float | datetime, start: float | datetime | None) -> float:
    """Milliseconds -> seconds; a date-time -> seconds after the first line's."""
    if isinstance(at, datetime) and isinstance(start, datetime):
        return (at - start).total_seconds()
    assert not isinstance(at, datetime)
    return at / 1000.0


Fields = tuple[float | datetime, int, int, tuple[int, ...]]  # timestamp (ms or date), input, output, hash ids


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object")
    return raw


def _fields(raw: dict[str, Any], where: str) -> Fields:
    raw = {ALIASES.get(key, key): value for key, value in raw.items()}
    plain = "hash_ids" not in raw
    for key in ("timestamp", "input_length", "output_length"):
        if key not in raw:
            raise TraceError(f"{where}: {key}: missing")
    timestamp = raw["timestamp"]
    if isinstance(timestamp, str):
        timestamp = _number_or_date(timestamp, where)
    if not isinstance(timestamp, datetime) and (
            isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0):
        raise TraceError(f"{where}: timestamp: must be milliseconds >= 0 or a date-time (got {timestamp!r})")
    hashes = () if plain else raw["hash_ids"]
    if not plain and (not isinstance(hashes, list) or not hashes or not all(isinstance(h, int) for h in hashes)):
        raise TraceError(f"{where}: hash_ids: must be a non-empty list of integers")
    return timestamp, _integer(raw, "input_length", where), _integer(raw, "output_length", where), tuple(hashes)


def _integer(raw: dict[str, Any], key: str, where: str) -> int:
    value = raw[key]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: {key}: must be an integer >= 1 (got {value!r})")
    return value


def _number_or_date(text: str, where: str) -> float | datetime:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise TraceError(f"{where}: timestamp: {text!r} is neither milliseconds nor an ISO date-time") from None


def _first(fields: Fields) -> Any:
    return fields[0]


def jittered_arrivals(trace: list[TraceRequest], bucket_s: float, seed: int) -> list[float]:
    """Arrival times: requests that share a timestamp bucket (the trace's resolution) are
    spread over it uniformly at random with the seed; a request alone in its bucket keeps
    its time."""
    rng = random.Random(seed)
    buckets = [int(r.timestamp_s / bucket_s + 1e-9) for r in trace]  # 232.922 s / 1 ms is 232921.99…
    count: dict[int, int] = {}
    for bucket in buckets:
        count[bucket] = count.get(bucket, 0) + 1
    return [(bucket + rng.random()) * bucket_s if count[bucket] > 1 else r.timestamp_s
            for r, bucket in zip(trace, buckets, strict=True)]


def cacheable_ceiling(trace: list[TraceRequest]) -> float | None:
    """Share of prompt tokens an infinite cache shared by all would hit: the blocks seen in an
    earlier request (hash ids are chained, so a block seen before means its whole prefix was).
    None for a trace without block hashes."""
    if not trace or not trace[0].hash_ids:
        return None
    seen: set[int] = set()
    hit = total = 0
    for request in trace:
        prompt = request.input_length
        for index, block in enumerate(request.hash_ids):
            tokens = min(BLOCK_TOKENS, prompt - index * BLOCK_TOKENS)
            if tokens <= 0:
                break
            if block in seen:
                hit += tokens
            else:
                seen.add(block)
        total += prompt
    return hit / total


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
