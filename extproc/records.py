"""Per-request records (parquet, explicit schema) and run metadata (JSON).

One row per request, written by Locust (live runs) and by the simulator
(``simulated=True``) alike, so one analysis reads both. An experiment folder holds
one sub-folder per run: ``<run_id>/requests.parquet`` and ``<run_id>/run.json``.

Column meanings (timings come from llama.cpp's ``timings`` object):
- ``replica`` / ``route_reason``: the router's choice (response headers x-routed-to, x-route-reason)
- ``est_prompt_tokens``: the client's estimate of the prompt (characters / chars_per_token)
- ``predicted_cached_tokens``: what the router expected to find cached (null if not reported)
- ``cache_n``: prompt tokens reused from the replica's cache; ``prompt_n``: prompt tokens processed
- ``ttft_s``: time to first token (streamed answers only, else null); ``latency_s``: whole request
- ``queue_wait_s``: time the request waited in the router's queue (flow control; null: off, or
  not reported)
- ``status``: HTTP status (0 = no response); ``error``: null when the request succeeded
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from extproc.files import write_atomically

REQUESTS_FILE = "requests.parquet"
JOURNAL_FILE = "requests.jsonl"  # rows appended as they happen; survives an interrupted run
RUN_FILE = "run.json"
SPEEDS_FILE = "speeds.parquet"  # the simulator's learnt and true replica speeds (extproc/sim/runs.py)

_TS = pa.timestamp("us", tz="UTC")

REQUEST_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("policy", pa.string(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("simulated", pa.bool_(), nullable=False),
        pa.field("conversation", pa.string(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),  # 1-based
        pa.field("replica", pa.string()),
        pa.field("route_reason", pa.string()),
        pa.field("est_prompt_tokens", pa.int64()),
        pa.field("predicted_cached_tokens", pa.int64()),
        pa.field("cache_n", pa.int64()),
        pa.field("prompt_n", pa.int64()),
        pa.field("prompt_ms", pa.float64()),
        pa.field("predicted_n", pa.int64()),
        pa.field("predicted_ms", pa.float64()),
        pa.field("ttft_s", pa.float64()),
        pa.field("latency_s", pa.float64()),
        pa.field("queue_wait_s", pa.float64()),
        pa.field("status", pa.int32(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("started_at", _TS, nullable=False),
        pa.field("finished_at", _TS, nullable=False),
    ]
)
COLUMNS = tuple(REQUEST_SCHEMA.names)


class RecordError(ValueError):
    """A row does not fit REQUEST_SCHEMA; the message names the column."""


def write_records(rows: Iterable[Mapping[str, Any]], path: str | Path) -> int:
    """Write rows (dicts keyed by column; timestamps as datetime or epoch seconds) atomically."""
    table = records_table(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parquet = pa.BufferOutputStream()
    pq.write_table(table, parquet)
    write_atomically(path, parquet.getvalue().to_pybytes())
    return table.num_rows


def records_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    normalised = [_normalise(row, number) for number, row in enumerate(rows)]
    try:
        return pa.Table.from_pylist(normalised, schema=REQUEST_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise RecordError(_name_bad_column(normalised) or f"rows do not match REQUEST_SCHEMA: {exc}") from None


def _name_bad_column(rows: list[dict[str, Any]]) -> str | None:
    for column in REQUEST_SCHEMA:
        for number, row in enumerate(rows):
            try:
                pa.array([row[column.name]], type=column.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                got = row[column.name]
                return f"row {number}: column {column.name} must be {column.type} (got {got!r})"
    return None


def read_records(path: str | Path) -> pa.Table:
    return pq.read_table(path, schema=REQUEST_SCHEMA)


def _normalise(row: Mapping[str, Any], number: int) -> dict[str, Any]:
    unknown = set(row) - set(COLUMNS)
    if unknown:
        raise RecordError(f"row {number}: unknown column(s) {sorted(unknown)}")
    out = {name: row.get(name) for name in COLUMNS}
    for name in COLUMNS:
        if out[name] is None and not REQUEST_SCHEMA.field(name).nullable:
            raise RecordError(f"row {number}: column {name} is required")
    for name in ("started_at", "finished_at"):
        value = out[name]
        if isinstance(value, int | float):
            out[name] = datetime.fromtimestamp(value, UTC)
        elif isinstance(value, str):
            out[name] = datetime.fromisoformat(value)
    return out


# --- the journal: one JSON row per line, appended while a run is going ---------------------


def journal_row(row: Mapping[str, Any]) -> str:
    """A row as one JSON line (timestamps as epoch seconds)."""
    return json.dumps({k: (v.timestamp() if isinstance(v, datetime) else v) for k, v in row.items()})


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a journal; a last line cut short by a crash is skipped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def finalise_run_records(run_dir: str | Path) -> int:
    """Turn a run's journal into requests.parquet (also after an interrupted run). Returns rows."""
    run_dir = Path(run_dir)
    journal = run_dir / JOURNAL_FILE
    rows = read_journal(journal) if journal.exists() else []
    return write_records(rows, run_dir / REQUESTS_FILE)


# --- run metadata ------------------------------------------------------------------------------


@dataclass
class RunMeta:
    """What ran, with which settings and versions, and when things happened (UTC ISO times)."""

    run_id: str
    policy: str  # the label used in records (e.g. "llm-aware" or "bounded:load_unit=tokens")
    seed: int
    simulated: bool
    profile: dict[str, Any]
    routing: dict[str, Any]  # routing knobs set for this run
    replicas_start: int
    started_at: str
    finished_at: str | None = None
    scale_at_s: float | None = None  # seconds after start when a scale-up was asked for
    scaled_to: int | None = None
    scale_ready_at: str | None = None  # when the new replica became ready (UTC ISO)
    status: str = "running"  # running | finished | interrupted | failed
    rows: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def write_run_metadata(meta: RunMeta, run_dir: str | Path) -> Path:
    path = Path(run_dir) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n")


def read_run_metadata(run_dir: str | Path) -> RunMeta:
    return RunMeta(**json.loads((Path(run_dir) / RUN_FILE).read_text()))


def utc_now() -> str:
    return datetime.now(UTC).isoformat()
