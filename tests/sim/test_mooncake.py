"""Mooncake traces: parsing, conversation inference, per-block cache hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.sim.engine import Fleet
from extproc.sim.mooncake import TraceError, infer_conversations, read_trace
from extproc.sim.runs import run_once
from extproc.sim.workload import requests_from_trace
from tests.sim.helpers import settings, simple_cost

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def write(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_follow_ups_join_their_conversation_and_hit_per_block(tmp_path):
    path = write(tmp_path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, 9]},     # shares 1 of 3
        {"timestamp": 30000, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 4, 5]},  # a's turn 2
        {"timestamp": 40000, "input_length": 300, "output_length": 5, "hash_ids": [7]},
    ])
    trace = read_trace(path)
    assert trace[2].timestamp_s == 30.0 and trace[2].hash_ids == (1, 2, 4, 5)
    assert infer_conversations(trace) == [0, 1, 0, 2]
    workload = requests_from_trace(trace)
    assert [(r.conversation, r.turn) for r in workload.requests] == [
        ("m00000", 1), ("m00001", 1), ("m00000", 2), ("m00002", 1)]
    done = {r.request_id: r for r in run_once(workload, settings("llm-aware"), simple_cost(),
                                                  Fleet(1, 2, 0)).requests}
    assert done["r000002"].cache_n == 2 * 512  # blocks 1, 2 match; block 3 was the old partial tail


def test_bad_lines_are_named(tmp_path):
    path = write(tmp_path, [{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]},
                            {"timestamp": 1, "input_length": 10, "hash_ids": [1]}])
    with pytest.raises(TraceError, match=r"trace.jsonl:2: output_length: missing"):
        read_trace(path)


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="shared/data not beside the repository")
def test_real_trace_slice():
    trace = read_trace(SHARED_TRACE, limit=300)
    assert len(trace) == 300 and trace[0].input_length == 40160 and len(trace[0].hash_ids) == 79
    conversations = infer_conversations(trace)
    assert 0 < len(set(conversations)) < 300  # some follow-ups in the first 300 requests
    outcome = run_once(requests_from_trace(trace, 0.01), settings("bounded"), simple_cost(), Fleet(3, 2, 10**6))
    assert len(outcome.requests) == 300
    assert sum(r.cache_n for r in outcome.requests) > 0
