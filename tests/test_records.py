from datetime import UTC, datetime

import pytest

from extproc.records import (
    JOURNAL_FILE,
    REQUESTS_FILE,
    RecordError,
    RunMeta,
    finalise_run_records,
    journal_row,
    read_records,
    read_run_metadata,
    write_records,
    write_run_metadata,
)

ROW = dict(
    run_id="bounded-s1",
    policy="bounded",
    seed=1,
    simulated=False,
    conversation="s1-c00000",
    turn=1,
    replica="llm-0",
    route_reason="home",
    status=200,
    started_at=1_700_000_000.0,
    finished_at=1_700_000_001.5,
)


def test_roundtrip_keeps_types_and_timestamps(tmp_path):
    write_records([ROW], tmp_path / "r.parquet")
    (row,) = read_records(tmp_path / "r.parquet").to_pylist()
    assert row["turn"] == 1 and row["cache_n"] is None
    assert row["finished_at"] == datetime(2023, 11, 14, 22, 13, 21, 500000, tzinfo=UTC)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": None}, "column seed is required"),
        ({"turn": "two"}, "column turn must be int32"),
        ({"colour": 1}, r"unknown column\(s\) \['colour'\]"),
    ],
)
def test_bad_rows_name_the_column(tmp_path, change, message):
    with pytest.raises(RecordError, match=message):
        write_records([{**ROW, **change}], tmp_path / "r.parquet")


def test_journal_cut_short_still_gives_parquet(tmp_path):
    lines = [journal_row({**ROW, "turn": n}) for n in (1, 2)]
    (tmp_path / JOURNAL_FILE).write_text("\n".join(lines) + "\n" + lines[0][:20])  # crash mid-line
    assert finalise_run_records(tmp_path) == 2
    assert [r["turn"] for r in read_records(tmp_path / REQUESTS_FILE).to_pylist()] == [1, 2]


def test_run_metadata_roundtrip(tmp_path):
    meta = RunMeta(
        run_id="x",
        policy="bounded",
        seed=1,
        simulated=True,
        profile={"name": "quick"},
        routing={"policy": "bounded"},
        replicas_start=3,
        started_at="2026-01-01T00:00:00+00:00",
    )
    write_run_metadata(meta, tmp_path)
    assert read_run_metadata(tmp_path) == meta
